"""ERNIE-Image for ComfyUI, and a Python library and CLI for ERNIE-Image without it.

ComfyUI imports this folder as a custom-node package and reads NODE_CLASS_MAPPINGS, NODE_DISPLAY_NAME_MAPPINGS
and WEB_DIRECTORY. The nodes, and the library names below, are imported when first asked for (PEP 562), so
`import ernie_image` and the CLI start without importing torch. Should the nodes fail to import, the runtime and
CLI stay usable and the reason is logged, since ComfyUI then shows the pack with no nodes.

The library (see the README's Library section):

    from ernie_image import GenerationRequest, LoadOptions, LocalPipe, ModelSources, NullHost, save_pngs
"""
from __future__ import annotations

from typing import Any

WEB_DIRECTORY = "./web"

_NODE_NAMES = ("NODE_CLASS_MAPPINGS", "NODE_DISPLAY_NAME_MAPPINGS")

# The public API: name -> the runtime module that defines it.
_LIBRARY = {
    "LocalPipe": "runtime.local_pipe",
    "LoadOptions": "runtime.local_pipe",
    "RemotePipe": "runtime.remote.backend",
    "RemoteSettings": "runtime.remote.backend",
    "ErniePipe": "runtime.pipe",
    "GenerationRequest": "runtime.request",
    "GenerationResult": "runtime.request",
    "StepCacheConfig": "runtime.step_cache.config",
    "VARIANT_DEFAULTS": "runtime.request",
    "RESOLUTION_PRESETS": "runtime.request",
    "ModelSources": "runtime.model_files",
    "Host": "runtime.host",
    "NullHost": "runtime.host",
    "build_tiny_model": "runtime.tiny",
    "demo_model_sources": "runtime.demo",
    "load_demo_pipe": "runtime.demo",
    "save_pngs": "runtime.png_output",
    "read_png_settings": "runtime.png_output",
    "read_image": "runtime.image_files",
    "read_mask": "runtime.image_files",
    "ErnieImageError": "runtime.errors",
    "InvalidInputError": "runtime.errors",
    "ModelFileError": "runtime.errors",
    "MemoryBudgetError": "runtime.errors",
    "RemoteError": "runtime.errors",
    "Cancelled": "runtime.errors",
}


def _node_mappings() -> None:
    try:
        from .nodes import NODE_CLASS_MAPPINGS, NODE_DISPLAY_NAME_MAPPINGS
    except ImportError as error:  # pragma: no cover - depends on the host
        import logging

        NODE_CLASS_MAPPINGS, NODE_DISPLAY_NAME_MAPPINGS = {}, {}
        logging.getLogger("ernie_image").error("[ERNIE-Image] the nodes could not be imported: %s", error)
    globals().update(NODE_CLASS_MAPPINGS=NODE_CLASS_MAPPINGS, NODE_DISPLAY_NAME_MAPPINGS=NODE_DISPLAY_NAME_MAPPINGS)


def __getattr__(name: str) -> Any:
    if name in _NODE_NAMES:
        _node_mappings()
        return globals()[name]
    if name in _LIBRARY:
        import importlib

        value = getattr(importlib.import_module(f".{_LIBRARY[name]}", __name__), name)
        globals()[name] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted({*globals(), *_NODE_NAMES, *_LIBRARY})


__all__ = ["NODE_CLASS_MAPPINGS", "NODE_DISPLAY_NAME_MAPPINGS", "WEB_DIRECTORY", *_LIBRARY]
