"""runtime/ has no import cycle (scripts/import_graph.py: every import statement, deferred ones included), never
imports ComfyUI or the pack's nodes, and its engine never reaches up into the command line or the demo models."""
from __future__ import annotations

import ast
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
# The command line: its modules, the demo it builds, and `check-remote` (which the node's "Test connection" shares).
COMMAND_LINE = {"runtime.cli.commands", "runtime.cli.checks", "runtime.cli.parser", "runtime.demo.cached_model", "runtime.remote.server_check"}
# Above the engine: what the command line and the nodes drive. Tiny random models are for the demo and tests.
UPPER = {"runtime.cli.commands", "runtime.cli.checks", "runtime.cli.parser", "runtime.demo.cached_model", "runtime.local.pipe"}
TINY_USERS = {"runtime.demo.cached_model", "runtime.demo.tiny_pe"}  # tiny_pe: the prompt-enhancer half of the tiny models


def _is_command_line(module: str) -> bool:
    return module in COMMAND_LINE or module == "runtime.cli" or module.startswith("runtime.cli.") or module.startswith("runtime.local.")


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


def test_the_engine_never_reaches_up_into_the_command_line_or_the_tiny_models():
    graph = import_graph.import_graph()
    upward = [f"{name} -> {sorted(deps & UPPER)}" for name, deps in sorted(graph.items())
              if deps & UPPER and not _is_command_line(name)]
    assert not upward, "engine modules importing the command line or LocalPipe: " + "; ".join(upward)
    tiny = [name for name, deps in sorted(graph.items()) if "runtime.demo.tiny" in deps and name not in TINY_USERS]
    assert not tiny, f"modules importing runtime.demo.tiny (the demo's and tests' random models): {tiny}"


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
