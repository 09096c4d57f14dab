"""Every model a local pipe built, held weakly: one still alive after its pipe is gone is memory nothing can use or
free, which the ComfyUI pack's memory route reports with what holds it. Kept here, apart from the code that builds
the models, so that a status page can read it without importing model code."""
from __future__ import annotations

import threading
import weakref
from typing import Any, TypeVar

Model = TypeVar("Model")

_alive: "weakref.WeakSet[Any]" = weakref.WeakSet()
_lock = threading.Lock()  # a route reads the set on another thread while a prompt builds a model


def register_built_model(model: Model) -> Model:
    """Count `model` (a text tower, DiT, VAE half or prompt enhancer a pipe built) as long as it lives."""
    with _lock:
        _alive.add(model)
    return model


def built_models_alive() -> list[Any]:
    """The models registered that are still alive."""
    with _lock:
        return list(_alive)
