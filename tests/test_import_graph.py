"""The package's import graph (`scripts/import_graph.py`): no loop, no import up a layer, and
the tool finds both when they are there."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from types import ModuleType

REPO_ROOT = Path(__file__).resolve().parents[1]


def load_tool() -> ModuleType:
    spec = importlib.util.spec_from_file_location(
        "import_graph", REPO_ROOT / "scripts" / "import_graph.py"
    )
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_sitsd_and_bench_have_no_import_loop_and_no_upward_import():
    tool = load_tool()
    graph = tool.build_graph()
    assert tool.strongly_connected(graph) == []
    assert tool.upward_imports(graph) == []
    assert not [m for m in graph if m.startswith("sitsd") and tool.layer_of(m) is None]


def test_every_layer_holds_the_modules_it_names():
    tool = load_tool()
    names = {name for name, _ in tool.LAYERS}
    layer = {
        m: tool.LAYERS[tool.layer_of(m)][0] for m in tool.build_graph() if m.startswith("sitsd")
    }
    assert layer["sitsd.types"] == "base"
    assert layer["sitsd.engine.core"] == "engine"
    assert layer["sitsd.weights.formats"] == "loaders"
    assert layer["sitsd.weights.swap"] == "weights"
    assert layer["sitsd.builder"] == "app"
    assert set(layer.values()) <= names


def test_the_tool_finds_a_loop_and_an_upward_import():
    tool = load_tool()
    graph = {
        "sitsd.engine.a": {"sitsd.engine.b"},
        "sitsd.engine.b": {"sitsd.engine.a", "sitsd.api.server"},  # engine -> api: up
        "sitsd.api.server": {"sitsd.engine.a"},
    }
    loops = tool.strongly_connected(graph)
    assert loops == [["sitsd.api.server", "sitsd.engine.a", "sitsd.engine.b"]]
    assert tool.upward_imports(graph) == [("sitsd.engine.b", "sitsd.api.server")]
