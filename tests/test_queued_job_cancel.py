"""A job queued behind another on the same pipe (the library from several threads) cancels within a second while it
waits, and the running job is left to finish as it would have."""
from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from ernie_image.runtime.core.errors import Cancelled
from ernie_image.runtime.core.host import NullHost
from ernie_image.runtime.core.request import GenerationRequest
from ernie_image.runtime.formats.sources import ModelSources
from ernie_image.runtime.local.options import LoadOptions
from ernie_image.runtime.local.pipe import LocalPipe
from waiting import WAIT_S, do_when, press_cancel

CANCEL_WITHIN_S = 1.0
REQUEST = GenerationRequest(prompt="a fox", width=256, height=256, steps=2, seed=5)


class HeldAtItsFirstStep(NullHost):
    """The running job: its first step's progress waits until the test lets it go on."""

    def __init__(self) -> None:
        super().__init__()
        self.stepping, self.go_on = threading.Event(), threading.Event()

    def progress(self, value: int, total: int, preview=None) -> None:
        self.stepping.set()
        assert self.go_on.wait(WAIT_S)


class Waiting(NullHost):
    """The queued job's host: `asked` is set once it is asked whether to cancel while it waits."""

    def __init__(self) -> None:
        super().__init__()
        self.asked = threading.Event()

    def check_cancel(self) -> None:
        self.asked.set()
        super().check_cancel()


@pytest.fixture(scope="module")
def pipe(tiny_turbo_folder) -> LocalPipe:
    return LocalPipe.load(ModelSources(model_dir=tiny_turbo_folder), LoadOptions(device="cpu", dtype="fp32"))


def test_a_job_waiting_for_the_pipe_cancels_within_a_second_and_the_running_one_finishes(pipe):
    running, queued = HeldAtItsFirstStep(), Waiting()
    with ThreadPoolExecutor(2) as threads:
        first = threads.submit(pipe.generate, REQUEST, running)
        assert running.stepping.wait(WAIT_S)
        second = threads.submit(pipe.generate, REQUEST, queued)
        pressed = do_when(queued.asked.is_set, lambda: press_cancel(queued))
        with pytest.raises(Cancelled):
            second.result(WAIT_S)
        assert time.monotonic() - pressed.result() < CANCEL_WITHIN_S
        assert not first.done()  # still held at its first step: the cancel was the queued job's alone
        running.go_on.set()
        finished = first.result(WAIT_S)
    assert finished.images.shape == (1, 256, 256, 3)
    assert pipe.generate(REQUEST, NullHost()).images.shape == (1, 256, 256, 3)  # and the pipe takes the next job
