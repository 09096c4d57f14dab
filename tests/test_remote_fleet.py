"""The fleet: a batch completes on the servers that work, whatever the others do, and no image runs twice.

Real aiohttp servers on loopback (tests/fake_sglang.py) that are dead from the start, die after an image or in
the middle of one, are slow, answer 503 now and then, 429 with Retry-After, or are still loading; each counts
what it received and what it ran. Short timeouts keep every case well under a second or two. Nothing waits a
fixed time: a server "still working" holds its answer until the test lets it go, and what must not have happened
is checked once the event that would have caused it is over (tests/waiting.py).
"""
from __future__ import annotations

import re
import sys
import time
from typing import Callable

import numpy as np
import pytest
import torch

from ernie_image.runtime.cli.names import cli_message, cli_words
from ernie_image.runtime.core.errors import Cancelled, InvalidInputError, RemoteError, named_settings
from ernie_image.runtime.core.host import NullHost
from ernie_image.runtime.core.request import GenerationRequest
from ernie_image.runtime.remote.backend import RemotePipe, RemoteSettings
from ernie_image.runtime.remote.fleet import ServersNotReady, UnansweredImage

from fake_sglang import FakeSglang, dead_url, free_port, render
from waiting import PROMPTLY_S, WAIT_S, do_when, press_cancel, wait_until

FAST = RemoteSettings(connect_timeout_s=0.5, retry_down_after_s=0.05, probe_every_s=0.05, wait_for_servers_s=10.0)
SIDE = 256
CAP = 32  # the fakes draw 32x32 noise scaled up: cheap PNGs keep each case fast


def fake(**behaviour) -> FakeSglang:
    return FakeSglang(image_side_cap=CAP, **behaviour)


def request(batch: int, seed: int = 100, **overrides) -> GenerationRequest:
    fields = dict(prompt="a red fox in snow", negative_prompt="", width=SIDE, height=SIDE, steps=8, cfg=1.0,
                  seed=seed, batch=batch)
    fields.update(overrides)
    return GenerationRequest(**fields)


def expected_image(seed: int) -> torch.Tensor:
    pixels = render("a red fox in snow", "", seed, 8, 1.0, False, SIDE, SIDE, CAP)
    return torch.from_numpy(np.asarray(pixels, np.float32) / 255)


class Servers:
    """The servers of one test, by kind; `url(i)` is what the pipe is given."""

    KINDS: dict[str, Callable[[], FakeSglang]] = {
        "live": lambda: fake(service_time_s=0.01),
        "slow": lambda: fake(service_time_s=0.15),
        "dies": lambda: fake(service_time_s=0.01, die_after=1),
        "flaky": lambda: fake(service_time_s=0.01, flaky_every=2),
        "503": lambda: fake(service_time_s=0.01, faults=["503", "503"]),
        "429": lambda: fake(service_time_s=0.01, faults=["429"], retry_after_s=0.3),
        "loading": lambda: fake(service_time_s=0.01, warmup_s=0.4),
        "500": lambda: fake(service_time_s=0.01, every_post="500"),
        "500_json": lambda: fake(service_time_s=0.01, every_post="500_json"),
    }

    def __init__(self, kinds: tuple[str, ...]) -> None:
        self.kinds = kinds
        self.fakes: dict[int, FakeSglang] = {}
        self.urls: list[str] = []
        for index, kind in enumerate(kinds):
            if kind == "dead":
                self.urls.append(dead_url())
                continue
            fake = self.KINDS[kind]()
            fake.start()
            self.fakes[index] = fake
            self.urls.append(fake.url)

    def ran(self) -> list[int]:
        return sorted(seed for fake in self.fakes.values() for seed in fake.ran)

    def stop(self) -> None:
        for fake in self.fakes.values():
            fake.stop()


def waiting_lines(host: NullHost) -> list[str]:
    """What the run said while no server could take work."""
    return [m for m in host.messages if m.startswith("waiting for")]


def lines_about(url: str, messages: list[str]) -> list[str]:
    """The notices whose subject is this server (its URL before the first ';'; not the fleet's waiting lines)."""
    return [m for m in messages if url in m.split(";", 1)[0] and not m.startswith("waiting for")]


def generate(urls: list[str], batch: int, settings: RemoteSettings = FAST, host: NullHost | None = None):
    host = host or NullHost()
    pipe = RemotePipe(urls, settings)
    try:
        return pipe.generate(request(batch), host), host
    finally:
        pipe.release()


# ------------------------------------------------------------------------------- the reported failure
@pytest.mark.parametrize("batch", [2, 3, 4])
@pytest.mark.parametrize("dead_first", [False, True], ids=["live-dead", "dead-live"])
def test_a_live_and_a_dead_server_serve_the_batch_at_once_with_default_settings(batch, dead_first):
    """RemotePipe([live, dead]) used to fail after ~30 s with "no server could take the remaining 1 of N images"
    in either order: a worker left when the queue was momentarily empty, while the dead server's image was
    about to come back to it."""
    with fake(service_time_s=0.01) as live:
        dead = dead_url()
        urls = [dead, live.url] if dead_first else [live.url, dead]
        started = time.monotonic()
        result, host = generate(urls, batch, RemoteSettings())
        wall = time.monotonic() - started
    assert wall < PROMPTLY_S, f"{wall:.1f} s (the reported failure took ~30 s)"
    assert [i["seed"] for i in result.info["images"]] == list(range(100, 100 + batch))
    assert {i["server"] for i in result.info["images"]} == {live.url}
    assert sorted(live.ran) == list(range(100, 100 + batch))
    about_dead = lines_about(dead, host.messages)
    assert len(about_dead) == 1 and "refused the connection" in about_dead[0], host.messages


# ------------------------------------------------------------------ every mix of servers, batches 1-8
MIXES = [
    ("live", "dead"), ("dead", "live"), ("live", "slow"), ("slow", "dead"), ("dead", "slow", "live"),
    ("live", "dies"), ("dies", "dead", "live"), ("live", "flaky"), ("flaky", "503"), ("429", "live"),
    ("loading", "dead"), ("dead", "dead", "live"), ("live", "500"), ("500", "live"), ("500_json", "dead", "slow"),
]


@pytest.mark.parametrize("batch", [1, 2, 3, 4, 8])
@pytest.mark.parametrize("kinds", MIXES, ids=["-".join(mix) for mix in MIXES])
def test_a_batch_completes_on_the_servers_that_work(kinds, batch):
    servers = Servers(kinds)
    try:
        result, host = generate(servers.urls, batch)
    finally:
        servers.stop()
    seeds = list(range(100, 100 + batch))
    assert result.images.shape == (batch, SIDE, SIDE, 3)
    assert [i["seed"] for i in result.info["images"]] == seeds, "images come back in seed order"
    for index, seed in enumerate(seeds):
        assert torch.equal(result.images[index], expected_image(seed))
    assert servers.ran() == seeds, "every image ran exactly once, on one server"
    for index, kind in enumerate(kinds):
        about = lines_about(servers.urls[index], host.messages)
        if kind == "dead":
            assert len(about) == 1 and "refused" in about[0], host.messages
        elif kind in ("live", "slow"):
            assert about == [], host.messages
        elif kind.startswith("500") and len(servers.fakes[index].generations):
            assert len(about) == 1 and "HTTP 500" in about[0] and "giving up on" in about[0], host.messages
        for line in about:
            assert "\n" not in line


def test_a_server_answering_500_to_every_image_is_given_up_on_and_its_image_made_elsewhere():
    """The reported failure: [live, broken] with a batch of 6 ended in the broken server's 500, nothing kept."""
    with fake(service_time_s=0.05) as live, fake(every_post="500") as broken:
        result, host = generate([live.url, broken.url], 6)
    assert [i["seed"] for i in result.info["images"]] == list(range(100, 106))
    assert sorted(live.ran) == list(range(100, 106)) and broken.ran == []
    assert len(broken.generations) == 1, "one answered 500 takes the server out of this batch"
    about = lines_about(broken.url, host.messages)
    assert len(about) == 1 and "\n" not in about[0], host.messages
    assert f"giving up on {broken.url} for this batch" in about[0] and "HTTP 500" in about[0]
    assert "goes back to the queue" in about[0] and live.url in about[0]


def failed_batch_message(urls: list[str], count: int) -> str:
    """The one-line error of a batch of `count` on a fleet of `urls` that cannot complete it."""
    pipe = RemotePipe(urls, FAST)
    try:
        with pytest.raises(RemoteError) as caught:
            pipe.generate(request(count), NullHost())
    finally:
        pipe.release()
    return str(caught.value)


def test_an_image_every_server_fails_ends_once_each_has_failed_it_naming_each():
    with fake(every_post="500") as a, fake(every_post="500_json") as b:
        message = failed_batch_message([a.url, b.url], 3)
    assert "\n" not in message and "no server could take the 3 images" in message
    assert a.url in message and b.url in message and "CUDA out of memory" in message
    assert len(a.generations) == len(b.generations) == 1, "each server fails an image once, then is out"


def test_a_batch_that_fails_after_some_images_says_how_many_were_received():
    with fake(faults=["", "500"]) as server:  # the first image is made, the second answered with a 500
        message = failed_batch_message([server.url], 3)
    assert "\n" not in message and "no server could take the remaining 2 of 3 images" in message
    assert "HTTP 500" in message and "1 of 3 images were received before this and are not kept" in message
    assert server.ran == [100] and len(server.generations) == 2


def test_a_server_dropping_the_connection_is_given_up_on_and_the_rest_of_the_batch_is_made():
    """A dropped connection may leave the image running: that image is not sent again, the others are made."""
    with fake(service_time_s=0.05) as live, fake(every_post="reset") as dropping:
        pipe = RemotePipe([live.url, dropping.url], FAST)
        host = NullHost()
        with pytest.raises(UnansweredImage) as caught:
            pipe.generate(request(6), host)
        pipe.release()
    message = str(caught.value)
    assert len(dropping.generations) == 1 and len(live.ran) == 5 and len(set(live.ran)) == 5
    unmade = dropping.generations[0].body["seed"]
    assert unmade not in live.ran, "the dropped image went nowhere else"
    assert "\n" not in message and f"(seed {unmade})" in message and "dropped the connection" in message
    assert "5 of 6 images were received" in message and "not sent again" in message
    about = lines_about(dropping.url, host.messages)
    assert len(about) == 1 and "giving up on" in about[0] and live.url in about[0], host.messages


def test_a_slow_server_gets_fewer_images_than_a_fast_one():
    with fake(service_time_s=0.01) as fast, fake(service_time_s=0.3) as slow:
        result, _ = generate([slow.url, fast.url], 8)
    assert len(slow.ran) <= 2 and len(fast.ran) >= 6 and len(result.info["images"]) == 8


def test_every_server_given_up_on_is_one_line_per_server():
    """Ready servers that keep refusing work (503 after /health said ok) are given up on, each named once."""
    with fake(faults=["503"] * 10) as a, fake(faults=["503"] * 10) as b:
        message = failed_batch_message([a.url, b.url], 2)
    assert "\n" not in message and "no server could take the 2 images" in message
    assert a.url in message and b.url in message and a.ran == b.ran == []


@pytest.mark.parametrize("batch, said", [(1, "the image"), (3, "the 3 images")])
@pytest.mark.parametrize("how", ["another model", "an API key asked for"])
def test_a_fleet_given_up_on_at_its_first_look_names_the_images_it_could_not_take(how, batch, said):
    """Every server set aside before any image is sent (not ERNIE-Image, a key it wants): the error counts the
    batch's images, never "the remaining 0 of 0 images"."""
    behaviour = {"another model": dict(model_id="black-forest-labs/FLUX.1-dev", pipeline_name="FluxPipeline"),
                 "an API key asked for": dict(api_key="sk-not-bound-here")}[how]
    with fake(**behaviour) as a, fake(**behaviour) as b:
        message = failed_batch_message([a.url, b.url], batch)
        assert a.generations == b.generations == []
    assert "\n" not in message and message.startswith(f"no server could take {said} ({a.url}")
    assert "0 of 0" not in message and b.url in message


def test_a_fleet_asked_which_model_it_serves_that_no_server_can_answer_says_any_work():
    with fake(api_key="sk-not-bound-here") as a, fake(api_key="sk-not-bound-here") as b:
        pipe = RemotePipe([a.url, b.url], FAST)
        try:
            with pytest.raises(RemoteError) as caught:
                pipe.served_variant(NullHost())
        finally:
            pipe.release()
    assert str(caught.value).startswith(f"no server could take any work ({a.url} asks for an API key")


# ------------------------------------------------------------------------------ never a duplicate job
SLOW_ANSWER = RemoteSettings(connect_timeout_s=0.5, retry_down_after_s=0.05, probe_every_s=0.05,
                             read_timeout_base_s=0.3, read_timeout_per_step_megapixel_s=0.0)


def finished(server: FakeSglang) -> None:
    """Let a server holding its answers finish, and wait until it has: a copy of an image sent to it, had one been
    sent, was queued behind that image and arrived long before (the pipe sends nothing once generate returned)."""
    server.let_answers_go()
    wait_until(lambda: server.completed, what=f"{server.url} finishing the image it held")


def test_an_image_without_an_answer_is_never_sent_again_by_default():
    with fake(hold_answers=True) as slow:  # the server is still working whatever the read timeout
        pipe = RemotePipe([slow.url], SLOW_ANSWER)
        with pytest.raises(UnansweredImage) as caught:  # the batch stops at the read timeout: nothing was answered
            pipe.generate(request(1), NullHost())
        pipe.release()
        finished(slow)
        assert len(slow.generations) == 1 and slow.ran == [100]
    message = str(caught.value)
    assert "\n" not in message and "may still be working on it" in message
    assert "not sent again" in message and "turn on resend_unanswered)" in message  # the Python and node name
    assert "turn on --resend-unanswered)" in cli_message(caught.value)  # the CLI's, from the same error


def test_an_unanswered_image_does_not_go_to_another_server_either():
    with fake(hold_answers=True) as slow, fake(service_time_s=0.1) as fast:
        pipe = RemotePipe([slow.url, fast.url], SLOW_ANSWER)
        with pytest.raises(UnansweredImage, match=r"image \d of 4 \(seed 10\d\)"):
            pipe.generate(request(4), NullHost())
        pipe.release()
        finished(slow)
        sent = [g.body["seed"] for server in (slow, fast) for g in server.generations]
    assert len(slow.generations) == 1, "the slow server got one image and no copy of it"
    assert len(sent) == len(set(sent)), f"an image was sent twice: {sent}"


def test_resend_unanswered_sends_it_again_and_says_the_server_may_still_run_it():
    settings = RemoteSettings(connect_timeout_s=0.5, retry_down_after_s=0.05, probe_every_s=0.05,
                              read_timeout_base_s=0.3, read_timeout_per_step_megapixel_s=0.0, resend_unanswered=True)
    with fake(hold_answers=True) as slow, fake(service_time_s=0.05) as fast:
        result, host = generate([slow.url, fast.url], 3, settings)
    assert [i["seed"] for i in result.info["images"]] == [100, 101, 102]
    resent = [m for m in host.messages if "is sent again" in m]
    assert resent and "may still be working on the first copy" in resent[0] and slow.url in resent[0]
    assert "as --resend-unanswered asks" in cli_words(resent[0], named_settings(resent[0]))  # the CLI's flag
    assert len(slow.generations) == 1 and len(fast.generations) == 3, "the copy went to the server that answers"


def test_a_server_that_dies_while_working_is_not_sent_the_image_again():
    with fake(service_time_s=0.4, die_during=1) as dying, fake(service_time_s=0.05) as live:
        pipe = RemotePipe([dying.url], FAST)
        with pytest.raises(UnansweredImage, match="dropped the connection.*not sent again"):
            pipe.generate(request(1), NullHost())
        pipe.release()
        assert len(dying.generations) == 1 and live.generations == []


def test_only_requests_known_not_to_have_started_are_sent_again():
    """Refused and 503/429 answers come before any work: those images go elsewhere or later, each still once."""
    with fake(service_time_s=0.02, faults=["503", "429"]) as busy:
        result, host = generate([dead_url(), busy.url], 3)
    assert [g.body["seed"] for g in busy.generations][:2] == [100, 100], "the 503 and the 429 were sent again"
    assert busy.ran == [100, 101, 102]
    assert any("HTTP 503" in m for m in host.messages) and len(result.info["images"]) == 3


def test_retry_after_of_a_429_is_honoured():
    with fake(service_time_s=0.01, faults=["429"], retry_after_s=0.6) as busy:
        generate([busy.url], 1)
        first, second = busy.generations[0].at, busy.generations[1].at
    assert 0.55 <= second - first < 0.6 + PROMPTLY_S, f"sent again after {second - first:.2f} s"


# ----------------------------------------------------------------------------- waiting for servers
def test_a_loading_server_is_waited_for_with_progress_lines():
    host = NullHost()
    with fake(service_time_s=0.01, warmup_s=1.2) as loading:
        result, host = generate([loading.url], 2, FAST, host)
    waiting = waiting_lines(host)
    assert waiting and re.match(rf"waiting for {re.escape(loading.url)}: loading, \d+ s", waiting[0]), host.messages
    assert loading.generations and min(g.at for g in loading.generations) >= loading._started_at + 1.2, \
        "no image is sent before /health says ready"
    assert len(result.info["images"]) == 2


def test_a_server_that_starts_late_is_waited_for_and_refused_is_not_called_loading():
    port = free_port()
    late = FakeSglang(port=port, service_time_s=0.01, image_side_cap=CAP)
    host = NullHost()
    started = do_when(lambda: waiting_lines(host), late.start)  # it comes up once the run waits for it, refused
    try:
        result, host = generate([f"http://127.0.0.1:{port}"], 1, FAST, host)
    finally:
        started.result(WAIT_S)
        late.stop()
    waiting = waiting_lines(host)
    assert waiting and ": refused (nothing listening" in waiting[0] and "loading," not in waiting[0]
    assert len(result.info["images"]) == 1


def test_cancel_during_the_wait_returns_at_once():
    host = NullHost()
    pipe = RemotePipe([dead_url()], RemoteSettings(wait_for_servers_s=600.0, probe_every_s=0.05))
    cancelled = do_when(lambda: waiting_lines(host), lambda: press_cancel(host))  # Cancel pressed while it waits
    with pytest.raises(Cancelled):
        pipe.generate(request(1), host)
    returned_at = time.monotonic()
    pipe.release()
    assert returned_at - cancelled.result(WAIT_S) < PROMPTLY_S, "the Cancel ends the 600 s wait"


def test_no_server_ready_within_the_wait_is_one_line_naming_each_and_its_state():
    with fake(warmup_s=60) as loading:
        dead = dead_url()
        pipe = RemotePipe([dead, loading.url], RemoteSettings(wait_for_servers_s=0.5, probe_every_s=0.05,
                                                               connect_timeout_s=0.5))
        started = time.monotonic()
        with pytest.raises(ServersNotReady) as caught:
            pipe.generate(request(2), NullHost())
        waited = time.monotonic() - started
        pipe.release()
        assert loading.generations == []
    message = str(caught.value)
    assert 0.5 <= waited < 0.5 + PROMPTLY_S, f"{waited:.2f} s: the wait, not the loading server's 60 s"
    assert "\n" not in message and "within 0.5 s" in message
    assert f"{dead}: nothing is listening there (connection refused); " in message
    assert f"{loading.url}: still loading (/health answers HTTP 503): start or fix the servers" in message


def test_waiting_zero_fails_as_soon_as_every_server_was_asked(monkeypatch):
    # A server's first look is awaited at least FIRST_LOOK_S (1 s), even with no wait: made a minute here, a run
    # that sat it out although the server had already answered (refused) could not pass for one that did not.
    monkeypatch.setattr(sys.modules[ServersNotReady.__module__], "FIRST_LOOK_S", 60.0)
    pipe = RemotePipe([dead_url()], RemoteSettings(wait_for_servers_s=0, probe_every_s=0.05))
    started = time.monotonic()
    with pytest.raises(ServersNotReady, match="nothing is listening there"):
        pipe.generate(request(1), NullHost())
    assert time.monotonic() - started < PROMPTLY_S
    pipe.release()


def test_the_start_notice_never_says_about_0_s():
    host = NullHost()
    with fake(service_time_s=0.01) as server:
        pipe = RemotePipe([server.url], FAST)
        pipe.generate(request(1), host)
        pipe.generate(request(2), host)
        pipe.release()
    starts = [m for m in host.messages if m.startswith("sending")]
    assert "time known after the first image" in starts[0]
    assert re.search(r"about \d+\.\d s", starts[1]) and "about 0 s" not in " ".join(starts)


# ------------------------------------------------------------------------------------------ keys
def test_each_server_of_a_fleet_gets_the_key_bound_to_its_own_origin_and_an_unbound_one_none(keys_file, monkeypatch):
    """One batch over three servers: each is sent only its own key (the user's keys file), the third none at all."""
    monkeypatch.setenv("ERNIE_TEST_FLEET_KEY", "sk-fleet-first-0123")
    with fake(api_key="sk-fleet-first-0123", service_time_s=0.01) as first, \
            fake(api_key="sk-fleet-second-4567", service_time_s=0.01) as second, fake(service_time_s=0.01) as third:
        keys_file({"label": "first", "origin": first.url, "env": "ERNIE_TEST_FLEET_KEY"},
                  {"label": "second", "origin": second.url, "key": "sk-fleet-second-4567"})
        result, _ = generate([first.url, second.url, third.url], 6)
        sent = {server.url: {dict(r.headers).get("Authorization", "") for r in server.wire}
                for server in (first, second, third)}
    assert len(result.images) == 6 and all(server.ran for server in (first, second, third))
    assert sent == {first.url: {"Bearer sk-fleet-first-0123"}, second.url: {"Bearer sk-fleet-second-4567"},
                    third.url: {""}}


def test_one_label_for_a_fleet_is_refused_unless_every_server_is_its_origin(keys_file, monkeypatch):
    monkeypatch.setenv("ERNIE_TEST_FLEET_KEY", "sk-fleet-first-0123")
    with fake() as first, fake() as second:
        keys_file({"label": "first", "origin": first.url, "env": "ERNIE_TEST_FLEET_KEY"})
        with pytest.raises(InvalidInputError, match=f"credential 'first' is not bound to {second.url}"):
            RemotePipe([first.url, second.url], RemoteSettings(credential="first"))
        assert first.wire == [] and second.wire == []
