"""`bench/` is a package run as `python -m bench.NAME`: every module imports, none edits
`sys.path` or imports the test suite, none is in an import loop, and every benchmark documents
its `-m` command and answers `--help` without measuring anything.

The benchmarks themselves never run here (most need a GPU; all take minutes).
"""

from __future__ import annotations

import ast
import importlib
import importlib.util
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
BENCH = ROOT / "bench"
MODULES = sorted(path.stem for path in BENCH.glob("*.py") if path.stem != "__init__")


def source_tree(name: str) -> ast.Module:
    path = BENCH / f"{name}.py"
    return ast.parse(path.read_text(), str(path))


def has_main(name: str) -> bool:
    return any(
        isinstance(node, ast.FunctionDef) and node.name == "main" for node in source_tree(name).body
    )


BENCHMARKS = [name for name in MODULES if has_main(name)]


pytestmark = pytest.mark.usefixtures("bench_package")  # `bench` importable (conftest)


def test_bench_holds_the_benchmarks_and_their_shared_modules() -> None:
    assert {"bench_gpu", "bench_cpu", "sim_tiers"} <= set(BENCHMARKS)
    assert {"timing", "floors", "shapes"} <= set(MODULES) - set(BENCHMARKS)


@pytest.mark.parametrize("name", MODULES)
def test_every_bench_module_imports(name: str) -> None:
    module = importlib.import_module(f"bench.{name}")
    assert module.__doc__, f"bench/{name}.py says nothing about what it does"


@pytest.mark.parametrize("name", ["__init__", *MODULES])
def test_no_bench_module_touches_sys_path(name: str) -> None:
    uses = [
        node.lineno
        for node in ast.walk(source_tree(name))
        if (
            isinstance(node, ast.Attribute)
            and node.attr == "path"
            and isinstance(node.value, ast.Name)
            and node.value.id == "sys"
        )
        or (
            isinstance(node, ast.ImportFrom)
            and node.module == "sys"
            and any(alias.name == "path" for alias in node.names)
        )
    ]
    assert not uses, f"bench/{name}.py uses sys.path on lines {uses}"


@pytest.mark.parametrize("name", ["__init__", *MODULES])
def test_no_bench_module_imports_the_test_suite(name: str) -> None:
    imported = []
    for node in ast.walk(source_tree(name)):
        if isinstance(node, ast.Import):
            imported += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            imported.append(node.module)
    from_tests = [m for m in imported if m == "tests" or m.startswith("tests.")]
    assert not from_tests, f"bench/{name}.py imports {from_tests}"


def test_no_bench_module_is_in_an_import_loop() -> None:
    spec = importlib.util.spec_from_file_location("import_graph", ROOT / "scripts/import_graph.py")
    assert spec is not None
    assert spec.loader is not None
    import_graph = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(import_graph)
    graph = import_graph.build_graph()
    assert {f"bench.{name}" for name in MODULES} <= set(graph)
    loops = [loop for loop in import_graph.strongly_connected(graph)
             if any(m.startswith("bench.") for m in loop)]  # fmt: skip
    assert not loops


@pytest.mark.parametrize("name", BENCHMARKS)
def test_every_benchmark_documents_its_module_command(name: str) -> None:
    doc = ast.get_docstring(source_tree(name)) or ""
    assert f"-m bench.{name}" in doc, f"bench/{name}.py's usage line is not `python -m`"


@pytest.mark.parametrize("name", BENCHMARKS)
def test_every_benchmark_answers_help_without_measuring(
    name: str, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    module = importlib.import_module(f"bench.{name}")
    monkeypatch.setattr(sys, "argv", [f"{name}.py", "--help"])
    with pytest.raises(SystemExit) as exited:
        module.main()
    assert exited.value.code == 0
    assert capsys.readouterr().out.startswith("usage:")


def test_every_int4_sweep_label_names_its_configuration() -> None:
    # The 32-layer chain takes each layer's winner back from its printed label.
    from bench.bench_quant_kernels import config_of, describe, int4_sweep

    for num_rows in (1, 2, 8, 64, 128, 200):
        for config in int4_sweep(num_rows):
            assert config_of(f"sweep {describe(config)}") == config
    assert config_of("int4 g128 default merged") is None
