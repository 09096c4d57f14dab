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
    "LocalPipe": "runtime.local.pipe",
    "LoadOptions": "runtime.local.options",
    "RemotePipe": "runtime.remote.backend",
    "RemoteSettings": "runtime.remote.backend",
    "ErniePipe": "runtime.core.pipe",
    "GenerationRequest": "runtime.core.request",
    "GenerationResult": "runtime.core.request",
    "StepCacheConfig": "runtime.core.step_cache_config",
    "VARIANT_DEFAULTS": "runtime.core.variant",
    "RESOLUTION_PRESETS": "runtime.core.request",
    "ModelSources": "runtime.formats.sources",
    "Host": "runtime.core.host",
    "NullHost": "runtime.core.host",
    "build_tiny_model": "runtime.demo.tiny",
    "demo_model_sources": "runtime.demo.cached_model",
    "load_demo_pipe": "runtime.demo.cached_model",
    "save_pngs": "runtime.files.png_output",
    "read_png_settings": "runtime.files.png_output",
    "read_image": "runtime.files.image_files",
    "read_mask": "runtime.files.image_files",
    "ErnieImageError": "runtime.core.errors",
    "InvalidInputError": "runtime.core.errors",
    "ModelFileError": "runtime.core.errors",
    "MemoryBudgetError": "runtime.core.errors",
    "RemoteError": "runtime.core.errors",
    "Cancelled": "runtime.core.errors",
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
