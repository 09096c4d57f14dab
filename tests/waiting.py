"""Waiting on the event a test means, never for a fixed time.

`wait_until(condition)` polls `condition` until it holds and fails, naming what was awaited, only after a generous
cap: a loaded runner (two cores shared with other work) is slow, not broken. `do_when(condition, action)` does
something (a user's Cancel, a server coming up) the moment a condition holds, from another thread, instead of after
a fixed delay that a slow runner may overtake. A test that asserts something did not happen asserts it once the
event that would have caused it is over, not after a sleep.

The only fixed durations left in tests are caps: how long something may take before the test calls it broken.
`PROMPTLY_S` is the one for "at once".
"""
from __future__ import annotations

import asyncio
import inspect
import threading
import time
from concurrent.futures import Future
from typing import Any, Awaitable, Callable, TypeVar, Union

T = TypeVar("T")
Described = Union[str, Callable[[], str]]  # what is awaited, or a function saying it (with what it is now)

WAIT_S = 30.0  # the default cap on a wait: far above what any awaited event takes on a loaded runner
POLL_S = 0.02
PROMPTLY_S = 5.0
"""The cap on something the code does at once (a cancel seen at its next 0.1 s poll, a deadline honoured, a
refused connection told in one line): generous on a loaded runner, and below the wait or timeout a test tells "at
once" apart from; where that is shorter, the test widens it first (a longer timeout, a patched constant) or says
why its own cap still tells them apart."""


def wait_until(condition: Callable[[], T], timeout_s: float = WAIT_S, what: Described = "",
               poll_s: float = POLL_S) -> T:
    """Poll `condition` until it returns something truthy, and return that; an AssertionError naming `what` (or
    the condition) if it has not within `timeout_s`. Whatever `condition` raises propagates at once."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() >= deadline:
            raise AssertionError(f"{_described(what, condition)}: not within {timeout_s:g} s")
        time.sleep(poll_s)


async def wait_until_async(condition: Callable[[], Union[T, Awaitable[T]]], timeout_s: float = WAIT_S,
                           what: Described = "", poll_s: float = POLL_S) -> T:
    """`wait_until` for a coroutine: `condition` may be a coroutine function (an HTTP GET, say)."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = condition()
        if inspect.isawaitable(value):
            value = await value
        if value:
            return value  # type: ignore[return-value]
        if time.monotonic() >= deadline:
            raise AssertionError(f"{_described(what, condition)}: not within {timeout_s:g} s")
        await asyncio.sleep(poll_s)


def do_when(condition: Callable[[], Any], action: Callable[[], T], timeout_s: float = WAIT_S) -> "Future[T]":
    """Run `action()` on a thread of its own as soon as `condition()` holds; its result (or the failure of the
    wait or the action) in the returned future."""
    future: "Future[T]" = Future()

    def run() -> None:
        try:
            wait_until(condition, timeout_s, what=f"the moment to {getattr(action, '__name__', 'act')}")
            future.set_result(action())
        except BaseException as exc:  # noqa: BLE001 - handed to the test through the future
            future.set_exception(exc)

    threading.Thread(target=run, name="do-when", daemon=True).start()
    return future


def press_cancel(host: Any) -> float:
    """What a user's Cancel does to a host (`cancel_requested`, which `check_cancel` reads); returns when, on the
    time.monotonic() clock."""
    at = time.monotonic()
    host.cancel_requested = True
    return at


def _described(what: Described, condition: Callable[..., Any]) -> str:
    if callable(what):
        return what()
    return what or f"waited for {getattr(condition, '__qualname__', repr(condition))}"
