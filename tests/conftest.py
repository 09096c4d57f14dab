"""Make the repository importable as the package `ernie_image`, whatever the checkout folder is called."""
from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent


def _register_package() -> None:
    if "ernie_image" in sys.modules:
        return
    spec = importlib.util.spec_from_file_location(
        "ernie_image", REPO_ROOT / "__init__.py", submodule_search_locations=[str(REPO_ROOT)]
    )
    module = importlib.util.module_from_spec(spec)
    sys.modules["ernie_image"] = module
    spec.loader.exec_module(module)


_register_package()
