"""Answers a hostile or broken server can send, against real aiohttp servers on loopback (tests/fake_sglang.py).

- An answer that trickles in (one byte every 0.05 s) is timed out by the read timeout as a whole, not per read: the
  read timeout bounds the whole answer, headers and body, and the error says the server answered too slowly.
- Answers are asked for uncompressed (Accept-Encoding: identity) and never decompressed: a compressed answer is
  refused in one line before its body is read, so a gzip bomb costs nothing.
- A short JSON answer (/health, /v1/models, /server_info) is capped at 1 MiB, an error body read no further than
  that; images keep their own cap.
"""
from __future__ import annotations

import time
import tracemalloc

import pytest

from ernie_image.runtime.core.errors import Cancelled, named_settings
from ernie_image.runtime.net.client import HttpClient
from ernie_image.runtime.net.errors import BadResponse, ConnectionLost, ServerFailed
from ernie_image.runtime.net.settings import SMALL_ANSWER_BYTES, HttpSettings, RetryPolicy, Timeouts

from client_calls import call
from fake_sglang import FakeSglang, gzip_bomb
from waiting import PROMPTLY_S, do_when

GEN = "/v1/images/generations"
BODY = {"prompt": "a red fox", "width": 64, "height": 64, "response_format": "b64_json", "output_format": "png"}
ONCE = RetryPolicy(attempts=1)
READ_S = 1.0
ENDPOINTS = {  # where a fault goes (FakeSglang's prefixes), and the request that meets it
    "generation": ("", "POST", GEN, BODY),
    "health": ("health:", "GET", "/health", None),
    "model list": ("models:", "GET", "/v1/models", None),
}
SMALL = ("health", "model list")


def one_line(error: BaseException) -> str:
    message = str(error)
    assert "\n" not in message and "\r" not in message, f"not one line: {message!r}"
    return message


def client_of(server: FakeSglang, **settings) -> HttpClient:
    return HttpClient(server.url, HttpSettings(timeouts=Timeouts(connect_s=2.0, read_s=READ_S), retry=ONCE,
                                               **settings))


def small(endpoint: str) -> dict:
    return {"small_answer": True} if endpoint in SMALL else {}


# ------------------------------------------------------------------------------------------ slow answers
@pytest.mark.parametrize("endpoint", ENDPOINTS)
def test_an_answer_that_trickles_in_is_timed_out_as_a_whole_by_the_read_timeout(endpoint):
    """Once, not once per retry: an answer that took the whole read timeout would take it again."""
    prefix, method, path, body = ENDPOINTS[endpoint]
    with FakeSglang(faults=[prefix + "trickle"] * 3) as server:
        client = HttpClient(server.url, HttpSettings(timeouts=Timeouts(connect_s=2.0, read_s=READ_S),
                                                     retry=RetryPolicy(attempts=3, base_delay_s=0.01),
                                                     read_timeout_setting="read_timeout_s"))
        started = time.monotonic()
        with pytest.raises(ConnectionLost) as caught:
            call(client, method, path, body, **small(endpoint))
        took = time.monotonic() - started
        assert server.trickling.is_set(), "the answer had begun: status and headers were in"
    assert READ_S <= took < READ_S + PROMPTLY_S, "the whole answer's deadline, not a per-read one that never ends"
    assert [r.path for r in server.received] == [path], "asked once"
    error = caught.value
    assert error.timed_out and error.answered_in_part
    assert one_line(error) == (
        f"{server.url} answered {method} {server.url}{path} too slowly: the whole answer took longer than 1 s (read "
        f"timeout), coming in bit by bit; check the server (its log, its network, a proxy in front of it), or raise "
        f"read_timeout_s if it is only slow")
    assert named_settings(error) == ("read_timeout_s",), "a front end says its own name for the setting"


def test_an_answer_not_begun_within_the_read_timeout_is_no_answer_and_a_post_is_not_sent_again():
    with FakeSglang(faults=["hang"]) as server:
        client = HttpClient(server.url, HttpSettings(timeouts=Timeouts(read_s=READ_S),
                                                     retry=RetryPolicy(attempts=3, base_delay_s=0.01)))
        with pytest.raises(ConnectionLost) as caught:
            call(client, "POST", GEN, BODY)
        assert len(server.generations) == 1, "the server may be working on it"
    assert caught.value.timed_out and not caught.value.answered_in_part
    assert f"sent no answer to POST {server.url}{GEN} within 1 s (read timeout)" in one_line(caught.value)


def test_a_server_that_takes_its_time_but_answers_within_the_read_timeout_is_answered():
    with FakeSglang(service_time_s=0.3) as server:  # well inside a 10 s read timeout, even on a loaded machine
        client = HttpClient(server.url, HttpSettings(timeouts=Timeouts(connect_s=2.0, read_s=10.0), retry=ONCE))
        response = call(client, "POST", GEN, BODY)
    assert response.status == 200 and response.data["data"][0]["b64_json"]


def test_cancel_stops_a_trickling_answer_at_once():
    with FakeSglang(faults=["trickle"]) as server:
        client = HttpClient(server.url, HttpSettings(timeouts=Timeouts(read_s=600.0), retry=ONCE))
        pressed: list[float] = []
        do_when(server.trickling.is_set, lambda: pressed.append(time.monotonic()))
        with pytest.raises(Cancelled):
            call(client, "POST", GEN, BODY, cancel=lambda: bool(pressed))
        assert time.monotonic() - pressed[0] < PROMPTLY_S, "back at the Cancel, not at the 600 s read timeout"


# ---------------------------------------------------------------------------------------- compression
@pytest.mark.parametrize("endpoint", ENDPOINTS)
def test_answers_are_asked_for_uncompressed(endpoint):
    _, method, path, body = ENDPOINTS[endpoint]
    with FakeSglang() as server:
        call(client_of(server), method, path, body, **small(endpoint))
    encodings = [value for name, value in server.wire[-1].headers if name.lower() == "accept-encoding"]
    assert encodings == ["identity"]


@pytest.mark.parametrize("fault", ["gzip", "gzip_bomb"])
@pytest.mark.parametrize("endpoint", ENDPOINTS)
def test_a_compressed_answer_is_refused_in_one_line_without_being_decompressed(endpoint, fault):
    prefix, method, path, body = ENDPOINTS[endpoint]
    gzip_bomb()  # made before memory is measured
    with FakeSglang(faults=[prefix + fault]) as server:
        tracemalloc.start()
        try:
            with pytest.raises(BadResponse) as caught:
                call(client_of(server), method, path, body, **small(endpoint))
            _, peak = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
    assert one_line(caught.value) == (
        f"{server.url} answered {method} {server.url}{path} compressed (Content-Encoding: gzip) although it was "
        f"asked for an uncompressed answer (Accept-Encoding: identity); refused: check the server, or the proxy in "
        f"front of it")
    assert peak < 32 * 1024 * 1024, f"{peak / 2**20:.0f} MiB while refusing: the 256 MiB bomb was not unpacked"


# ---------------------------------------------------------------------------------------- size caps
@pytest.mark.parametrize("endpoint", SMALL)
def test_a_short_json_answer_over_1_mib_is_refused(endpoint):
    prefix, method, path, body = ENDPOINTS[endpoint]
    with FakeSglang(faults=[prefix + "big"]) as server:
        with pytest.raises(BadResponse) as caught:
            call(client_of(server), method, path, body, small_answer=True)
    assert one_line(caught.value) == (
        f"{server.url} answered {method} {server.url}{path} with more than 1 MiB, where a short JSON answer is "
        f"expected; refused: is this the server's URL? (a server answering this much is misbehaving)")


@pytest.mark.parametrize("endpoint", ENDPOINTS)
def test_json_nested_deeper_than_python_reads_is_no_json_answer(endpoint):
    """Valid JSON 100,000 arrays deep: json's parser gives up with a RecursionError, which is an answer that is not
    JSON, said in one line, not a traceback."""
    prefix, method, path, body = ENDPOINTS[endpoint]
    with FakeSglang(faults=[prefix + "nested"]) as server:
        with pytest.raises(BadResponse) as caught:
            call(client_of(server), method, path, body, **small(endpoint))
    assert one_line(caught.value).startswith(f"{server.url} answered {method} {server.url}{path} with something "
                                             "that is not JSON")


@pytest.mark.parametrize("endpoint", ENDPOINTS)
def test_an_error_answer_nested_deeper_than_python_reads_is_named_by_its_status(endpoint):
    prefix, method, path, body = ENDPOINTS[endpoint]
    with FakeSglang(faults=[prefix + "500_nested"]) as server:
        with pytest.raises(ServerFailed) as caught:
            call(client_of(server), method, path, body, **small(endpoint))
    assert caught.value.status == 500 and one_line(caught.value).startswith(server.url)


def test_an_image_answer_keeps_its_own_larger_cap():
    with FakeSglang(faults=["big"]) as server:  # 2 MiB: over the short answers' cap, within an image's
        response = call(client_of(server), "POST", GEN, BODY)
    assert response.status == 200 and response.num_bytes > SMALL_ANSWER_BYTES


@pytest.mark.parametrize("endpoint", ENDPOINTS)
def test_an_error_body_is_read_no_further_than_the_short_answers_cap(endpoint):
    prefix, method, path, body = ENDPOINTS[endpoint]
    with FakeSglang(faults=[prefix + "500_huge"]) as server:
        tracemalloc.start()
        try:
            started = time.monotonic()
            with pytest.raises(ServerFailed) as caught:
                call(client_of(server), method, path, body, **small(endpoint))
            _, peak = tracemalloc.get_traced_memory()
        finally:
            tracemalloc.stop()
    assert time.monotonic() - started < PROMPTLY_S
    assert caught.value.status == 500 and one_line(caught.value).startswith(server.url)
    assert peak < 16 * 1024 * 1024, f"{peak / 2**20:.0f} MiB read of a 64 MiB error body"



# ------------------------------------------------------------------------------ through the node and the pipe
def turbo_sampler_on(pipe) -> None:
    from ernie_image.nodes.sampler import ErnieImageTurboSampler

    ErnieImageTurboSampler().generate(pipe=pipe, prompt="a fox", resolution="custom", width=256, height=256,
                                      steps=1, cfg=1.0, seed=3, batch_size=1, shift=4.0, use_pe=False)


def test_a_trickling_image_ends_the_run_at_its_read_timeout_naming_the_nodes_widget():
    from ernie_image.nodes.remote import ErnieImageRemoteBackend
    from ernie_image.runtime.remote.fleet import UnansweredImage

    with FakeSglang(faults=["trickle"]) as server:
        pipe = ErnieImageRemoteBackend().connect(server_urls=server.url, connect_timeout_s=2.0,
                                                 read_timeout_s=1.0)["result"][0]
        started = time.monotonic()
        try:
            with pytest.raises(UnansweredImage) as caught:
                turbo_sampler_on(pipe)
        finally:
            pipe.release()
        took = time.monotonic() - started
    # 1 s, grown with 1 step at 256x256 (read_timeout_per_step_megapixel_s 3): 1.2 s for the whole answer
    assert 1.2 <= took < 1.2 + PROMPTLY_S
    message = one_line(caught.value)
    assert message.startswith(f"image 1 of 1 (seed 3): {server.url} answered POST {server.url}{GEN} too slowly: the "
                              f"whole answer took longer than 1.2 s (read timeout), coming in bit by bit; check the "
                              f"server")
    assert "raise read_timeout_s if it is only slow" in message and "it is not sent again" in message
    assert len(server.generations) == 1


def test_cancel_ends_a_run_whose_image_trickles_in_at_once():
    from ernie_image.runtime.core.host import NullHost
    from ernie_image.runtime.core.request import GenerationRequest
    from ernie_image.runtime.remote.backend import RemotePipe, RemoteSettings

    from waiting import press_cancel

    with FakeSglang(faults=["trickle"]) as server:
        pipe = RemotePipe([server.url], RemoteSettings(read_timeout_base_s=600.0))
        host = NullHost()
        cancelled = do_when(server.trickling.is_set, lambda: press_cancel(host))
        request = GenerationRequest(prompt="a fox", negative_prompt="", width=256, height=256, steps=1, cfg=1.0,
                                    seed=0, batch=1)
        try:
            with pytest.raises(Cancelled):
                pipe.generate(request, host)
        finally:
            pipe.release()
        assert time.monotonic() - cancelled.result(PROMPTLY_S) < PROMPTLY_S, "back at the Cancel, not in 600 s"
