"""Which pipes the nodes have made that are still alive, so the pack can report and release its memory.

Held weakly: ComfyUI's node cache is the only owner of a pipe, so when ComfyUI drops its cache (POST /free
with free_memory, the UI's "Free model and node cache") the pipe is garbage collected with its weights.
"""
from __future__ import annotations

import gc
import logging
import sys
import threading
import weakref
from typing import Any, Iterable, Optional

from ..runtime.core.built_models import built_models_alive
from ..runtime.core.pipe import ErniePipe
from .heap_holders import HolderWalks, holder_chains

log = logging.getLogger("ernie_image")

_live: "weakref.WeakSet[Any]" = weakref.WeakSet()
# The weights' owners (a local pipe's parts and memory), held weakly apart from the pipe: one that outlives its pipe
# is memory nothing can use or free (reported by summary, so a leak shows).
_weights: "weakref.WeakSet[Any]" = weakref.WeakSet()
_tracking = threading.Lock()  # the sets are read by the routes' threads while a prompt adds to them
# Held while a pipe generates, so an HTTP "free" waits for the run instead of pulling weights from under it.
generation_lock = threading.Lock()


def track(pipe: ErniePipe) -> ErniePipe:
    with _tracking:
        _live.add(pipe)
        for owner in (getattr(pipe, "parts", None), getattr(pipe, "memory", None)):
            if owner is not None:
                _weights.add(owner)
    return pipe


def live_pipes() -> list[ErniePipe]:
    with _tracking:
        return list(_live)


def weight_owners_alive() -> list[Any]:
    with _tracking:
        return list(_weights)


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


def summary(holders: bool = False, walks: Optional[HolderWalks] = None) -> dict[str, Any]:
    """The live pipes and their memory; `holders`: also what holds the weights of dropped pipes (orphan_holders),
    walked now, or as `walks` rations it."""
    pipes = live_pipes()
    report = {
        "live_pipes": len(pipes),
        "weight_owners_alive": len(weight_owners_alive()),  # parts and memory of local pipes, dropped pipes' included
        "orphaned_models": len(_orphaned_models(pipes)),  # built by a pipe that is gone, still alive
        "device": _device_memory(),
        "pipes": [{"kind": p.kind, "loaded": bool(p.is_loaded()), "plan": _describe(p), **_memory(p)} for p in pipes],
    }
    if holders:
        def walk() -> list[str]:
            return orphan_holders(pipes)

        report.update(walks.answer(walk) if walks is not None else {"orphaned_weights_held_by": walk()})
    return report


def _device_memory() -> dict[str, int]:
    """What PyTorch's CUDA allocator has handed out and holds in this process (empty before CUDA is used): tensors
    alive show as allocated; memory freed but kept by the allocator only as reserved."""
    torch = sys.modules.get("torch")
    if torch is None or not torch.cuda.is_initialized():
        return {}
    from ..runtime.model.graph_memory import graph_memory_reserved

    device = torch.device("cuda", torch.cuda.current_device())
    return {"allocated": int(torch.cuda.memory_allocated()), "reserved": int(torch.cuda.memory_reserved()),
            "graphs_reserved": graph_memory_reserved(device)}


def _owned_models(pipes: Iterable[Any]) -> set[int]:
    owned: set[int] = set()
    for pipe in pipes:
        parts = getattr(pipe, "parts", None)
        if parts is not None:
            owned |= {id(value) for value in vars(parts).values() if isinstance(value, sys.modules["torch"].nn.Module)}
            enhancer = getattr(parts, "enhancer", None)
            if enhancer is not None:
                owned.add(id(enhancer.model))
    return owned


def _orphaned_models(pipes: list[Any]) -> list[Any]:
    """The models pipes built (core.built_models) that no live pipe holds."""
    alive = built_models_alive()
    if not alive:  # none built in this process (torch itself may not be loaded)
        return []
    owned = _owned_models(pipes)
    return [model for model in alive if id(model) not in owned]


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


def orphan_holders(pipes: list[Any]) -> list[str]:
    """What still holds the weights and models of pipes that are gone (heap_holders.holder_chains); a collection
    first, so what it names is held, not merely waiting for the collector."""
    gc.collect()
    owned = {id(owner) for pipe in pipes for owner in (getattr(pipe, "parts", None), getattr(pipe, "memory", None))}
    orphans = [owner for owner in weight_owners_alive() if id(owner) not in owned]
    return holder_chains(orphans, _orphaned_models(pipes))
