"""ERNIE-Image for ComfyUI.

ComfyUI imports this folder as a custom-node package. The node modules import no ComfyUI module at import
time, so the package also imports outside ComfyUI (pip install, CLI, tests). Should the nodes fail to import,
the runtime and CLI stay usable and the reason is logged, since ComfyUI then shows the pack with no nodes.
"""
from __future__ import annotations

import logging

WEB_DIRECTORY = "./web"

try:
    from .nodes import NODE_CLASS_MAPPINGS, NODE_DISPLAY_NAME_MAPPINGS
except ImportError as error:  # pragma: no cover - depends on the host
    NODE_CLASS_MAPPINGS: dict = {}
    NODE_DISPLAY_NAME_MAPPINGS: dict = {}
    logging.getLogger("ernie_image").error("[ERNIE-Image] the nodes could not be imported: %s", error)

__all__ = ["NODE_CLASS_MAPPINGS", "NODE_DISPLAY_NAME_MAPPINGS", "WEB_DIRECTORY"]
