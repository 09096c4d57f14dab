"""Which pipes the nodes have made that are still alive, so the pack can report and release its memory.

Held weakly: ComfyUI's node cache is the only owner of a pipe, so when ComfyUI drops its cache (POST /free
with free_memory, the UI's "Free model and node cache") the pipe is garbage collected with its weights.
"""
from __future__ import annotations

import logging
import threading
import weakref
from typing import Any

from ..runtime.pipe import ErniePipe

log = logging.getLogger("ernie_image")

_live: "weakref.WeakSet[Any]" = weakref.WeakSet()
# Held while a pipe generates, so an HTTP "free" waits for the run instead of pulling weights from under it.
generation_lock = threading.Lock()


def track(pipe: ErniePipe) -> ErniePipe:
    _live.add(pipe)
    return pipe


def live_pipes() -> list[ErniePipe]:
    return list(_live)


def release_quietly(pipe: Any) -> None:
    """Free a pipe's device memory after an error or a cancel; a failure here must not hide the first error."""
    try:
        pipe.release()
    except Exception as error:  # noqa: BLE001 - reported, never raised over the original error
        log.warning("[ERNIE-Image] releasing memory after a failed run also failed: %s", error)


def release_all() -> int:
    with generation_lock:
        pipes = live_pipes()
        for pipe in pipes:
            release_quietly(pipe)
    return len(pipes)


def summary() -> dict[str, Any]:
    pipes = live_pipes()
    return {
        "live_pipes": len(pipes),
        "pipes": [{"kind": getattr(p, "kind", "?"), "loaded": bool(p.is_loaded()), "plan": _describe(p)} for p in pipes],
    }


def _describe(pipe: Any) -> str:
    try:
        return pipe.describe()
    except Exception as error:  # noqa: BLE001 - a status page must not fail
        return f"(describe failed: {error})"
