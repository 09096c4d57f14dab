"""Baidu's "Method 2" on the remote backend: the PE on its own chat server, then the SGLang DiT with its PE off.

Both servers are real aiohttp servers on loopback: the fake SGLang diffusion server and the chat-completions
server of the remote-PE tests. What the DiT server received is the proof.
"""
from __future__ import annotations

import threading
import time

import pytest

from ernie_image.nodes.remote import ErnieImageRemoteBackend
from ernie_image.nodes.sampler import ErnieImageTurboSampler
from ernie_image.runtime.errors import Cancelled
from ernie_image.runtime.host import NullHost
from ernie_image.runtime.remote.backend import RemotePipe, RemoteSettings
from ernie_image.runtime.request import GenerationRequest
from ernie_image.runtime.text.remote_enhancer import ChatEndpoint

from fake_sglang import FakeSglang
from test_enhancer_remote import ChatServer

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


def test_cancel_while_the_pe_server_hangs_sends_no_image_request():
    with FakeSglang() as sglang, ChatServer(faults=["hang"]) as chat:
        pipe = pipe_for(sglang, chat)
        host = NullHost()
        threading.Timer(0.3, lambda: setattr(host, "cancel_requested", True)).start()
        started = time.monotonic()
        try:
            with pytest.raises(Cancelled):
                pipe.generate(request(), host)
        finally:
            pipe.release()
        assert time.monotonic() - started < 2.0
    assert not sglang.generations


def test_remote_backend_node_and_sampler_output_the_revised_prompt():
    with FakeSglang() as sglang, ChatServer() as chat:
        node = ErnieImageRemoteBackend().connect(
            server_urls=sglang.url, connect_timeout_s=2.0, read_timeout_s=30.0, api_key_env="", api_key_file="",
            pe_url=chat.url, pe_model="baidu/ERNIE-Image-PE")
        pipe = node["result"][0]
        try:
            _, _, prompt_used = ErnieImageTurboSampler().generate(
                pipe=pipe, prompt=PROMPT, resolution="custom", width=256, height=256, steps=8, cfg=1.0, seed=5,
                batch_size=1, shift=4.0, use_pe=True)
        finally:
            pipe.release()
    assert prompt_used == f"revised: {PROMPT} @5"
    assert sglang.generations[0].body["prompt"] == prompt_used and sglang.generations[0].body["use_pe"] is False
    assert chat.received[0]["model"] == "baidu/ERNIE-Image-PE"
