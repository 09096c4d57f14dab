"""runtime/ has no import cycle (scripts/import_graph.py: every import statement, deferred ones included)."""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "scripts"))

import import_graph  # noqa: E402


def test_runtime_has_no_import_cycle():
    graph = import_graph.import_graph()
    found = [" -> ".join(import_graph.path_in(component, graph)) for component in import_graph.cycles(graph)]
    assert not found, "import cycles in runtime/: " + "; ".join(found)


def test_the_graph_sees_deferred_imports_and_cycles(tmp_path):
    """The checker itself: a cycle hidden in a function-level import is found."""
    (tmp_path / "runtime" / "sub").mkdir(parents=True)
    (tmp_path / "runtime" / "__init__.py").write_text("")
    (tmp_path / "runtime" / "sub" / "__init__.py").write_text("")
    (tmp_path / "runtime" / "a.py").write_text("from .sub import b\n")
    (tmp_path / "runtime" / "sub" / "b.py").write_text("def f():\n    from ..a import x\n")
    (tmp_path / "runtime" / "c.py").write_text("import os\nfrom . import a\n")
    graph = import_graph.import_graph(tmp_path)
    assert graph["runtime.c"] == {"runtime.a"}
    assert import_graph.cycles(graph) == [["runtime.a", "runtime.sub.b"]]
