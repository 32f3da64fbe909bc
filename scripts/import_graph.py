"""The import graph of `sitsd/` (and `bench/`), drawn from the code: loops and upward imports.

Every `import` statement counts, wherever it stands (a function body, `if TYPE_CHECKING:`): a
lazy import is still a dependency, and a loop through one is still a loop. `sitsd/kernels` is
the top-level `kernels/` folder (the package ships it as `sitsd.kernels`).

    python scripts/import_graph.py            # loops, upward imports, the layer of each package
    python scripts/import_graph.py --dot      # the package graph in Graphviz dot
    python scripts/import_graph.py --modules  # every module's sitsd imports

Layers, lowest first; a package may import its own layer and the layers below it:

    base       sitsd (the package root), types, outputs, config, flag_types, tiers_file,
               children
    kernels    the Triton kernels and their references
    quant      quantized weight layouts and the checkpoint formats converted into them
    plugins    the plugin interface and the bundled plugins
    model      the Llama model, its layers and linear dispatch
    runtime    model runner, input batches, CUDA graphs, weight slots, sampler
    engine     scheduler, engine core, swap controller, async engine
    loaders    checkpoint formats, tokenizer, chat templates, manifests (sitsd.weights.* below)
    observability
    weights    hot-swap management (swap manager, stager, canary, versions, watcher)
    api        gRPC servicers and interceptors
    http       the OpenAI-compatible HTTP front end
    client     the trainers' client (`sitsd.client`: pushes weights over the Admin API)
    ctl        sitsctl
    app        the composition root, the daemon and its start-up checks, the `sitsd` command
    testing    test doubles and in-process peers shared by the tests and the benchmarks

Exit status 1 when there is a loop or an upward import (`make lint` runs it, and
`tests/test_import_graph.py` pins the same).
"""

from __future__ import annotations

import argparse
import ast
import sys
from collections.abc import Iterable
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

LAYERS: tuple[tuple[str, tuple[str, ...]], ...] = (
    (
        "base",
        (
            "sitsd",
            "sitsd.types",
            "sitsd.outputs",
            "sitsd.config",
            "sitsd.flag_types",
            "sitsd.tiers_file",
            "sitsd.children",
        ),
    ),
    ("kernels", ("sitsd.kernels",)),
    ("quant", ("sitsd.quant",)),
    ("plugins", ("sitsd.plugins",)),
    ("model", ("sitsd.model",)),
    ("runtime", ("sitsd.runtime",)),
    ("engine", ("sitsd.engine",)),
    (
        "loaders",
        (
            "sitsd.weights",  # the package root re-exports the loaders
            "sitsd.weights.checkpoint",
            "sitsd.weights.formats",
            "sitsd.weights.gguf_file",
            "sitsd.weights.gguf_rope",
            "sitsd.weights.hf",
            "sitsd.weights.tokenizer",
            "sitsd.weights.chat_template",
            "sitsd.weights.embedded",
            "sitsd.weights.manifest",
            "sitsd.weights.errors",
            "sitsd.weights.export",
            "sitsd.weights.quant",
        ),
    ),
    ("observability", ("sitsd.observability",)),
    ("weights", ("sitsd.weights.",)),  # every other module of sitsd.weights
    ("api", ("sitsd.api",)),
    ("http", ("sitsd.http",)),
    ("client", ("sitsd.client",)),
    ("ctl", ("sitsd.ctl",)),
    (
        "app",
        (
            "sitsd.app",
            "sitsd.cli",
            "sitsd.cli_observability",
            "sitsd.cli_quantize",
            "sitsd.daemon",
            "sitsd.__main__",
            "sitsd.builder",
            "sitsd.preflight",
        ),
    ),
    ("testing", ("sitsd.testing",)),
)


def module_files() -> dict[str, Path]:
    """Module name -> file, for every module of sitsd (kernels included) and bench."""
    found: dict[str, Path] = {}
    for base, prefix in ((ROOT / "sitsd", "sitsd"), (ROOT / "kernels", "sitsd.kernels"),
                         (ROOT / "bench", "bench")):  # fmt: skip
        for path in sorted(base.rglob("*.py")):
            rel = path.relative_to(base).with_suffix("")
            if "v1" in rel.parts and prefix == "sitsd" and rel.parts[0] == "api":
                continue  # generated gRPC stubs
            if rel.parts[0] == "kernels" and prefix == "sitsd":
                continue  # the symlink to kernels/
            parts = [p for p in rel.parts if p != "__init__"]
            found[".".join([prefix, *parts])] = path
    return found


def _resolve(module: str, is_package: bool, node: ast.ImportFrom) -> str:
    if node.level == 0:
        return node.module or ""
    base = module.split(".")
    if not is_package:
        base = base[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def imports_of(module: str, path: Path, known: Iterable[str]) -> set[str]:
    """The sitsd/bench modules `module` imports (a name imported from a package that is a
    module of its own counts as that module)."""
    known = set(known)
    tree = ast.parse(path.read_text(), str(path))
    out: set[str] = set()
    is_package = path.name == "__init__.py"

    def add(name: str) -> None:
        if name.startswith("kernels") and not name.startswith("sitsd."):
            name = "sitsd." + name
        elif module.startswith("bench.") and f"bench.{name}" in known:
            name = f"bench.{name}"  # a bench script importing a sibling by its bare name
        while name and name not in known:
            name = name.rpartition(".")[0]
        if name and name != module:
            out.add(name)

    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                add(alias.name)
        elif isinstance(node, ast.ImportFrom):
            target = _resolve(module, is_package, node)
            for alias in node.names:
                full = f"{target}.{alias.name}"
                add(full if full in known else target)
    return out


def layer_of(module: str) -> int | None:
    """Index into `LAYERS` of a sitsd module (None for bench)."""
    best: tuple[int, int] | None = None  # (prefix length, layer)
    for index, (_, prefixes) in enumerate(LAYERS):
        for prefix in prefixes:
            if prefix.endswith("."):
                hit = module.startswith(prefix)
            else:  # the package itself and its modules; "sitsd" alone is only the root
                hit = module == prefix or (module.startswith(prefix + ".") and prefix != "sitsd")
            if hit and (best is None or len(prefix) > best[0]):
                best = (len(prefix), index)
    return None if best is None else best[1]


def strongly_connected(graph: dict[str, set[str]]) -> list[list[str]]:
    """Tarjan's algorithm: the components with more than one module (the loops)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    loops: list[list[str]] = []
    counter = 0
    sys.setrecursionlimit(10_000)

    def visit(node: str) -> None:
        nonlocal counter
        index[node] = low[node] = counter
        counter += 1
        stack.append(node)
        on_stack.add(node)
        for succ in graph.get(node, ()):
            if succ not in index:
                visit(succ)
                low[node] = min(low[node], low[succ])
            elif succ in on_stack:
                low[node] = min(low[node], index[succ])
        if low[node] == index[node]:
            component = []
            while True:
                top = stack.pop()
                on_stack.discard(top)
                component.append(top)
                if top == node:
                    break
            if len(component) > 1:
                loops.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return loops


def build_graph() -> dict[str, set[str]]:
    files = module_files()
    return {name: imports_of(name, path, files) for name, path in files.items()}


def upward_imports(graph: dict[str, set[str]]) -> list[tuple[str, str]]:
    """(importer, imported) pairs where a sitsd module imports from a higher layer."""
    bad = []
    for module, targets in sorted(graph.items()):
        mine = layer_of(module)
        if mine is None:
            continue
        for target in sorted(targets):
            theirs = layer_of(target)
            if theirs is not None and theirs > mine:
                bad.append((module, target))
    return bad


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dot", action="store_true", help="print the layer graph as dot")
    parser.add_argument("--modules", action="store_true", help="print each module's imports")
    args = parser.parse_args(argv)
    graph = build_graph()
    if args.modules:
        for module, targets in sorted(graph.items()):
            print(f"{module}: {', '.join(sorted(targets)) or '-'}")
        return 0
    if args.dot:
        edges = set()
        for module, targets in graph.items():
            for target in targets:
                a, b = layer_of(module), layer_of(target)
                if a is not None and b is not None and a != b:
                    edges.add((LAYERS[a][0], LAYERS[b][0]))
        print("digraph sitsd {\n  rankdir=BT;")
        for a, b in sorted(edges):
            print(f'  "{a}" -> "{b}";')
        print("}")
        return 0
    loops = strongly_connected(graph)
    upward = upward_imports(graph)
    unlayered = sorted(m for m in graph if m.startswith("sitsd") and layer_of(m) is None)
    for loop in loops:
        print("loop: " + " <-> ".join(loop))
    for module, target in upward:
        mine, theirs = layer_of(module) or 0, layer_of(target) or 0
        print(f"upward: {module} ({LAYERS[mine][0]}) -> {target} ({LAYERS[theirs][0]})")
    for module in unlayered:
        print(f"no layer: {module}")
    num_edges = sum(len(t) for t in graph.values())
    print(f"{len(graph)} modules, {num_edges} imports: {len(loops)} loops, "
          f"{len(upward)} upward imports")  # fmt: skip
    return 1 if loops or upward or unlayered else 0


if __name__ == "__main__":
    sys.exit(main())
