"""A remote pipe lives as long as ComfyUI's node cache holds it, whatever its last run did.

The nodes track the pipes they make weakly (nodes/live_pipes.py), and `/ernie_image/memory` lists those alive. A
pipe dropped from ComfyUI's cache (a changed widget, "Free model and node cache") must be gone once dropped, by
reference counting alone (ComfyUI's RAM-pressure cache collects no garbage after it drops an entry): no error its
run raised, no connection, no server state the pack keeps may hold it. Real servers on loopback.
"""
from __future__ import annotations

import gc
import weakref
from contextlib import contextmanager
from typing import Iterator, Optional

import pytest

from ernie_image.nodes import live_pipes
from ernie_image.runtime.core.errors import Cancelled, ErnieImageError
from ernie_image.runtime.core.host import NullHost
from ernie_image.runtime.core.request import GenerationRequest
from ernie_image.runtime.remote.backend import RemotePipe, RemoteSettings

from fake_sglang import FakeSglang
from waiting import do_when, press_cancel

QUICK = RemoteSettings(connect_timeout_s=1.0, retry_down_after_s=0.05, probe_every_s=0.05, wait_for_servers_s=0.3,
                       read_timeout_base_s=0.5, read_timeout_per_step_megapixel_s=0.0, retry_attempts=1)
LAST_RUNS = {  # the servers of the pipe's last run, and what that run raised
    "made its images": ([{}], None),
    "its only server answered 500": ([dict(every_post="500")], "ServerFailed"),
    "every server of its fleet answered 500": ([dict(every_post="500"), dict(every_post="500_json")], "RemoteError"),
    "one server of two answered 500": ([dict(every_post="500"), {}], None),
    "its server wants a key": ([dict(api_key="sk-not-bound")], "AuthenticationError"),
    "its server serves another model": ([dict(model_id="FLUX.1-dev", pipeline_name="FluxPipeline")], "BadResponse"),
    "no server listens": ([dict(die_after=0)], "ServersNotReady"),
    "its server gave no answer in time": ([dict(every_post="hang")], "ConnectionLost"),
    "its server's answer trickled in": ([dict(every_post="trickle")], "ConnectionLost"),
    "its server stayed busy": ([dict(every_post="503")], "ServerUnavailable"),
    "it was cancelled": ([dict(every_post="hang")], "Cancelled"),
}


@contextmanager
def servers(behaviours: list[dict]) -> Iterator[list[FakeSglang]]:
    fakes = [FakeSglang(image_side_cap=16, **behaviour) for behaviour in behaviours]
    for server in fakes:
        server.start()
        if server.die_after == 0:
            server.stop()  # nothing listens there any more
    try:
        yield fakes
    finally:
        for server in fakes:
            server.stop()


def last_run(pipe: RemotePipe, fleet: list[FakeSglang], cancel: bool) -> Optional[str]:
    """Two images on the pipe; the name of what the run raised, None when it made them."""
    host = NullHost()
    if cancel:
        do_when(lambda: any(server.generations for server in fleet), lambda: press_cancel(host))
    try:
        pipe.generate(GenerationRequest(prompt="a fox", negative_prompt="", width=256, height=256, steps=1, cfg=1.0,
                                        seed=0, batch=2), host)
    except (ErnieImageError, Cancelled) as error:
        return type(error).__name__
    return None


@pytest.mark.parametrize("run", LAST_RUNS)
@pytest.mark.parametrize("released", [False, True], ids=["dropped", "released, then dropped"])
def test_a_pipe_dropped_from_the_cache_is_gone_at_once_whatever_its_last_run_did(run, released):
    behaviours, raised = LAST_RUNS[run]
    with servers(behaviours) as fleet:
        pipe = live_pipes.track(RemotePipe([server.url for server in fleet], QUICK))
        assert last_run(pipe, fleet, cancel=run == "it was cancelled") == raised
        if released:
            live_pipes.release_all()  # POST /ernie_image/free
        gone = weakref.ref(pipe)
        gc.collect()
        gc.disable()  # from here on only reference counting frees anything
        try:
            del pipe  # what ComfyUI's cache does to it
            assert gone() is None, "the pipe outlived its last reference"
        finally:
            gc.enable()
        assert live_pipes.summary()["live_pipes"] == len(live_pipes.live_pipes())
        assert not any(p is gone() for p in live_pipes.live_pipes())
