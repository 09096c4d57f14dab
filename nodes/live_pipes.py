"""Which pipes the nodes have made that are still alive, so the pack can report and release its memory.

Held weakly: ComfyUI's node cache is the only owner of a pipe, so when ComfyUI drops its cache (POST /free
with free_memory, the UI's "Free model and node cache") the pipe is garbage collected with its weights.
"""
from __future__ import annotations

import logging
import threading
import weakref
from typing import Any

from ..runtime.core.pipe import ErniePipe

log = logging.getLogger("ernie_image")

_live: "weakref.WeakSet[Any]" = weakref.WeakSet()
# The weights' owners (a local pipe's parts and memory), held weakly apart from the pipe: one that outlives its pipe
# is memory nothing can use or free (reported by summary, so a leak shows).
_weights: "weakref.WeakSet[Any]" = weakref.WeakSet()
# Held while a pipe generates, so an HTTP "free" waits for the run instead of pulling weights from under it.
generation_lock = threading.Lock()


def track(pipe: ErniePipe) -> ErniePipe:
    _live.add(pipe)
    for owner in (getattr(pipe, "parts", None), getattr(pipe, "memory", None)):
        if owner is not None:
            _weights.add(owner)
    return pipe


def live_pipes() -> list[ErniePipe]:
    return list(_live)


def release_all() -> int:
    """Free every live pipe's memory (after any run in progress); one that fails is logged, the rest still freed."""
    with generation_lock:
        pipes = live_pipes()
        for pipe in pipes:
            try:
                pipe.release()
            except Exception as error:  # noqa: BLE001 - reported, must not keep the other pipes' memory held
                log.warning("[ERNIE-Image] releasing a %s pipe's memory failed: %s", pipe.kind, error)
    return len(pipes)


def summary() -> dict[str, Any]:
    pipes = live_pipes()
    return {
        "live_pipes": len(pipes),
        "weight_owners_alive": len(_weights),  # parts and memory of local pipes, the dropped ones' included
        "pipes": [{"kind": p.kind, "loaded": bool(p.is_loaded()), "plan": _describe(p), **_memory(p)} for p in pipes],
    }


def _memory(pipe: Any) -> dict[str, Any]:
    """A local pipe's host memory (all, page-locked) and its last job's timings and device-memory peak."""
    if not callable(getattr(pipe, "host_bytes", None)):
        return {}
    try:
        return {"host_bytes": pipe.host_bytes(), "last_run": dict(getattr(pipe, "last_run", {}) or {})}
    except Exception as error:  # noqa: BLE001 - a status page must not fail
        return {"host_bytes": None, "memory_error": str(error)}


def _describe(pipe: Any) -> str:
    try:
        return pipe.describe()
    except Exception as error:  # noqa: BLE001 - a status page must not fail
        return f"(describe failed: {error})"
