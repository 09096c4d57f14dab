"""What holds objects that should be gone (a dropped pipe's weight owners and models), for the memory route's
`?holders=1`: chains of referrers walked through the collector's view of the heap, and the walks rationed."""
from __future__ import annotations

import gc
import sys
import threading
import time
import types
from pathlib import Path
from typing import Any, Callable

class HolderWalks:
    """The heap walk behind the memory route's `?holders=1`, rationed: it holds the interpreter for the whole walk
    (hundreds of ms in a large process), so prompts running beside a caller that polls it would crawl. One walk at a
    time (a caller arriving during one gets the last answer at once), and after a walk none for `QUIET_FACTOR` times
    as long as it took, a failed one included: in between, the last walk's answer, with its age."""

    QUIET_FACTOR = 9  # at most a tenth of the time spent walking, however often it is asked

    def __init__(self) -> None:
        self._walking = threading.Lock()
        self._last: list[str] = []
        self._done_at = float("-inf")
        self._next_at = float("-inf")

    def answer(self, walk: Callable[[], list[str]]) -> dict[str, Any]:
        if time.monotonic() >= self._next_at and self._walking.acquire(blocking=False):
            started = time.monotonic()
            try:
                self._last = walk()
                self._done_at = time.monotonic()
            finally:
                ended = time.monotonic()
                self._next_at = ended + self.QUIET_FACTOR * (ended - started)
                self._walking.release()
        return {"orphaned_weights_held_by": list(self._last),
                "holders_walked_s_ago": round(time.monotonic() - self._done_at, 2)}


def holder_chains(orphans: list[Any], models: list[Any], max_chains: int = 6, depth: int = 4) -> list[str]:
    """For each weight owner (`orphans`) and model (`models`) that outlived its pipe, chains of the objects referring
    to it, nearest first, so a report names the culprit without a debugger; empty when there is none."""
    if not orphans and not models:
        return []
    chains: list[str] = []
    skip = {id(orphans), id(models), id(chains)}
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
