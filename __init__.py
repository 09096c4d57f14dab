"""ERNIE-Image for ComfyUI.

ComfyUI imports this folder as a custom-node package. Outside ComfyUI (pip install, CLI, tests) the
import must not fail, so the node mappings are built only when ComfyUI's modules are importable.
"""
from __future__ import annotations

WEB_DIRECTORY = "./web"

try:
    from .nodes import NODE_CLASS_MAPPINGS, NODE_DISPLAY_NAME_MAPPINGS
except ImportError as error:  # pragma: no cover - depends on the host
    NODE_CLASS_MAPPINGS: dict = {}
    NODE_DISPLAY_NAME_MAPPINGS: dict = {}
    _IMPORT_ERROR = error

__all__ = ["NODE_CLASS_MAPPINGS", "NODE_DISPLAY_NAME_MAPPINGS", "WEB_DIRECTORY"]
