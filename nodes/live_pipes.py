"""Which pipes the nodes have made that are still alive, so the pack can report and release its memory.

Held weakly: ComfyUI's node cache is the only owner of a pipe, so when ComfyUI drops its cache (POST /free
with free_memory, the UI's "Free model and node cache") the pipe is garbage collected with its weights.
"""
from __future__ import annotations

import gc
import logging
import sys
import threading
import time
import types
import weakref
from pathlib import Path
from typing import Any, Iterable, Optional

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


def summary(holders: bool = False, walks: Optional["HolderWalks"] = None) -> dict[str, Any]:
    """The live pipes and their memory; `holders`: also what holds the weights of dropped pipes (orphan_holders),
    walked now, or as `walks` rations it."""
    pipes = live_pipes()
    report = {
        "live_pipes": len(pipes),
        "weight_owners_alive": len(_weights),  # parts and memory of local pipes, the dropped ones' included
        "orphaned_models": len(_orphaned_models(pipes)),  # built by a pipe that is gone, still alive
        "device": _device_memory(),
        "pipes": [{"kind": p.kind, "loaded": bool(p.is_loaded()), "plan": _describe(p), **_memory(p)} for p in pipes],
    }
    if holders:
        report.update(walks.answer(pipes) if walks is not None else {"orphaned_weights_held_by": orphan_holders(pipes)})
    return report


class HolderWalks:
    """The heap walk behind the memory route's `?holders=1`, rationed: it holds the interpreter for the whole walk
    (hundreds of ms in a large process), so prompts running beside a caller that polls it would crawl. One walk at a time, and after a
    walk none for `QUIET_FACTOR` times as long as it took: in between, the last walk's answer, with its age."""

    QUIET_FACTOR = 9  # at most a tenth of the time spent walking, however often it is asked

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._last: list[str] = []
        self._done_at = float("-inf")
        self._next_at = float("-inf")

    def answer(self, pipes: list[Any]) -> dict[str, Any]:
        with self._lock:
            now = time.monotonic()
            if now >= self._next_at:
                self._last = orphan_holders(pipes)
                self._done_at = time.monotonic()
                self._next_at = self._done_at + self.QUIET_FACTOR * (self._done_at - now)
            return {"orphaned_weights_held_by": list(self._last),
                    "holders_walked_s_ago": round(time.monotonic() - self._done_at, 2)}



def _device_memory() -> dict[str, int]:
    """What PyTorch's CUDA allocator has handed out and holds in this process (empty before CUDA is used): tensors
    alive show as allocated; memory freed but kept by the allocator only as reserved."""
    torch = sys.modules.get("torch")
    if torch is None or not torch.cuda.is_initialized():
        return {}
    from ..runtime.model.cuda_capture import graph_memory_reserved

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
    if "torch" not in sys.modules:  # no model was ever built
        return []
    from ..runtime.local.parts import built_models_alive

    owned = _owned_models(pipes)
    return [model for model in built_models_alive() if id(model) not in owned]


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
    gc.collect()  # what the walk names is then held, not merely waiting for the collector
    owned = {id(owner) for pipe in pipes for owner in (getattr(pipe, "parts", None), getattr(pipe, "memory", None))}
    orphans = [owner for owner in list(_weights) if id(owner) not in owned]
    models = _orphaned_models(pipes)
    if not orphans and not models:
        return []
    chains: list[str] = []
    skip = {id(pipes), id(orphans), id(models), id(chains)}
    skip |= {id(vars(o)) for o in orphans}  # their own attributes link parts to memory
    for orphan in orphans:
        _referrer_chains(orphan, [type(orphan).__qualname__], chains, skip, depth, max_chains)
    for model in models:  # a model's holder sits a few modules up: follow further
        before = len(chains)
        _referrer_chains(model, [type(model).__qualname__], chains, skip, depth + 4, 2 * max_chains)
        if len(chains) == before:
            chains.append(f"{type(model).__qualname__} <- {UNSEEN_HOLDER}; threads now: {_threads_now()}")
    return chains[:2 * max_chains]


# The collector does not see a running frame's locals (nor native code's references), and reading them through
# frame.f_locals would itself keep them (Python < 3.13 caches the snapshot on the frame): a model no referrer
# holds is named with the threads that could.
UNSEEN_HOLDER = "nothing the collector sees (a running frame's local variable, or native code)"


def _threads_now() -> str:
    """Each other thread's name and the function it is in: who could hold a model in a local variable."""
    names = {thread.ident: thread.name for thread in threading.enumerate()}
    frames = sys._current_frames()
    try:
        return "; ".join(f"{names.get(ident, ident)} in {_frame_named(frame)}"
                         for ident, frame in frames.items() if ident != threading.get_ident())
    finally:
        del frames  # it holds this frame: a cycle that would keep the walk's locals (the orphans) until a collection


def _referrer_chains(obj: Any, path: list[str], chains: list[str], skip: set[int], depth: int, limit: int) -> None:
    """Chains of what refers to `obj`, up to `depth` links; a frame (finished or suspended: the collector sees only
    those) ends a chain, the walk's own frames skipped."""
    for referrer in gc.get_referrers(obj):
        if len(chains) >= limit:
            return
        if id(referrer) in skip:
            continue
        if isinstance(referrer, types.FrameType):
            if referrer.f_code.co_filename != __file__:
                chains.append(" <- ".join(path + [_frame_named(referrer)]))
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


def _frame_named(frame: types.FrameType) -> str:
    function = getattr(frame.f_code, "co_qualname", frame.f_code.co_name)
    return f"frame {function} ({Path(frame.f_code.co_filename).name}:{frame.f_lineno})"


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
