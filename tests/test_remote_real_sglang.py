"""The Remote Backend against real `sglang serve` (measured with 0.5.23) on a tiny random-weight ERNIE-Image
checkpoint.

Needs ERNIE_SGLANG_PYTHON (a venv with sglang; README "Testing against real SGLang"). Two servers on
loopback take ~1 min to start on 2 CPU cores and ~2.2 GB RAM each; they run with --sleep-on-idle.
"""
from __future__ import annotations

import re

import pytest
import torch

from ernie_image.runtime.core.host import NullHost
from ernie_image.runtime.core.request import GenerationRequest
from ernie_image.runtime.remote.backend import RemotePipe, RemoteSettings
from ernie_image.runtime.remote.fleet import UnansweredImage
from ernie_image.runtime.remote.server_check import check_remote

from sglang_real import (SGLANG_PYTHON_ENV, SglangServer, build_tiny_checkpoint, free_port, sglang_python,
                         wait_until_ready)
from waiting import wait_until

pytestmark = [
    pytest.mark.sglang,
    pytest.mark.slow,
    pytest.mark.timeout(900),
    pytest.mark.skipif(sglang_python() is None,
                       reason=f"{SGLANG_PYTHON_ENV} is not set to a Python with sglang installed "
                              f"(see README: Testing against real SGLang)"),
]

SETTINGS = RemoteSettings(retry_down_after_s=1.0)


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    root = tmp_path_factory.mktemp("sglang")
    model = build_tiny_checkpoint(root / "ERNIE-Image-Turbo-tiny")
    started = [SglangServer(sglang_python(), model, root / f"server{i}") for i in range(2)]
    try:
        states = wait_until_ready(started)
        yield started, states
    finally:
        for server in started:
            server.stop()


def request(**overrides) -> GenerationRequest:
    fields = dict(prompt="a red fox in snow", negative_prompt="blurry", width=256, height=256, steps=8, cfg=1.0,
                  seed=7, batch=1)
    fields.update(overrides)
    return GenerationRequest(**fields)


def finished_params(log: str) -> list[dict[str, float]]:
    """What the server ran, from its --log-requests 'Finish:' lines."""
    found = []
    for match in re.finditer(r"Finish: obj=\{.*?'seed': (\d+), 'num_inference_steps': (\d+), "
                             r"'guidance_scale': ([\d.]+).*?'width': (\d+), 'height': (\d+)", log):
        seed, steps, cfg, width, height = match.groups()
        found.append({"seed": int(seed), "steps": int(steps), "cfg": float(cfg), "width": int(width),
                      "height": int(height)})
    return found


def test_readiness_reports_only_sglangs_states_and_ends_ready(servers):
    _, states = servers
    for seen in states.values():
        assert seen[-1] == "ready"
        assert set(seen) <= {"refused", "loading", "ready"}


def test_same_seed_gives_the_same_image_and_another_seed_differs(servers):
    (first, _), _ = servers
    pipe = RemotePipe([first.url], SETTINGS)
    try:
        a = pipe.generate(request(seed=7), NullHost())
        b = pipe.generate(request(seed=7), NullHost())
        c = pipe.generate(request(seed=8), NullHost())
    finally:
        pipe.release()
    assert a.images.shape == (1, 256, 256, 3)
    assert torch.equal(a.images, b.images)
    assert not torch.equal(a.images, c.images)
    assert a.info["images"][0]["inference_time_s"] > 0


def test_turbo_and_base_presets_reach_the_server_as_sent(servers):
    (_, second), _ = servers
    pipe = RemotePipe([second.url], SETTINGS)
    try:
        pipe.generate(request(steps=8, cfg=1.0, seed=101), NullHost())
        pipe.generate(request(steps=50, cfg=4.0, seed=102, width=272, height=256), NullHost())
    finally:
        pipe.release()
    ran = {p["seed"]: p for p in finished_params(second.log_text())}
    assert ran[101] == {"seed": 101, "steps": 8, "cfg": 1.0, "width": 256, "height": 256}
    assert ran[102] == {"seed": 102, "steps": 50, "cfg": 4.0, "width": 272, "height": 256}


def test_a_fleet_of_two_real_servers_shares_a_batch(servers):
    started, _ = servers
    pipe = RemotePipe([s.url for s in started], SETTINGS)
    try:
        result = pipe.generate(request(batch=4, seed=500, steps=4), NullHost())
    finally:
        pipe.release()
    assert result.images.shape == (4, 256, 256, 3)
    assert [i["seed"] for i in result.info["images"]] == [500, 501, 502, 503]
    assert {i["server"] for i in result.info["images"]} == {s.url for s in started}
    single = RemotePipe([started[0].url], SETTINGS)
    try:
        again = single.generate(request(batch=1, seed=502, steps=4), NullHost())
    finally:
        single.release()
    assert torch.equal(again.images[0], result.images[2]), "seed+i gives the same image on either server"


def test_check_remote_on_real_servers(servers):
    started, _ = servers
    rows = check_remote([s.url for s in started])
    for row in rows:
        assert row.ok, row.problems
        assert row.pipeline == "ErnieImagePipeline" and row.num_gpus == 1
        assert row.version and re.fullmatch(r"\d+\.\d+\S*", row.version), row.version
        assert row.generation_s is not None


def test_a_fleet_with_a_dead_server_completes_on_the_live_one(servers):
    (first, _), _ = servers
    host = NullHost()
    dead = f"http://127.0.0.1:{free_port()}"
    pipe = RemotePipe([dead, first.url], RemoteSettings(probe_every_s=0.2))
    try:
        result = pipe.generate(request(batch=3, seed=700, steps=2), host)
    finally:
        pipe.release()
    assert [i["server"] for i in result.info["images"]] == [first.url] * 3
    assert len([m for m in host.messages if m.startswith(dead)]) == 1, host.messages


def test_an_unanswered_image_is_not_sent_again_to_a_real_server(servers):
    (_, second), _ = servers
    pipe = RemotePipe([second.url], RemoteSettings(read_timeout_base_s=0.05, read_timeout_per_step_megapixel_s=0.0))
    try:
        with pytest.raises(UnansweredImage, match="may still be working on it"):
            pipe.generate(request(seed=9001, steps=20), NullHost())
    finally:
        pipe.release()
    # SGLang serves one request at a time in arrival order: an image asked for once the pipe has given up finishes
    # after everything the pipe sent, a copy of 9001 too, had one been sent.
    after = RemotePipe([second.url], SETTINGS)
    try:
        after.generate(request(seed=9002, steps=2), NullHost())
    finally:
        after.release()
    seeds = wait_until(lambda: 9002 in finished_seeds(second) and finished_seeds(second), 60, poll_s=0.5,
                       what=lambda: f"the image after it in the server's log: {finished_params(second.log_text())}")
    assert seeds.count(9001) == 1, seeds


def finished_seeds(server: SglangServer) -> list[int]:
    return [p["seed"] for p in finished_params(server.log_text())]


def test_a_batch_sent_while_a_real_server_starts_waits_for_it(tmp_path):
    model = build_tiny_checkpoint(tmp_path / "ERNIE-Image-Turbo-tiny")
    server = SglangServer(sglang_python(), model, tmp_path / "late")
    host = NullHost()
    pipe = RemotePipe([server.url], RemoteSettings(wait_for_servers_s=300, probe_every_s=0.5))
    try:
        result = pipe.generate(request(batch=1, seed=11, steps=2), host)
    finally:
        pipe.release()
        server.stop()
    assert result.images.shape == (1, 256, 256, 3)
    waiting = [m for m in host.messages if m.startswith("waiting for")]
    assert waiting and (": refused (nothing listening" in waiting[0] or ": loading," in waiting[0]), host.messages
