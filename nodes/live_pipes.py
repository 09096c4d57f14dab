"""Which pipes the nodes have made that are still alive, so the pack can report and release its memory.

Held weakly: ComfyUI's node cache is the only owner of a pipe, so when ComfyUI drops its cache (POST /free
with free_memory, the UI's "Free model and node cache") the pipe is garbage collected with its weights.
"""
from __future__ import annotations

import gc
import logging
import threading
import types
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


def summary(holders: bool = False) -> dict[str, Any]:
    """The live pipes and their memory; `holders`: also what holds the weights of dropped pipes (orphan_holders)."""
    pipes = live_pipes()
    report = {
        "live_pipes": len(pipes),
        "weight_owners_alive": len(_weights),  # parts and memory of local pipes, the dropped ones' included
        "pipes": [{"kind": p.kind, "loaded": bool(p.is_loaded()), "plan": _describe(p), **_memory(p)} for p in pipes],
    }
    if holders:
        report["orphaned_weights_held_by"] = orphan_holders(pipes)
    return report


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


def orphan_holders(pipes: list[Any], max_chains: int = 6, depth: int = 4) -> list[str]:
    """What still holds the weights of pipes that are gone (a leak; empty when there is none): for each such owner,
    chains of the objects referring to it, nearest first, so a report names the culprit without a debugger."""
    owned = {id(owner) for pipe in pipes for owner in (getattr(pipe, "parts", None), getattr(pipe, "memory", None))}
    orphans = [owner for owner in list(_weights) if id(owner) not in owned]
    if not orphans:
        return []
    chains: list[str] = []
    skip = {id(orphans), id(chains)} | {id(vars(o)) for o in orphans}  # their own attributes link parts to memory
    for orphan in orphans:
        _referrer_chains(orphan, [type(orphan).__qualname__], chains, skip, depth, max_chains)
    return chains[:max_chains]


def _referrer_chains(obj: Any, path: list[str], chains: list[str], skip: set[int], depth: int, limit: int) -> None:
    for referrer in gc.get_referrers(obj):
        if len(chains) >= limit:
            return
        if id(referrer) in skip or isinstance(referrer, types.FrameType):
            continue
        skip.add(id(referrer))
        here = path + [_named(referrer)]
        if depth <= 1 or isinstance(referrer, (types.ModuleType, type)):
            chains.append(" <- ".join(here))
            continue
        before = len(chains)
        _referrer_chains(referrer, here, chains, skip, depth - 1, limit)
        if len(chains) == before:
            chains.append(" <- ".join(here))


def _named(value: Any) -> str:
    kind = f"{type(value).__module__}.{type(value).__qualname__}"
    if isinstance(value, dict):  # attribute-like keys only: a dict's keys may be anything (a URL, a key)
        names = sorted(key for key in value if isinstance(key, str) and key.isidentifier())
        return f"dict{names[:5]}" if len(names) == len(value) else f"dict of {len(value)} keys"
    if isinstance(value, (types.FunctionType, types.MethodType)):
        return f"{kind} {value.__qualname__}"
    if isinstance(value, types.ModuleType):
        return f"module {value.__name__}"
    return kind
