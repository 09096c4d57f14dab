"""Every `from ernie_image... import name` in the repository's scripts resolves: the bench scripts, the tests and the
Python snippets they hand to child processes as strings (which no import of the file itself would check), so a
module moved or a name renamed fails here, on the CPU, not in a GPU run that imports them."""
from __future__ import annotations

import ast
import importlib
import re
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parent.parent
IMPORT_LINE = re.compile(r"^[ \t]*from[ \t]+(ernie_image[\w.]*)[ \t]+import[ \t]+(?:\(([\w\s,]+)\)|([\w \t,]+))",
                         re.MULTILINE)
SCRIPTS = sorted(p for folder in ("bench", "tests", "scripts") for p in (REPO_ROOT / folder).glob("*.py"))


def imports_in(path: Path) -> list[tuple[str, str]]:
    """(module, name) of every ernie_image import in the file's code and in its string literals."""
    tree = ast.parse(path.read_text(encoding="utf-8"))
    found: list[tuple[str, str]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("ernie_image"):
            found += [(node.module, alias.name) for alias in node.names]
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and "ernie_image" in node.value:
            found += imports_in_text(node.value)
    return found


def imports_in_text(text: str) -> list[tuple[str, str]]:
    return [(module, name.strip()) for module, in_parens, plain in IMPORT_LINE.findall(text)
            for name in (in_parens or plain).split(",") if name.strip()]


def resolves(module: str, name: str) -> bool:
    imported = importlib.import_module(module)
    if hasattr(imported, name):
        return True
    try:
        importlib.import_module(f"{module}.{name}")
    except ImportError:
        return False
    return True


@pytest.mark.parametrize("path", SCRIPTS, ids=lambda p: f"{p.parent.name}/{p.name}")
def test_every_ernie_image_import_of_the_script_resolves(path: Path) -> None:
    missing = [f"from {module} import {name}" for module, name in imports_in(path) if not resolves(module, name)]
    assert not missing, f"{path.relative_to(REPO_ROOT)}: {missing}"


def test_the_scan_reads_import_lines_inside_a_snippet_and_refuses_a_missing_name() -> None:
    snippet = ("import json\nfrom ernie_image.runtime.core.host import NullHost, Host\n"
               "from ernie_image import (\n    LocalPipe,\n)\nx = 1\n")
    assert imports_in_text(snippet) == [("ernie_image.runtime.core.host", "NullHost"),
                                        ("ernie_image.runtime.core.host", "Host"), ("ernie_image", "LocalPipe")]
    assert resolves("ernie_image.runtime.core.host", "NullHost")
    assert not resolves("ernie_image.runtime.core.host", "NoSuchName")
