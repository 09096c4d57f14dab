"""`run_sync` runs a coroutine on a private event-loop thread, for sync callers (ComfyUI node functions, the CLI);
`run_soon` starts one there without waiting (closing connections from a finalizer)."""
from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from typing import Any, Callable, Coroutine, Optional, TypeVar

from .cancellation import CANCEL_POLL_S

T = TypeVar("T")


class _LoopThread:
    """A private event loop on a daemon thread; never the host's own loop (ComfyUI runs one elsewhere)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._loop: Optional[asyncio.AbstractEventLoop] = None
        self._thread: Optional[threading.Thread] = None

    def loop(self) -> asyncio.AbstractEventLoop:
        with self._lock:
            if self._loop is None or not self._thread or not self._thread.is_alive():
                loop = asyncio.new_event_loop()
                ready = threading.Event()

                def serve() -> None:
                    asyncio.set_event_loop(loop)
                    loop.call_soon(ready.set)
                    loop.run_forever()

                thread = threading.Thread(target=serve, name="ernie-image-remote-loop", daemon=True)
                thread.start()
                ready.wait()
                self._loop, self._thread = loop, thread
            return self._loop

    def in_loop_thread(self) -> bool:
        return self._thread is not None and threading.current_thread() is self._thread


_LOOP = _LoopThread()


def run_soon(coro: Coroutine[Any, Any, Any]) -> None:
    """Start `coro` on the private loop and return at once (closing connections from a finalizer)."""
    asyncio.run_coroutine_threadsafe(coro, _LOOP.loop())


def run_sync(coro: Coroutine[Any, Any, T], poll: Optional[Callable[[], None]] = None) -> T:
    """Run `coro` on the private loop thread and block this (non-loop) thread until it finishes.

    Blocking here is fine: ComfyUI runs node functions on a worker thread, not on its asyncio loop. `poll` runs
    on this thread every 0.1 s while waiting (`Host.check_cancel`, progress): whatever it raises (Cancelled)
    cancels the coroutine and propagates, and so does Ctrl-C in the CLI.
    """
    if _LOOP.in_loop_thread():
        coro.close()
        raise RuntimeError("run_sync called from the remote loop thread itself; await the coroutine instead")
    future = asyncio.run_coroutine_threadsafe(coro, _LOOP.loop())
    error: Optional[BaseException] = None
    try:
        while not future.done():
            concurrent.futures.wait((future,), timeout=CANCEL_POLL_S if poll is not None else None)
            if not future.done() and poll is not None:
                poll()
        error = future.exception()
        if error is None:
            return future.result()
        raise error
    except BaseException:
        future.cancel()  # no-op once the coroutine has finished (it raised)
        raise
    finally:
        # What the coroutine raised holds this frame in its traceback, and the future holds it: without this (and
        # without future.result(), whose own frame would hold the future), an error would keep the caller's frames
        # (a pipe among their locals) alive until the garbage collector runs, not until the caller drops it.
        error = future = None  # noqa: F841
