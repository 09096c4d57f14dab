"""Baidu's "Method 2" on the remote backend: the PE on its own chat server, then the SGLang DiT with its PE off.

Both servers are real aiohttp servers on loopback: the fake SGLang diffusion server and the chat-completions
server of the remote-PE tests. What the DiT server received is the proof.
"""
from __future__ import annotations

import time

import pytest

from ernie_image.nodes.remote import ErnieImageRemoteBackend
from ernie_image.nodes.sampler import ErnieImageTurboSampler
from ernie_image.runtime.core.errors import Cancelled
from ernie_image.runtime.core.host import NullHost
from ernie_image.runtime.core.request import GenerationRequest
from ernie_image.runtime.net.errors import ServerRejected
from ernie_image.runtime.remote.backend import RemotePipe, RemoteSettings
from ernie_image.runtime.text.remote_enhancer import ChatEndpoint

from fake_sglang import FakeSglang
from test_enhancer_remote import ChatServer
from waiting import PROMPTLY_S, WAIT_S, do_when, press_cancel

PROMPT = "a red fox in snow"


def request(**overrides) -> GenerationRequest:
    fields = dict(prompt=PROMPT, width=256, height=256, steps=8, cfg=1.0, seed=1234, batch=1, use_pe=True)
    fields.update(overrides)
    return GenerationRequest(**fields)


def pipe_for(sglang: FakeSglang, chat: ChatServer, **endpoint) -> RemotePipe:
    settings = RemoteSettings(retry_attempts=2, retry_down_after_s=0.2, connect_timeout_s=1.0,
                              pe_endpoint=ChatEndpoint(url=chat.url, read_timeout_s=5.0, **endpoint))
    return RemotePipe([sglang.url], settings)


def test_the_dit_gets_the_revised_prompt_with_the_pe_off():
    with FakeSglang() as sglang, ChatServer() as chat:
        pipe = pipe_for(sglang, chat)
        try:
            result = pipe.generate(request(batch=2), NullHost())
        finally:
            pipe.release()
    revised = f"revised: {PROMPT} @1234"
    sent = [g.body for g in sglang.generations]
    assert [(b["prompt"], b["use_pe"], b["seed"]) for b in sent] == [(revised, False, 1234), (revised, False, 1235)]
    assert len(chat.received) == 1, "one distinct prompt: revised once, with the request's seed"
    assert chat.received[0]["messages"][-1]["content"] == f'{{"prompt": "{PROMPT}", "width": 256, "height": 256}}'
    assert result.prompts_used == [revised, revised]
    assert result.info["pe"] == "remote" and result.info["pe_tokens"] == 17
    assert "PE chat endpoint" in result.info["prompt_enhancer"]


def test_pe_off_sends_nothing_to_the_pe_server():
    with FakeSglang() as sglang, ChatServer() as chat:
        pipe = pipe_for(sglang, chat)
        try:
            result = pipe.generate(request(use_pe=False), NullHost())
        finally:
            pipe.release()
    assert not chat.received
    assert (sglang.generations[0].body["prompt"], sglang.generations[0].body["use_pe"]) == (PROMPT, False)
    assert result.prompts_used == [PROMPT] and "pe" not in result.info


def test_a_failed_pe_server_keeps_the_original_prompt_and_still_turns_the_servers_pe_off():
    with FakeSglang() as sglang, ChatServer(faults=["500", "500"]) as chat:
        pipe = pipe_for(sglang, chat, retry_attempts=1)
        host = NullHost()
        try:
            result = pipe.generate(request(), host)
        finally:
            pipe.release()
    assert (sglang.generations[0].body["prompt"], sglang.generations[0].body["use_pe"]) == (PROMPT, False)
    assert result.prompts_used == [PROMPT] and result.info["pe"] == "original"
    assert any("original prompt is used" in m for m in host.messages)
    assert result.request.use_pe is False, "the settings recorded say what ran: no enhancer"


def test_cancel_while_the_pe_server_hangs_sends_no_image_request():
    with FakeSglang() as sglang, ChatServer(faults=["hang"]) as chat:
        pipe = pipe_for(sglang, chat)
        host = NullHost()
        cancelled = do_when(lambda: chat.received, lambda: press_cancel(host))  # Cancel while the PE server hangs
        try:
            with pytest.raises(Cancelled):
                pipe.generate(request(), host)
            returned_at = time.monotonic()
        finally:
            pipe.release()
    assert returned_at - cancelled.result(WAIT_S) < PROMPTLY_S, "back at the Cancel, not when the PE server answers"
    assert not sglang.generations


def test_remote_backend_node_and_sampler_output_the_revised_prompt():
    with FakeSglang() as sglang, ChatServer() as chat:
        node = ErnieImageRemoteBackend().connect(
            server_urls=sglang.url, connect_timeout_s=2.0, read_timeout_s=30.0,
            pe_url=chat.url, pe_model="baidu/ERNIE-Image-PE")
        pipe = node["result"][0]
        try:
            _, _, prompt_used = ErnieImageTurboSampler().generate(
                pipe=pipe, prompt=PROMPT, resolution="custom", width=256, height=256, steps=8, cfg=1.0, seed=5,
                batch_size=1, shift=4.0, use_pe=True)["result"]
        finally:
            pipe.release()
    assert prompt_used == f"revised: {PROMPT} @5"
    assert sglang.generations[0].body["prompt"] == prompt_used and sglang.generations[0].body["use_pe"] is False
    assert chat.received[0]["model"] == "baidu/ERNIE-Image-PE"


def test_the_pe_model_is_asked_for_once_per_pipe_not_once_per_prompt():
    with FakeSglang() as sglang, ChatServer() as chat:
        pipe = pipe_for(sglang, chat)
        host = NullHost()
        try:
            first = pipe.enhance("a fox", 256, 256, seed=1, host=host)
            second = pipe.enhance("a hare", 256, 256, seed=2, host=host)
            result = pipe.generate(request(), host)
        finally:
            pipe.release()
    assert chat.models_asked == 1, "three revisions, one model list"
    assert [body["model"] for body in chat.received] == ["baidu/ERNIE-Image-PE"] * 3
    assert (first.prompts, second.prompts) == (["revised: a fox @1"], ["revised: a hare @2"])
    assert result.prompts_used == [f"revised: {PROMPT} @1234"]
    assert not any("original prompt" in message for message in host.messages)


def test_a_pe_server_restarted_with_another_model_is_asked_again_once():
    with ChatServer() as chat:
        pipe = RemotePipe(["http://127.0.0.1:1"], RemoteSettings(pe_endpoint=ChatEndpoint(url=chat.url)))
        host = NullHost()
        pipe.enhance("a fox", 256, 256, seed=1, host=host)
        chat.model = "baidu/ERNIE-Image-PE-v2"
        result = pipe.enhance("a fox", 256, 256, seed=1, host=host)
        pipe.enhance("a hare", 256, 256, seed=1, host=host)
    assert result.prompts == ["revised: a fox @1"] and result.revisions[0].source == "remote"
    assert chat.models_asked == 2
    assert [body["model"] for body in chat.received] == [
        "baidu/ERNIE-Image-PE",  # kept from the first model list
        "baidu/ERNIE-Image-PE",  # 404 "does not exist": forgotten, the list asked again
        "baidu/ERNIE-Image-PE-v2",
        "baidu/ERNIE-Image-PE-v2",  # kept again
    ]
    assert host.messages == [f"the PE server at {chat.url} now serves baidu/ERNIE-Image-PE-v2 instead of "
                             f"baidu/ERNIE-Image-PE: using it"]


def test_a_404_under_the_same_listed_name_is_raised_after_one_new_look():
    with ChatServer() as chat:
        pipe = RemotePipe(["http://127.0.0.1:1"], RemoteSettings(pe_endpoint=ChatEndpoint(url=chat.url)))
        pipe.enhance("a fox", 256, 256, seed=1)
        chat.faults = ["404"]  # the chat path fails while the list still names the same model
        with pytest.raises(ServerRejected, match="HTTP 404.*does not exist"):
            pipe.enhance("a fox", 256, 256, seed=1)
    assert chat.models_asked == 2 and len(chat.received) == 2, "one new look, no second chat request"


def test_a_named_pe_model_never_asks_the_model_list():
    with ChatServer() as chat:
        pipe = RemotePipe(["http://127.0.0.1:1"],
                          RemoteSettings(pe_endpoint=ChatEndpoint(url=chat.url, model="baidu/ERNIE-Image-PE")))
        pipe.enhance("a fox", 256, 256, seed=1)
        pipe.enhance("a hare", 256, 256, seed=1)
        chat.model = "other"
        with pytest.raises(ServerRejected, match="check the PE model name 'baidu/ERNIE-Image-PE'"):
            pipe.enhance("a fox", 256, 256, seed=1)
    assert chat.models_asked == 0 and len(chat.received) == 3


def test_release_forgets_the_pe_model():
    with ChatServer() as chat:
        pipe = RemotePipe(["http://127.0.0.1:1"], RemoteSettings(pe_endpoint=ChatEndpoint(url=chat.url)))
        pipe.enhance("a fox", 256, 256, seed=1)
        pipe.release()
        pipe.enhance("a fox", 256, 256, seed=1)
    assert chat.models_asked == 2


def test_a_pe_server_that_is_down_keeps_the_original_prompt_and_is_asked_again_next_time():
    from fake_sglang import free_port

    url = f"http://127.0.0.1:{free_port()}"
    pipe = RemotePipe(["http://127.0.0.1:1"],
                      RemoteSettings(pe_endpoint=ChatEndpoint(url=url, connect_timeout_s=1.0, retry_attempts=1)))
    host = NullHost()
    result = pipe.enhance("a fox", 256, 256, seed=1, host=host)
    assert result.prompts == ["a fox"] and result.revisions[0].source == "original"
    assert len(host.messages) == 1 and "refused the connection" in host.messages[0]
    with ChatServer(port=int(url.rsplit(":", 1)[1])) as chat:  # the server came up: nothing stale was kept
        assert pipe.enhance("a fox", 256, 256, seed=1).prompts == ["revised: a fox @1"]
    assert chat.models_asked == 1
