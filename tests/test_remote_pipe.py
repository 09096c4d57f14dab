"""The SGLang client, the RemotePipe and the fleet, against fake SGLang servers on loopback."""
from __future__ import annotations

import base64
import io
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest
from PIL import Image
import torch

from ernie_image.runtime.core.errors import Cancelled, InvalidInputError, RemoteError
from ernie_image.runtime.core.host import NullHost
from ernie_image.runtime.core.pipe import ErniePipe
from ernie_image.runtime.core.request import GenerationRequest
from ernie_image.runtime.net.credentials import Credentials
from ernie_image.runtime.net.errors import BadResponse, ServerRejected
from ernie_image.runtime.net.loop_thread import run_sync
from ernie_image.runtime.remote.backend import RemotePipe, RemoteSettings
from ernie_image.runtime.remote.fleet import Fleet
from ernie_image.runtime.remote.server_check import check_remote, format_check_table
from ernie_image.runtime.remote.image_answer import decode_image
from ernie_image.runtime.remote.sglang import ImageParams, mask_seed

from fake_sglang import FakeSglang, free_port, render
from waiting import PROMPTLY_S, WAIT_S, do_when, press_cancel, wait_until

TURBO = dict(steps=8, cfg=1.0)  # what the Turbo Sampler puts into the request
BASE = dict(steps=50, cfg=4.0)
FAST = RemoteSettings(retry_attempts=2, retry_down_after_s=0.2, connect_timeout_s=1.0)


def key_of(*urls: str, env_var: str = "ERNIE_TEST_KEY") -> Credentials:
    """The key in `env_var`, bound by the user to these servers (here as the CLI's --api-key-env binds it)."""
    return Credentials.bound_to(list(urls), env_var, env_flag="--api-key-env")


def request(**overrides) -> GenerationRequest:
    fields = dict(prompt="a red fox in snow", negative_prompt="blurry", width=256, height=256, seed=1234,
                  batch=1, **TURBO)
    fields.update(overrides)
    return GenerationRequest(**fields)


def test_remote_pipe_is_an_ernie_pipe():
    pipe = RemotePipe(["http://127.0.0.1:1"])
    assert isinstance(pipe, ErniePipe) and pipe.kind == "remote"
    assert "127.0.0.1:1" in pipe.describe()


def test_every_field_is_sent_explicitly_and_turbo_arrives_as_8_steps_cfg_1():
    with FakeSglang(model_id="baidu/ERNIE-Image-Turbo") as server:
        pipe = RemotePipe([server.url], FAST)
        try:
            result = pipe.generate(request(use_pe=True), NullHost())
        finally:
            pipe.release()
    sent = server.generations[0].body
    assert sent == {
        "model": "baidu/ERNIE-Image-Turbo", "prompt": "a red fox in snow", "negative_prompt": "blurry",
        "width": 256, "height": 256, "num_inference_steps": 8, "guidance_scale": 1.0, "seed": 1234, "n": 1,
        "response_format": "b64_json", "output_format": "png", "use_pe": True,
    }
    assert isinstance(sent["use_pe"], bool) and isinstance(sent["guidance_scale"], float)
    assert result.latents is None
    assert result.images.shape == (1, 256, 256, 3) and result.images.dtype == torch.float32
    expected = np.asarray(render("a red fox in snow", "blurry", 1234, 8, 1.0, True, 256, 256, 512), np.float32) / 255
    assert torch.equal(result.images[0], torch.from_numpy(expected)), "PNG is lossless: pixels must match exactly"


def test_base_preset_arrives_as_sent():
    with FakeSglang(model_id="baidu/ERNIE-Image") as server:
        pipe = RemotePipe([server.url], FAST)
        pipe.generate(request(**BASE, use_pe=False), NullHost())
        pipe.release()
    sent = server.generations[0].body
    assert (sent["num_inference_steps"], sent["guidance_scale"], sent["use_pe"]) == (50, 4.0, False)


def test_batch_is_one_request_per_image_with_seed_plus_i_and_info_per_image():
    with FakeSglang(peak_memory_mb=1234.5) as server:
        pipe = RemotePipe([server.url], FAST)
        result = pipe.generate(request(batch=3, seed=10), NullHost())
        pipe.release()
    assert [g.body["seed"] for g in server.generations] == [10, 11, 12]
    assert all(g.body["n"] == 1 for g in server.generations)
    assert result.images.shape == (3, 256, 256, 3)
    assert not torch.equal(result.images[0], result.images[1])
    assert [i["seed"] for i in result.info["images"]] == [10, 11, 12]
    assert all(i["peak_memory_mb"] == 1234.5 and i["inference_time_s"] is not None for i in result.info["images"])
    assert all(i["server"] == server.url for i in result.info["images"])
    assert "peak memory 1234 MB" in result.info["summary"] or "peak memory 1235 MB" in result.info["summary"]


def test_seed_is_masked_into_sglangs_range():
    assert mask_seed(2**64 - 1) == 2**63 - 1
    assert mask_seed(-1) == 2**63 - 1
    with FakeSglang() as server:
        pipe = RemotePipe([server.url], FAST)
        pipe.generate(request(seed=2**63 - 1, batch=2), NullHost())
        pipe.release()
    assert [g.body["seed"] for g in server.generations] == [2**63 - 1, 0]


@pytest.mark.parametrize("width, height", [(1000, 288), (8, 8), (256, 5000), (240, 256)])
def test_a_size_the_local_pipe_refuses_is_refused_with_the_same_message(width, height):
    """One rule for local and remote: no silent rounding or clamping (8x8 used to become 256x256)."""
    with pytest.raises(InvalidInputError) as local:
        request(width=width, height=height).validate()
    with FakeSglang() as server:
        pipe = RemotePipe([server.url], FAST)
        with pytest.raises(InvalidInputError) as remote:
            pipe.generate(request(width=width, height=height), NullHost())
        pipe.release()
        assert server.received == [], "refused before anything is sent"
    assert str(remote.value) == str(local.value) and "not allowed" in str(remote.value)


def test_invalid_request_fails_before_anything_is_sent():
    with FakeSglang() as server:
        pipe = RemotePipe([server.url], FAST)
        with pytest.raises(InvalidInputError, match="steps 0"):
            pipe.generate(request(steps=0), NullHost())
        pipe.release()
    assert server.generations == []


@pytest.mark.parametrize("fault, message", [
    ("wrong_size", "returned a 128x128 image for a 256x256 request"),
    ("bad_b64", "not valid base64"),
    ("missing_data", "without images"),
])
def test_unusable_responses_are_rejected(fault, message):
    with FakeSglang(faults=[fault]) as server:
        pipe = RemotePipe([server.url], FAST)
        with pytest.raises(BadResponse, match=message):
            pipe.generate(request(), NullHost())
        pipe.release()


@pytest.mark.parametrize("sent, named", [("jpeg", "JPEG"), ("webp", "WEBP")])
def test_an_image_in_another_format_than_the_png_asked_for_is_refused_naming_the_server_and_format(sent, named):
    with FakeSglang(faults=[sent]) as server:
        pipe = RemotePipe([server.url], FAST)
        with pytest.raises(BadResponse) as caught:
            pipe.generate(request(), NullHost())
        pipe.release()
    assert server.generations[0].body["output_format"] == "png"
    assert str(caught.value) == (f"{server.url} sent a {named} image, not the PNG asked for: refused (the server "
                                 f"ignored output_format png): check its version")


def test_a_fleet_goes_on_without_a_server_that_ignores_output_format():
    with FakeSglang(every_post="jpeg") as jpeg, FakeSglang(service_time_s=0.05) as png:
        host = NullHost()
        pipe = RemotePipe([jpeg.url, png.url], FAST)
        result = pipe.generate(request(batch=3), host)
        pipe.release()
    assert {i["server"] for i in result.info["images"]} == {png.url} and len(jpeg.generations) == 1
    assert any(m.startswith(f"giving up on {jpeg.url}") and "sent a JPEG image" in m for m in host.messages)


def test_decode_rejects_bytes_that_are_not_an_image():
    with pytest.raises(BadResponse, match="not a readable image"):
        decode_image(base64.b64encode(b"hello").decode(), 16, 16, "srv")


def png_claiming(width: int, height: int) -> str:
    """A small PNG whose header claims width x height (its pixels are never read when the size is wrong)."""
    import struct
    import zlib

    buffer = io.BytesIO()
    Image.new("RGB", (1, 1)).save(buffer, format="PNG")
    data = bytearray(buffer.getvalue())
    ihdr = bytes(data[12:16]) + struct.pack(">II", width, height) + bytes(data[24:29])
    data[16:24] = struct.pack(">II", width, height)
    data[29:33] = struct.pack(">I", zlib.crc32(ihdr))
    return base64.b64encode(bytes(data)).decode()


@pytest.mark.parametrize("side", [12000, 15000], ids=["large", "beyond Pillow's decompression-bomb limit"])
def test_an_image_of_the_wrong_size_is_refused_from_its_header_before_decoding(side):
    with pytest.raises(BadResponse, match=rf"^srv returned (a {side}x{side} image for a 256x256 request|an image whose "
                                          rf"header claims far more pixels than the 256x256 asked for)"):
        decode_image(png_claiming(side, side), 256, 256, "srv")


def test_a_negative_prompt_at_cfg_1_is_sent_with_a_notice_that_it_has_no_effect():
    """SGLang, like diffusers, runs no unconditional pass at guidance 1: the negative prompt never acts there."""
    with FakeSglang() as server:
        pipe = RemotePipe([server.url], FAST)
        host = NullHost()
        pipe.generate(request(negative_prompt="blurry"), host)
        quiet = NullHost()
        pipe.generate(request(negative_prompt="blurry", **BASE), quiet)
        pipe.release()
    assert any(m.startswith("the negative prompt has no effect at CFG 1") for m in host.messages), host.messages
    assert not any("negative prompt" in m for m in quiet.messages), quiet.messages


def test_server_that_is_not_ernie_is_refused():
    with FakeSglang(pipeline_name="FluxPipeline", model_id="black-forest-labs/FLUX.1-dev") as server:
        pipe = RemotePipe([server.url], FAST)
        with pytest.raises(BadResponse, match="FLUX.1-dev \\(FluxPipeline\\), not an ERNIE-Image pipeline"):
            pipe.generate(request(), NullHost())
        pipe.release()
        assert server.generations == []


def test_a_server_that_names_no_pipeline_but_serves_an_ernie_image_id_is_used():
    """/v1/models without a pipeline name said "serves X (unknown), not an ERNIE-Image pipeline": the server had
    not said so. The model id naming ERNIE-Image is the hint it gives."""
    with FakeSglang(pipeline_name="", model_id="baidu/ERNIE-Image-Turbo") as server:
        pipe = RemotePipe([server.url], FAST)
        try:
            pipe.generate(request(), NullHost())
        finally:
            pipe.release()
        rows = check_remote([server.url], generate=False)
    assert len(server.generations) == 1
    assert rows[0].ok and rows[0].pipeline == "not named" and rows[0].model_id == "baidu/ERNIE-Image-Turbo"


def test_a_server_that_names_no_pipeline_for_another_model_says_ernie_could_not_be_confirmed():
    with FakeSglang(pipeline_name="", model_id="my-model") as server:
        pipe = RemotePipe([server.url], FAST)
        with pytest.raises(BadResponse) as caught:
            pipe.generate(request(), NullHost())
        pipe.release()
        rows = check_remote([server.url], generate=False)
        assert server.generations == []
    message = str(caught.value)
    assert message == (f"{server.url} serves my-model and names no pipeline for it (/v1/models), so ERNIE-Image could "
                       "not be confirmed: check the server's version (sglang 0.5.23 names its pipelines) and that it "
                       "was started with `sglang serve --model-path baidu/ERNIE-Image-Turbo` (or baidu/ERNIE-Image)")
    assert "not an ERNIE-Image pipeline" not in message and "unknown" not in message
    assert not rows[0].ok and rows[0].problems == [message] and rows[0].pipeline == "not named"


def _hostile(kind: str) -> str:
    if kind == "bomb":
        return png_claiming(15000, 15000)
    if kind == "oversized":
        return png_claiming(12000, 12000)
    return base64.b64encode(b"GIF89a, or anything else that is not an image").decode()


@pytest.mark.parametrize("kind, expected", [
    ("bomb", "returned an image whose header claims far more pixels than the 256x256 asked for (a decompression "
             "bomb), refused before decoding: check the server's version and its log, and that the URL is the "
             "SGLang server's"),
    ("oversized", "returned a 12000x12000 image for a 256x256 request, refused before decoding: the server may floor "
                  "sizes or be misconfigured; check its version and its log"),
    ("unreadable", "returned bytes that are not a readable image (UnidentifiedImageError); see the server log and "
                   "check its version"),
])
def test_a_hostile_or_unreadable_png_from_a_server_is_one_line_naming_a_fix_without_the_key(monkeypatch, kind,
                                                                                             expected):
    import warnings

    monkeypatch.setenv("ERNIE_TEST_KEY", "sk-never-shown-2718")
    with FakeSglang(api_key="sk-never-shown-2718", image_b64=_hostile(kind)) as server:
        pipe = RemotePipe([server.url], RemoteSettings(retry_attempts=2, retry_down_after_s=0.2, connect_timeout_s=1.0,
                                                       credentials=key_of(server.url)))
        with warnings.catch_warnings(record=True) as warned, pytest.raises(RemoteError) as caught:
            warnings.simplefilter("always")
            pipe.generate(request(), NullHost())
        pipe.release()
    assert str(caught.value) == f"{server.url} {expected}"
    assert "sk-never" not in str(caught.value) and "\n" not in str(caught.value)
    assert [str(w.message) for w in warned if "pixels" in str(w.message)] == []  # Pillow's bomb warning: not printed


def test_a_bare_500_names_the_request_that_failed_and_the_server_log_without_the_key(monkeypatch):
    """A failed model look is not "failed to generate"; a failed generation is. Neither shows the key."""
    monkeypatch.setenv("ERNIE_TEST_KEY", "sk-never-shown-2718")
    with FakeSglang(api_key="sk-never-shown-2718", faults=["models:500"]) as looked, \
            FakeSglang(api_key="sk-never-shown-2718", faults=["500"]) as generating:
        settings = RemoteSettings(retry_attempts=1, connect_timeout_s=1.0,
                                  credentials=key_of(looked.url, generating.url))
        messages = []
        for server in (looked, generating):
            pipe = RemotePipe([server.url], settings)
            with pytest.raises(RemoteError) as caught:
                pipe.generate(request(), NullHost())
            pipe.release()
            messages.append(str(caught.value))
    assert messages[0] == f"{looked.url} failed on GET {looked.url}/v1/models (HTTP 500); see the server log"
    assert messages[1] == f"{generating.url}: the server failed to generate; see the server log (HTTP 500)"
    assert not any("sk-never" in message for message in messages)


def test_4xx_stops_the_batch_with_the_servers_message():
    """A rejected request is not re-sent to another server: each server is asked at most once, no failover."""
    notes: list[str] = []
    with FakeSglang() as a, FakeSglang() as b:
        jobs = [ImageParams("a", "", 64, 64, 1, -1.0, seed, False) for seed in range(4)]

        async def run():
            fleet = Fleet([a.url, b.url])
            try:
                return await fleet.generate(jobs, notify=notes.append)
            finally:
                await fleet.close()
        with pytest.raises(ServerRejected, match="guidance_scale must be non-negative"):
            run_sync(run())
    assert len(a.generations) <= 1 and len(b.generations) <= 1 and len(a.generations) + len(b.generations) >= 1
    assert notes == [], "a 4xx is not a server failure to route around"


def test_describe_names_the_model_each_server_serves_once_known():
    with FakeSglang(model_id="baidu/ERNIE-Image", dit_precision="fp8") as server:
        pipe = RemotePipe([server.url.removeprefix("http://")], FAST)  # a URL without scheme works as well
        try:
            assert "serving" not in pipe.describe()
            pipe.generate(request(), NullHost())
            assert "serving baidu/ERNIE-Image (1 GPU, fp8)" in pipe.describe()
        finally:
            pipe.release()


def test_the_fake_server_serves_one_request_at_a_time_like_sglang():
    with FakeSglang(service_time_s=0.1, hold_answers=True) as server:
        pipes = [RemotePipe([server.url], FAST) for _ in range(3)]
        threads = [threading.Thread(target=p.generate, args=(request(seed=i), NullHost())) for i, p in enumerate(pipes)]
        for t in threads:
            t.start()
        wait_until(lambda: len(server.generations) == 3, what="the three requests reaching the server")
        assert len(server.ran) == 1, "one image is being made, the other two wait their turn"
        server.let_answers_go()
        for t in threads:
            t.join()
        for p in pipes:
            p.release()
    gaps = np.diff(server.completed)
    assert len(server.completed) == 3 and all(g >= 0.09 for g in gaps)


def test_fleet_spreads_a_batch_over_servers_concurrently():
    held = dict(service_time_s=0.3, hold_answers=True)  # no image is answered until the test lets them go
    with FakeSglang(**held) as a, FakeSglang(**held) as b, FakeSglang(**held) as c, ThreadPoolExecutor(1) as background:
        pipe = RemotePipe([a.url, b.url, c.url], FAST)
        batch = background.submit(pipe.generate, request(batch=6, seed=100), NullHost())
        wait_until(lambda: all(server.ran for server in (a, b, c)) or batch.done(),
                   what="each of the three servers making an image, none answered yet")
        assert not batch.done() and len(a.ran) == len(b.ran) == len(c.ran) == 1, "one image on each server at once"
        for server in (a, b, c):
            server.let_answers_go()
        result = batch.result(WAIT_S)
        pipe.release()
    assert len(a.generations) == len(b.generations) == len(c.generations) == 2
    assert sorted(g.body["seed"] for s in (a, b, c) for g in s.generations) == list(range(100, 106))
    assert [i["seed"] for i in result.info["images"]] == list(range(100, 106)), "images come back in seed order"
    assert {i["server"] for i in result.info["images"]} == {a.url, b.url, c.url}


def test_fleet_completes_the_batch_after_one_server_dies():
    host = NullHost()
    with FakeSglang(service_time_s=0.05) as a, FakeSglang(service_time_s=0.05) as b:
        a.kill_after(1)
        pipe = RemotePipe([a.url, b.url], FAST)
        result = pipe.generate(request(batch=6, seed=0), host)
        pipe.release()
    assert result.images.shape[0] == 6
    assert [i["seed"] for i in result.info["images"]] == list(range(6))
    assert len(a.generations) >= 1 and len(b.generations) >= 4
    failed = [m for m in host.messages if a.url in m.split(";")[0]]
    assert len(failed) == 1 and "refused the connection" in failed[0], host.messages
    assert sorted(a.ran + b.ran) == list(range(6)), "no image ran twice"


def test_fleet_skips_a_warming_server_and_uses_it_once_ready():
    host = NullHost()
    with FakeSglang(service_time_s=0.1) as a, FakeSglang(service_time_s=0.1, faults=["503"]) as b:
        pipe = RemotePipe([a.url, b.url], RemoteSettings(retry_attempts=2, retry_down_after_s=0.15, probe_every_s=0.05))
        result = pipe.generate(request(batch=6), host)
        pipe.release()
    assert result.images.shape[0] == 6
    assert any(m.startswith(f"server failed: {b.url}") and "HTTP 503" in m for m in host.messages)
    assert len(b.generations) >= 2, "the warmed-up server takes work again after the pause"


def test_fleet_fails_clearly_when_every_server_is_down():
    urls = [f"http://127.0.0.1:{free_port()}", f"http://127.0.0.1:{free_port()}"]
    pipe = RemotePipe(urls, RemoteSettings(retry_attempts=1, retry_down_after_s=0.05, connect_timeout_s=0.5,
                                           wait_for_servers_s=0.3, probe_every_s=0.05))
    with pytest.raises(RemoteError, match="no server could take the 2 images within 0.3 s: .*"
                                          "connection refused.*start or fix the servers"):
        pipe.generate(request(batch=2), NullHost())
    pipe.release()


def test_a_bare_500_sends_the_image_to_the_other_server_once_and_fails_when_both_fail():
    # Both answer their first generation with a bare 500: an answered 500 means the server is done with the image,
    # so the other server gets it once; when it fails there too, the batch ends naming both.
    with FakeSglang(faults=["500"]) as a, FakeSglang(faults=["500"]) as b:
        pipe = RemotePipe([a.url, b.url], FAST)
        with pytest.raises(RemoteError, match="the server failed to generate; see the server log") as caught:
            pipe.generate(request(batch=1), NullHost())
        pipe.release()
    assert len(a.generations) == len(b.generations) == 1
    assert a.url in str(caught.value) and b.url in str(caught.value)


def test_cancel_returns_at_once_while_the_server_hangs():
    host = NullHost()
    with FakeSglang(faults=["hang"]) as server:
        pipe = RemotePipe([server.url], FAST)
        cancelled = do_when(lambda: server.generations, lambda: press_cancel(host))  # Cancel while the image hangs
        with pytest.raises(Cancelled, match="cannot cancel"):
            pipe.generate(request(), host)
        returned_at = time.monotonic()
        pipe.release()
    assert returned_at - cancelled.result(WAIT_S) < PROMPTLY_S, "back at the Cancel, not when the server answers"


def test_progress_is_reported_while_waiting_in_the_batchs_steps_and_ends_only_with_the_image():
    host = NullHost()
    with FakeSglang(service_time_s=0.6) as server:
        pipe = RemotePipe([server.url], FAST)
        asked = request()
        pipe.generate(asked, host)
        pipe.release()
    values = [v for v, _ in host.progress_calls]
    assert {total for _, total in host.progress_calls} == {asked.steps * asked.batch}
    assert len(values) >= 4 and values == sorted(values) and values[-1] == host.progress_calls[-1][1]
    assert values.count(values[-1]) == 1  # the estimate stops one short: the end is reported once, when it is in
    assert any("cancelling the run stops the wait" in m for m in host.messages)


def test_api_key_never_lands_in_logs_errors_or_results(monkeypatch):
    secret = "sk-do-not-leak-42"
    monkeypatch.setenv("ERNIE_SGLANG_API_KEY", secret)
    host = NullHost()
    with FakeSglang(api_key=secret) as server:
        pipe = RemotePipe([server.url], RemoteSettings(
            credentials=key_of(server.url, env_var="ERNIE_SGLANG_API_KEY")))
        result = pipe.generate(request(), host)
        assert all(r.headers.get("Authorization") == f"Bearer {secret}" for r in server.received)
        text = repr(pipe) + pipe.describe() + repr(result.info) + repr(pipe.settings) + " ".join(host.messages)
        assert secret not in text
        pipe.release()
        monkeypatch.setenv("ERNIE_SGLANG_API_KEY", "bad")
        pipe = RemotePipe([server.url], RemoteSettings(
            credentials=key_of(server.url, env_var="ERNIE_SGLANG_API_KEY")))
        with pytest.raises(RemoteError, match="HTTP 403.*ERNIE_SGLANG_API_KEY") as caught:
            pipe.generate(request(), NullHost())
        assert "bad" not in str(caught.value).replace("bad URL", "")
        pipe.release()
    monkeypatch.setenv("ERNIE_SGLANG_API_KEY", secret)
    with FakeSglang(api_key=secret, faults=["400_echo_auth"]) as echoing:
        pipe = RemotePipe([echoing.url], RemoteSettings(
            credentials=key_of(echoing.url, env_var="ERNIE_SGLANG_API_KEY")))
        with pytest.raises(RemoteError, match=r"HTTP 400\): invalid request, auth was Bearer \*\*\*$") as caught:
            pipe.generate(request(), NullHost())
        assert secret not in str(caught.value)
        pipe.release()


def test_check_remote_reports_each_server():
    with FakeSglang(num_gpus=4, dit_precision="fp8") as ready, FakeSglang(warmup_s=60) as warming:
        rows = check_remote([ready.url, warming.url, f"http://127.0.0.1:{free_port()}",
                             "http://no-such-host.invalid:30000"])
        table = format_check_table(rows)
    assert [r.readiness for r in rows] == ["ready", "loading", "refused", "unreachable"]
    assert rows[3].problems == ["http://no-such-host.invalid:30000: no such host (the name does not resolve): check the URL"]
    assert rows[0].ok and rows[0].num_gpus == 4 and rows[0].precision == "fp8" and rows[0].version == "0.5.23"
    assert rows[0].generation_s is not None and rows[0].pipeline == "ErnieImagePipeline"
    sent = ready.generations[0].body
    assert (sent["width"], sent["height"], sent["num_inference_steps"]) == (256, 256, 1)
    assert sum(r.path == "/v1/models" for r in ready.received) == 1, "the model list is asked for once"
    assert "loading" in table and "baidu/ERNIE-Image-Turbo" in table and "refused the connection" in table


@pytest.mark.parametrize("key", ["sk-A\nB", "sk-F\tILE\x01", "sk-\rX"], ids=["line break", "tab and control", "CR"])
def test_an_api_key_with_a_control_character_is_refused_in_one_line_without_showing_it(monkeypatch, key):
    monkeypatch.setenv("ERNIE_SGLANG_API_KEY", key)
    with FakeSglang() as server:
        pipe = RemotePipe([server.url], RemoteSettings(
            credentials=key_of(server.url, env_var="ERNIE_SGLANG_API_KEY")))
        with pytest.raises(RemoteError, match=r"^the environment variable ERNIE_SGLANG_API_KEY holds a line break or "
                                              r"control character inside the API key: keep only the key itself") as caught:
            pipe.generate(request(), NullHost())
        assert key.strip() not in str(caught.value)
        pipe.release()
