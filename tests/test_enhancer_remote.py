"""The remote prompt enhancer against a real aiohttp server on loopback speaking OpenAI's chat-completions protocol.

Faults (timeouts, 5xx, malformed or empty replies, a server that is down) keep the original prompt and tell the
user in one line; a refused key or a wrong model name is an error to fix.
"""
from __future__ import annotations

import asyncio
import json
import socket
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Optional

import pytest
from aiohttp import web

from ernie_image.runtime.cli.enhance import main_enhance
from ernie_image.runtime.core.errors import Cancelled, InvalidInputError, RemoteError
from ernie_image.runtime.core.host import NullHost
from ernie_image.runtime.net.credentials import Credentials, load_credentials
from ernie_image.runtime.net.errors import AuthenticationError, ServerRejected
from ernie_image.runtime.text.remote_enhancer import ChatEndpoint, revise_prompts_remote

from waiting import PROMPTLY_S

SECRET = "sk-test-0123456789"


@dataclass
class ChatServer:
    """vLLM-like: /v1/models lists one model, /v1/chat/completions answers `revised: <prompt> @<seed>`.

    `faults` are consumed one per chat request: "500", "503", "hang", "trickle" (a well-formed reply, one byte
    every 0.05 s), "not_json", "no_choices", "empty", "length" (finish_reason length), "404", "huge" (a 9 MiB reply), "no_usage" (no token counts), "escapes" (terminal escape codes
    around the revision), "surrogate" (a lone surrogate in the revision, as JSON's \\ud800 escape gives it). Assigning `model` while it runs is a server restarted with another
    model: it lists the new one, and a chat request naming the old one gets vLLM's 404 "does not exist".
    """

    model: str = "baidu/ERNIE-Image-PE"
    api_key: Optional[str] = None
    faults: list[str] = field(default_factory=list)
    received: list[dict[str, Any]] = field(default_factory=list)
    headers: list[dict[str, str]] = field(default_factory=list)
    models_asked: int = 0  # GET /v1/models requests, answered or not
    port: int = 0  # 0: a free one

    def __enter__(self) -> "ChatServer":
        if not self.port:
            sock = socket.socket()
            sock.bind(("127.0.0.1", 0))
            self.port = sock.getsockname()[1]
            sock.close()
        self.url = f"http://127.0.0.1:{self.port}"
        self._loop = asyncio.new_event_loop()
        started = threading.Event()
        self._thread = threading.Thread(target=self._serve, args=(started,), daemon=True)
        self._thread.start()
        assert started.wait(10)
        return self

    def __exit__(self, *exc) -> None:
        self._loop.call_soon_threadsafe(self._release.set)  # let hanging handlers finish so shutdown is quick
        asyncio.run_coroutine_threadsafe(self._runner.cleanup(), self._loop).result(10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)

    def _serve(self, started: threading.Event) -> None:
        asyncio.set_event_loop(self._loop)
        self._release = asyncio.Event()
        app = web.Application()
        app.router.add_get("/v1/models", self._models)
        app.router.add_post("/v1/chat/completions", self._chat)
        self._runner = web.AppRunner(app)
        self._loop.run_until_complete(self._runner.setup())
        self._loop.run_until_complete(web.TCPSite(self._runner, "127.0.0.1", self.port).start())
        started.set()
        self._loop.run_forever()

    def _authorised(self, request: web.Request) -> bool:
        return self.api_key is None or request.headers.get("Authorization") == f"Bearer {self.api_key}"

    async def _models(self, request: web.Request) -> web.Response:
        self.models_asked += 1
        if not self._authorised(request):
            return web.json_response({"error": {"message": "invalid api key"}}, status=401)
        return web.json_response({"object": "list", "data": [{"id": self.model, "object": "model"}]})

    async def _chat(self, request: web.Request) -> web.StreamResponse:
        self.headers.append(dict(request.headers))
        if not self._authorised(request):
            return web.json_response({"error": {"message": "invalid api key"}}, status=401)
        body = await request.json()
        self.received.append(body)
        fault = self.faults.pop(0) if self.faults else None
        if fault == "500":
            return web.Response(status=500, text="Internal Server Error")
        if fault == "503":
            return web.json_response({"error": {"message": "overloaded"}}, status=503)
        if fault == "hang":
            try:
                await asyncio.wait_for(self._release.wait(), 30)
            except asyncio.TimeoutError:
                pass
        if fault == "trickle":
            return await self._trickle(request)
        if fault == "not_json":
            return web.Response(text="<html>gateway</html>", content_type="text/html")
        if fault == "huge":
            return web.Response(body=b" " * (9 << 20), content_type="application/json")
        if fault == "no_choices":
            return web.json_response({"id": "x", "object": "chat.completion", "choices": []})
        if body.get("model") != self.model or fault == "404":
            message = f"The model `{body.get('model')}` does not exist."
            return web.json_response({"error": {"message": message, "code": 404}}, status=404)
        user = json.loads(body["messages"][-1]["content"])
        content = "" if fault == "empty" else f"  revised: {user['prompt']} @{body.get('seed')}\n"
        if fault == "surrogate":
            content = f"revised: {user['prompt']} \ud800"
        if fault == "escapes":
            content = f"\x1b[2J\x1b]0;owned\x07{content.strip()}\x1b[0m"
        return web.json_response({
            "id": "chatcmpl-1", "object": "chat.completion", "model": self.model,
            "choices": [{"index": 0, "message": {"role": "assistant", "content": content},
                         "finish_reason": "length" if fault == "length" else "stop"}],
            **({} if fault == "no_usage" else {"usage": {"prompt_tokens": 90, "completion_tokens": 17,
                                                           "total_tokens": 107}}),
        })


    async def _trickle(self, request: web.Request) -> web.StreamResponse:
        reply = json.dumps({"choices": [{"index": 0, "message": {"role": "assistant", "content": "too late"},
                                         "finish_reason": "stop"}], "padding": "x" * 4096}).encode()
        resp = web.StreamResponse(headers={"Content-Type": "application/json", "Content-Length": str(len(reply))})
        await resp.prepare(request)
        try:
            for index in range(len(reply)):
                await resp.write(reply[index:index + 1])
                if self._release.is_set():
                    break
                await asyncio.sleep(0.05)
        except (ConnectionResetError, RuntimeError):
            pass  # the client gave up on it
        return resp


def fast_endpoint(url: str, **overrides) -> ChatEndpoint:
    settings = dict(url=url, connect_timeout_s=1.0, read_timeout_s=1.0, retry_attempts=2)
    settings.update(overrides)
    return ChatEndpoint(**settings)


def test_request_is_the_pe_user_message_with_baidus_settings_and_seed():
    with ChatServer() as server:
        host = NullHost()
        result = revise_prompts_remote(fast_endpoint(server.url + "/v1"), ["a cat 猫"], 848, 1264, seed=42,
                                       host=host)
    assert result.prompts == ["revised: a cat 猫 @42"]
    body = server.received[0]
    assert body["model"] == "baidu/ERNIE-Image-PE"  # discovered from /v1/models
    assert body["messages"] == [{"role": "user", "content": '{"prompt": "a cat 猫", "width": 848, "height": 1264}'}]
    assert (body["temperature"], body["top_p"], body["max_tokens"], body["seed"]) == (0.6, 0.95, 512, 42)
    assert result.revisions[0].source == "remote" and result.revisions[0].tokens == 17
    assert result.info()["pe"] == "remote" and result.info()["pe_tokens"] == 17
    assert host.messages == []


def test_distinct_prompts_are_sent_once_each():
    with ChatServer() as server:
        result = revise_prompts_remote(fast_endpoint(server.url, model="baidu/ERNIE-Image-PE"),
                                       ["a", "b", "a"], 1024, 1024, seed=1)
    assert result.prompts == ["revised: a @1", "revised: b @1", "revised: a @1"]
    assert len(server.received) == 2


@pytest.mark.parametrize("fault, said", [
    ("500", "(HTTP 500)"),
    ("hang", "sent no revised prompt within 1 s"),
    ("trickle", "answered too slowly: the whole answer took longer than 1 s, coming in bit by bit; check the server"),
    ("not_json", "not JSON"),
    ("no_choices", "choices[0].message.content"),
    ("surrogate", "answered a message content that is not valid Unicode text (a lone surrogate)"),
    ("huge", "with more than 8 MiB; refused (a server answering this much is misbehaving; a revised prompt is a few "
             "kilobytes: check that it is a chat completions server)"),
])
def test_faults_keep_the_original_prompt_and_tell_the_user(fault, said):
    with ChatServer(faults=[fault]) as server:
        host = NullHost()
        started = time.monotonic()
        result = revise_prompts_remote(fast_endpoint(server.url), ["a red fox"], 1024, 1024, seed=0, host=host)
    assert result.prompts == ["a red fox"]
    assert result.revisions[0].source == "original"
    assert len(host.messages) == 1 and "original prompt is used" in host.messages[0] and said in host.messages[0]
    assert time.monotonic() - started < 10


def test_empty_reply_keeps_the_original_prompt():
    with ChatServer(faults=["empty"]) as server:
        host = NullHost()
        result = revise_prompts_remote(fast_endpoint(server.url), ["a red fox"], 1024, 1024, seed=0, host=host)
    assert result.prompts == ["a red fox"]
    assert host.messages == [f"remote prompt enhancer at {server.url} returned an empty prompt: the original "
                             f"prompt is used"]


def test_without_keep_original_an_empty_reply_is_an_error():
    with ChatServer(faults=["empty"]) as server:
        host = NullHost()
        with pytest.raises(RemoteError, match=r"returned an empty prompt$"):
            revise_prompts_remote(fast_endpoint(server.url), ["a red fox"], 1024, 1024, seed=0, host=host,
                                  keep_original=False)
    assert host.messages == []


def test_busy_server_is_retried_then_answers():
    with ChatServer(faults=["503"]) as server:
        host = NullHost()
        result = revise_prompts_remote(fast_endpoint(server.url), ["a red fox"], 1024, 1024, seed=3, host=host)
    assert result.prompts == ["revised: a red fox @3"] and len(server.received) == 2 and host.messages == []


def test_cut_at_the_token_cap_is_used_but_said():
    with ChatServer(faults=["length"]) as server:
        host = NullHost()
        result = revise_prompts_remote(fast_endpoint(server.url), ["a red fox"], 1024, 1024, seed=3,
                                       max_new_tokens=64, host=host)
    assert result.prompts == ["revised: a red fox @3"] and result.revisions[0].truncated
    assert "64-token cap" in host.messages[0]


def test_server_down_keeps_the_original_prompt():
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    host = NullHost()
    result = revise_prompts_remote(fast_endpoint(f"http://127.0.0.1:{port}", retry_attempts=1), ["a fox"], 1024, 1024,
                                   seed=0, host=host)
    assert result.prompts == ["a fox"] and "refused the connection" in host.messages[0]


def test_the_key_bound_to_the_pe_servers_origin_is_sent_and_never_shown(monkeypatch, keys_file):
    monkeypatch.setenv("ERNIE_PE_KEY", SECRET)
    with ChatServer(api_key=SECRET) as server:
        path = keys_file({"label": "pe", "origin": server.url, "env": "ERNIE_PE_KEY"})
        endpoint = ChatEndpoint.bound(server.url, load_credentials(), connect_timeout_s=1.0, read_timeout_s=1.0)
        host = NullHost()
        result = revise_prompts_remote(endpoint, ["a fox"], 1024, 1024, seed=0, host=host)
        assert result.prompts == ["revised: a fox @0"]
        assert server.headers[0]["Authorization"] == f"Bearer {SECRET}"
        monkeypatch.setenv("ERNIE_PE_KEY", "wrong")  # read when sent: the same endpoint now sends this one
        with pytest.raises(AuthenticationError) as refused:
            revise_prompts_remote(endpoint, ["a fox"], 1024, 1024, seed=0)
    assert str(refused.value).endswith(f"check the key of credential 'pe' (the keys file {path})")
    assert SECRET not in str(refused.value) and "wrong" not in str(refused.value)
    assert SECRET not in repr(endpoint) and "credential 'pe'" in repr(endpoint)


def test_a_key_file_named_on_the_command_line_is_read(tmp_path):
    key_file = tmp_path / "pe.key"
    key_file.write_text(SECRET + "\n")
    with ChatServer(api_key=SECRET) as server:
        credentials = Credentials.bound_to([server.url], None, str(key_file), file_flag="--pe-api-key-file")
        endpoint = ChatEndpoint.bound(server.url + "/v1", credentials, connect_timeout_s=1.0, read_timeout_s=1.0)
        result = revise_prompts_remote(endpoint, ["a fox"], 1024, 1024, seed=0)
    assert result.prompts == ["revised: a fox @0"]


def test_a_label_bound_to_another_origin_is_refused_before_anything_is_sent(monkeypatch, keys_file):
    monkeypatch.setenv("ERNIE_PE_KEY", SECRET)
    with ChatServer() as server, ChatServer() as other:
        keys_file({"label": "pe", "origin": server.url, "env": "ERNIE_PE_KEY"})
        with pytest.raises(InvalidInputError, match=rf"^pe_credential 'pe' is not bound to {other.url}: a key is "
                                                    rf"sent only to the server it is bound to; add"):
            ChatEndpoint.bound(other.url, load_credentials(), "pe")
        assert ChatEndpoint.bound(other.url, load_credentials()).credential is None, "no label: its own origin's key"
    assert other.models_asked == 0 and not other.headers


def test_missing_key_is_a_clear_error():
    with ChatServer(api_key=SECRET) as server:
        with pytest.raises(AuthenticationError, match="asks for an API key .HTTP 401.: no key is bound to it"):
            revise_prompts_remote(fast_endpoint(server.url), ["a fox"], 1024, 1024, seed=0)


def test_wrong_model_name_is_a_setting_to_fix():
    with ChatServer() as server:
        with pytest.raises(ServerRejected, match="does not exist; check the PE model name 'nope'"):
            revise_prompts_remote(fast_endpoint(server.url, model="nope"), ["a fox"], 1024, 1024, seed=0)


def test_cancel_stops_waiting_at_once(cancel_after):
    host = cancel_after(3)  # the host is asked every 0.1 s while the reply is awaited: cancelled after ~0.3 s
    with ChatServer(faults=["hang"]) as server:
        started = time.monotonic()
        with pytest.raises(Cancelled):
            revise_prompts_remote(fast_endpoint(server.url, read_timeout_s=20.0), ["a fox"], 1024, 1024, seed=0,
                                  host=host)
        assert time.monotonic() - started < PROMPTLY_S, "back at the Cancel, not at the 20 s read timeout"
    assert host.calls == 4


def test_credentials_in_the_url_are_refused():
    with pytest.raises(InvalidInputError, match="holds a user name or password") as caught:
        revise_prompts_remote(ChatEndpoint(url=f"http://user:{SECRET}@127.0.0.1:9"), ["a"], 1024, 1024, seed=0)
    assert SECRET not in str(caught.value)


def test_cli_with_a_pe_server_prints_only_the_revision(capsys):
    with ChatServer() as server:
        code = main_enhance(["--pe-url", server.url, "--prompt", "a fox", "--width", "1264", "--height", "848",
                             "--seed", "9", "--quiet"])
    captured = capsys.readouterr()
    assert code == 0 and captured.out == "revised: a fox @9\n" and captured.err == ""
    assert server.received[0]["messages"][0]["content"] == '{"prompt": "a fox", "width": 1264, "height": 848}'


def test_cli_prints_a_servers_terminal_escape_codes_escaped(capsys):
    """A remote PE's reply is a stranger's text: on a terminal, its escape codes would clear the screen or retitle
    the window."""
    with ChatServer(faults=["escapes"]) as server:
        code = main_enhance(["--pe-url", server.url, "--prompt", "a fox", "--seed", "9", "--quiet"])
    captured = capsys.readouterr()
    assert code == 0 and "\x1b" not in captured.out and "\x07" not in captured.out
    assert captured.out == "\\x1b[2J\\x1b]0;owned\\x07revised: a fox @9\\x1b[0m\n", captured.out


def test_cli_enhance_with_a_pe_server_that_is_down_fails_in_one_line(capsys):
    from ernie_image.runtime.cli.commands import main

    from fake_sglang import free_port

    url = f"http://127.0.0.1:{free_port()}"
    code = main(["enhance", "--pe-url", url, "--prompt", "a fox", "--quiet"])
    captured = capsys.readouterr()
    lines = captured.err.strip().splitlines()
    assert code == 2 and captured.out == "", "no prompt printed: the original would pass for a revision"
    assert len(lines) == 1 and lines[0].startswith("error: ") and "refused the connection" in lines[0], lines
