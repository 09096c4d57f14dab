"""A deadline for a whole answer: headers and body, however the server sends them.

A per-read timeout (aiohttp's sock_read) starts again at every byte, so a server that answers one byte every half
second is never timed out: one such server held a run for minutes. Here the read timeout bounds the whole answer
instead: it starts when the connection is made (connecting has its own timeout) and ends with the last byte.

`AnswerClock` is the deadline of one request; a session's `trace_config()` tells it when the connection is made (a
fresh one or one from the pool); `until_due` awaits the request and stops it when the clock runs out (AnswerOverdue), saying how far
it got: not connected, connected but no headers, or headers but not the whole body.
"""
from __future__ import annotations

import asyncio
from types import SimpleNamespace
from typing import Any, Awaitable, TypeVar

import aiohttp

T = TypeVar("T")


class AnswerClock:
    """When the answer to one request is due: `read_s` after the connection is made. Until then the connecting is
    bounded by its own timeout; `connect_s + read_s` from the start bounds what that timeout does not cover (a name
    that takes long to resolve, a wait for a pooled connection)."""

    def __init__(self, connect_s: float, read_s: float) -> None:
        self._loop = asyncio.get_running_loop()
        self.read_s = read_s
        self.due = self._loop.time() + connect_s + read_s
        self.connected = False
        self.answering = False  # the status line and headers are in; the body may not be
        self.moved = asyncio.Event()  # set when `due` moves, so that a wait for the old one wakes

    def connection_made(self) -> None:
        self.connected = True
        self.due = self._loop.time() + self.read_s
        self.moved.set()

    def answer_began(self) -> None:
        self.answering = True

    def left_s(self) -> float:
        return self.due - self._loop.time()


class AnswerOverdue(Exception):
    """The clock ran out; `clock` says how far the answer got."""

    def __init__(self, clock: AnswerClock) -> None:
        super().__init__("answer overdue")
        self.clock = clock


async def _on_connection(session: aiohttp.ClientSession, context: SimpleNamespace, params: Any) -> None:
    clock = getattr(context, "trace_request_ctx", None)
    if isinstance(clock, AnswerClock):
        clock.connection_made()


def trace_config() -> aiohttp.TraceConfig:
    """Pass to a ClientSession, and the AnswerClock as a request's `trace_request_ctx`."""
    trace = aiohttp.TraceConfig()
    trace.on_connection_create_end.append(_on_connection)
    trace.on_connection_reuseconn.append(_on_connection)
    return trace


async def until_due(clock: AnswerClock, awaitable: Awaitable[T]) -> T:
    """Await `awaitable`, cancelling it and raising AnswerOverdue once `clock` runs out. The clock moves when the
    connection is made (sooner or later than first set), so the wait is measured again whenever it does."""
    task = asyncio.ensure_future(awaitable)
    moved = asyncio.ensure_future(clock.moved.wait())
    try:
        while True:
            left = clock.left_s()
            if left <= 0:
                raise AnswerOverdue(clock)
            done, _ = await asyncio.wait({task, moved}, timeout=left, return_when=asyncio.FIRST_COMPLETED)
            if task in done:
                return task.result()
            if moved in done:
                clock.moved.clear()
                moved = asyncio.ensure_future(clock.moved.wait())
    finally:
        moved.cancel()
        if not task.done():
            task.cancel()
            task.add_done_callback(_retrieve)  # the request's own end no longer matters
            # asyncio.wait never raises the request's end, but does raise a cancel aimed at this task meanwhile.
            await asyncio.wait({task})


def _retrieve(task: "asyncio.Future[Any]") -> None:
    if not task.cancelled():
        task.exception()
