"""Short file-system steps that a Ctrl-C must not cut in half: a scratch file made and not yet removed, partial
files half removed. The CLI's signal handler asks `interrupt_now()` before it raises KeyboardInterrupt: inside such
a step the signal is only remembered, and the step raises KeyboardInterrupt once it is over. A signal before the
step starts interrupts as always (nothing was made yet)."""
from __future__ import annotations

import contextlib
from typing import Iterator

_depth = 0  # steps under way (they may nest)
_deferred = False  # a signal arrived during one


def interrupt_now() -> bool:
    """For a signal handler: whether to raise now; False inside an uninterrupted step (which raises at its end)."""
    global _deferred
    if _depth:
        _deferred = True
        return False
    return True


@contextlib.contextmanager
def uninterrupted() -> Iterator[None]:
    """Run the block to its end whatever signals arrive; one that arrived raises KeyboardInterrupt after it."""
    global _depth, _deferred
    _depth += 1
    try:
        yield
    finally:
        _depth -= 1
        if not _depth and _deferred:
            _deferred = False
            raise KeyboardInterrupt
