"""until_due: a cancel aimed at the caller is never lost while the overdue request is torn down."""
from __future__ import annotations

import asyncio

import pytest

from ernie_image.runtime.net.answer_deadline import AnswerClock, AnswerOverdue, until_due


def test_cancelling_the_caller_while_an_overdue_request_is_torn_down_propagates() -> None:
    async def scenario() -> None:
        started, tearing_down, release, finished = (asyncio.Event() for _ in range(4))

        async def request() -> None:
            started.set()
            try:
                await asyncio.Event().wait()
            finally:
                tearing_down.set()
                try:
                    await release.wait()  # a slow teardown, itself cancelled by the caller's cancel or not
                finally:
                    finished.set()

        clock = AnswerClock(connect_s=0.0, read_s=3600.0)
        caller = asyncio.ensure_future(until_due(clock, request()))
        await started.wait()
        clock.due = asyncio.get_running_loop().time() - 1  # overdue now
        clock.moved.set()
        await tearing_down.wait()
        caller.cancel()
        with pytest.raises(asyncio.CancelledError):
            await caller
        release.set()
        await finished.wait()

    asyncio.run(scenario())


def test_an_overdue_request_ends_in_answer_overdue_whatever_its_teardown_raises() -> None:
    async def scenario() -> None:
        started = asyncio.Event()

        async def request() -> None:
            started.set()
            try:
                await asyncio.Event().wait()
            finally:
                raise RuntimeError("teardown failed")

        clock = AnswerClock(connect_s=0.0, read_s=3600.0)
        caller = asyncio.ensure_future(until_due(clock, request()))
        await started.wait()
        clock.due = asyncio.get_running_loop().time() - 1
        clock.moved.set()
        with pytest.raises(AnswerOverdue):
            await caller

    asyncio.run(scenario())
