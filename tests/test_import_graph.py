"""runtime/'s imports (scripts/import_graph.py: every import statement, deferred ones included) follow the order
of its packages, with no cycle and no exemption; nothing in it imports the command line, only the command line
imports the demo models, and none of it imports ComfyUI or the pack's nodes."""
from __future__ import annotations

import ast
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "scripts"))

import import_graph  # noqa: E402


def test_runtime_has_no_import_cycle():
    graph = import_graph.import_graph()
    found = [" -> ".join(import_graph.path_in(component, graph)) for component in import_graph.cycles(graph)]
    assert not found, "import cycles in runtime/: " + "; ".join(found)


# ComfyUI's own top-level modules (v0.8.0), and the pack's ComfyUI side (nodes/, web/).
COMFYUI_SIDE = {"comfy", "comfy_extras", "comfy_execution", "comfy_api", "comfy_api_nodes", "comfy_config",
                "folder_paths", "server", "execution", "nodes", "node_helpers", "latent_preview", "main", "web"}


def test_every_import_follows_the_order_of_the_packages():
    """A module imports its own package and packages ranked below it (import_graph.RANKS), never one above; no
    module lies loose in runtime/ and no package is left unranked."""
    found = import_graph.order_violations(import_graph.import_graph())
    assert not found, "imports against runtime/'s package order: " + "; ".join(found)


def test_every_runtime_package_is_ranked():
    packages = {init.parent.name for init in (import_graph.ROOT / "runtime").glob("*/__init__.py")}
    assert packages == set(import_graph.RANKS)


def mapped_packages(text: str) -> list[str]:
    """The packages a module map names, in its order: each line that starts (indented) with `name/`."""
    return re.findall(r"^ *(\w+)/ ", text, re.M)


def test_the_runtimes_maps_name_every_package_in_import_order_and_nothing_else():
    """runtime/__init__.py's docstring and docs/design.md's package map: what a reader takes as the module map."""
    runtime_doc = ast.get_docstring(ast.parse((import_graph.ROOT / "runtime" / "__init__.py").read_text()))
    assert mapped_packages(runtime_doc) == list(import_graph.RANKS)
    design = (import_graph.ROOT / "docs" / "design.md").read_text()
    package_map = next(block for block in re.findall(r"^```\n(.*?)^```", design, re.S | re.M)
                       if block.startswith("core/"))
    assert mapped_packages(package_map) == list(import_graph.RANKS)


def test_nothing_in_the_runtime_imports_the_command_line_and_only_it_imports_the_demo():
    """The CLI drives the runtime and nothing drives the CLI; the demo's tiny models reach the runtime only
    through the CLI (and, outside runtime/, the library's lazy map, nodes/ and the tests)."""
    graph = import_graph.import_graph()
    users = {name: {module for module, targets in graph.items()
                    if name in {import_graph.package_of(target) for target in targets}
                    and import_graph.package_of(module) != name} for name in ("cli", "demo")}
    assert users["cli"] == set()
    assert {import_graph.package_of(module) for module in users["demo"]} <= {"cli"}


def comfyui_imports(root: Path = import_graph.ROOT) -> list[str]:
    """`file: module` for every import in runtime/ (deferred ones included) of ComfyUI or of nodes/ and web/."""
    found = []
    for path in sorted((root / "runtime").rglob("*.py")):
        current = import_graph.module_name(path, root)
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom):
                names = [import_graph._resolve(current, path.name == "__init__.py", node)]
            else:
                continue
            found += [f"{path.relative_to(root)}: {name}" for name in names
                      if name.removeprefix("ernie_image.").split(".")[0] in COMFYUI_SIDE]
    return found


def test_runtime_never_imports_comfyui_or_the_nodes():
    found = comfyui_imports()
    assert not found, "runtime/ imports ComfyUI or the pack's ComfyUI side: " + "; ".join(found)


def test_the_comfyui_check_sees_deferred_and_relative_imports(tmp_path):
    (tmp_path / "runtime" / "sub").mkdir(parents=True)
    (tmp_path / "runtime" / "__init__.py").write_text("")
    (tmp_path / "runtime" / "server.py").write_text("from .sub import b\n")  # the runtime's own `server`: allowed
    (tmp_path / "runtime" / "sub" / "b.py").write_text(
        "from ...nodes import loader\ndef f():\n    import comfy.model_management\n    from folder_paths import x\n")
    assert comfyui_imports(tmp_path) == ["runtime/sub/b.py: nodes", "runtime/sub/b.py: comfy.model_management",
                                         "runtime/sub/b.py: folder_paths"]


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


def test_the_order_check_finds_imports_upward_and_modules_outside_the_ranks(tmp_path):
    """The checker itself: a deferred relative import of a higher package, and a loose module, are found."""
    for package in ("core", "cli"):
        (tmp_path / "runtime" / package).mkdir(parents=True)
        (tmp_path / "runtime" / package / "__init__.py").write_text("")
    (tmp_path / "runtime" / "__init__.py").write_text("")
    (tmp_path / "runtime" / "core" / "a.py").write_text("def f():\n    from ..cli import b\n")
    (tmp_path / "runtime" / "cli" / "b.py").write_text("from ..core import a\n")
    (tmp_path / "runtime" / "loose.py").write_text("")
    graph = import_graph.import_graph(tmp_path)
    assert import_graph.order_violations(graph, ("core", "cli")) == [
        "runtime.core.a -> runtime.cli.b",
        "runtime.loose: not in a ranked package (add its package to RANKS, or move it into one)"]
