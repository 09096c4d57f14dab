"""Waiting on a server that the user can cancel: `cancel` is polled every 0.1 s (it may return True or raise
Cancelled, so `Host.check_cancel` fits as it is), so a cancel stops the wait within a second."""
from __future__ import annotations

import asyncio
import time
from typing import Awaitable, Callable, Optional, TypeVar

from ..core.errors import Cancelled

T = TypeVar("T")
CancelCheck = Callable[[], Optional[bool]]

CANCEL_POLL_S = 0.1


def _cancel_requested(cancel: CancelCheck) -> bool:
    return bool(cancel())  # a Host.check_cancel raises Cancelled itself and returns None otherwise


async def wait_cancellable(awaitable: Awaitable[T], cancel: Optional[CancelCheck],
                           message: str = "cancelled while waiting for the server") -> T:
    """Await `awaitable`, polling `cancel` every 0.1 s; on cancel the awaitable is cancelled and Cancelled raised.
    Without `cancel` it is a plain await (run_sync's poll cancels the whole task), not a 0.1 s wake-up loop."""
    if cancel is None:
        return await awaitable
    task = asyncio.ensure_future(awaitable)
    try:
        while True:
            done, _ = await asyncio.wait({task}, timeout=CANCEL_POLL_S)
            if done:
                return task.result()
            if _cancel_requested(cancel):
                raise Cancelled(message)
    finally:
        if not task.done():
            task.cancel()
            try:
                await task
            except BaseException:  # noqa: BLE001 - the task's own outcome no longer matters
                pass


async def sleep_cancellable(seconds: float, cancel: Optional[CancelCheck]) -> None:
    if cancel is None:
        await asyncio.sleep(seconds)
        return
    deadline = time.monotonic() + seconds
    while True:
        if _cancel_requested(cancel):
            raise Cancelled("cancelled while waiting to retry the server")
        left = deadline - time.monotonic()
        if left <= 0:
            return
        await asyncio.sleep(min(CANCEL_POLL_S, left))
