"""No surface ever shows a password put in a server URL or an API key: errors, check-remote's table, the
Test-connection route's JSON, result info, notices, logs and the PNG text metadata the CLI writes.

Every surface is driven with `http://user:s3cret@...` URLs (and a query token) and with a real API key that the
loopback servers require; everything a user could see is collected and searched for the secrets.
"""
from __future__ import annotations

import json
import logging

import pytest
from PIL import Image

from ernie_image.nodes.remote import ErnieImageRemoteBackend
from ernie_image.nodes.routes import check_servers
from ernie_image.runtime.cli.commands import main
from ernie_image.runtime.core.errors import ErnieImageError
from ernie_image.runtime.core.host import NullHost
from ernie_image.runtime.core.request import GenerationRequest
from ernie_image.runtime.net.credentials import Credentials, load_credentials
from ernie_image.runtime.remote.backend import RemotePipe, RemoteSettings
from ernie_image.runtime.text.remote_enhancer import ChatEndpoint, revise_prompts_remote

from fake_sglang import FakeSglang, dead_url
from test_enhancer_remote import ChatServer

PASSWORD = "s3cret"
API_KEY = "sk-live-k3y-0123456789abcdef"
KEY_VAR = "ERNIE_TEST_SECRET_KEY"
SECRETS = (PASSWORD, API_KEY, API_KEY[:8], "user:")


class Seen:
    """Everything a user could read, gathered from every surface."""

    def __init__(self) -> None:
        self.texts: list[str] = []

    def add(self, *texts: object) -> None:
        self.texts.extend(str(text) for text in texts)

    def error(self, call, *args, **kwargs) -> str:
        with pytest.raises(ErnieImageError) as caught:
            call(*args, **kwargs)
        self.add(caught.value)
        return str(caught.value)

    def assert_clean(self) -> None:
        everything = "\n".join(self.texts)
        for secret in SECRETS:
            assert secret not in everything, f"{secret!r} shown: {everything[everything.find(secret) - 80:][:200]}"


@pytest.fixture
def seen(caplog, capsys):
    caplog.set_level(logging.DEBUG)
    gathered = Seen()
    yield gathered
    captured = capsys.readouterr()
    gathered.add(captured.out, captured.err, caplog.text)
    gathered.assert_clean()


def credential_urls(port: int) -> list[str]:
    return [f"http://user:{PASSWORD}@127.0.0.1:{port}", f"user:{PASSWORD}@127.0.0.1:{port}",
            f"http://127.0.0.1:{port}/?token={PASSWORD}", f"http://user:{PASSWORD}@127.0.0.1:99999",
            f"ftp://user:{PASSWORD}@127.0.0.1:{port}"]


def test_a_password_in_a_url_appears_on_no_surface(seen, tmp_path):
    with FakeSglang() as server:
        for url in credential_urls(server.port):
            seen.error(RemotePipe, [url])
            seen.error(RemotePipe, [server.url], RemoteSettings(pe_endpoint=ChatEndpoint(url=url)))
            seen.error(ErnieImageRemoteBackend().connect, server_urls=url, connect_timeout_s=1.0,
                       read_timeout_s=30.0)
            seen.error(ErnieImageRemoteBackend().connect, server_urls=server.url, connect_timeout_s=1.0,
                       read_timeout_s=30.0, pe_url=url)
            seen.add(ErnieImageRemoteBackend.VALIDATE_INPUTS(server_urls=url, pe_url=url))
            seen.error(revise_prompts_remote, ChatEndpoint(url=url), ["a"], 1024, 1024, seed=0)
            route = check_servers({"server_urls": f"{url}\n{server.url}", "connect_timeout_s": 1})
            seen.add(json.dumps(route))
            assert route["servers"][0]["status"] == "bad URL" and route["servers"][1]["ok"]
            assert main(["check-remote", url, server.url, "--no-generate"]) == 2  # a malformed URL: usage error
            assert main(["generate", "--server", url, "--out", str(tmp_path / "x.png")]) == 2
            assert main(["generate", "--server", server.url, "--pe-url", url, "--out", str(tmp_path / "x.png")]) == 2
            assert main(["enhance", "--pe-url", url, "--prompt", "a fox"]) == 2
        assert server.generations == []


def test_an_api_key_appears_on_no_surface(seen, monkeypatch, tmp_path, keys_file):
    monkeypatch.setenv(KEY_VAR, API_KEY)
    key_file = tmp_path / "server.key"
    key_file.write_text(API_KEY + "\n")
    with FakeSglang(api_key=API_KEY) as server, ChatServer(api_key=API_KEY) as chat:
        keys_file({"label": "sglang", "origin": server.url, "env": KEY_VAR},
                  {"label": "pe", "origin": chat.url, "file": str(key_file)})
        # a generation through the pipe: result info, notices, describe, repr (one dead server for failure notices)
        host = NullHost()
        pipe = RemotePipe([server.url, dead_url()], RemoteSettings(
            probe_every_s=0.05, pe_endpoint=ChatEndpoint.bound(chat.url, load_credentials(), "pe")))
        result = pipe.generate(GenerationRequest(prompt="a fox", width=256, height=256, steps=8, cfg=1.0, batch=2,
                                                 use_pe=True), host)
        seen.add(result.info, result.prompts_used, host.messages, pipe.describe(), repr(pipe), repr(pipe.settings))
        pipe.release()
        assert all(g.headers["Authorization"] == f"Bearer {API_KEY}" for g in server.generations)

        # the CLI: PNG text metadata, its output, check-remote's table
        out = tmp_path / "fox.png"
        assert main(["generate", "--server", server.url, "--api-key-env", KEY_VAR, "--pe-url", chat.url,
                     "--pe-api-key-file", str(key_file), "--use-pe", "--width", "256", "--height", "256",
                     "--batch", "2", "--out", str(out)]) == 0
        for path in (tmp_path / "fox_0.png", tmp_path / "fox_1.png"):
            with Image.open(path) as image:
                seen.add(image.text, image.info)
        assert main(["check-remote", server.url, "--api-key-file", str(key_file)]) == 0
        assert main(["check-remote", server.url]) == 0, "the keys file binds the key"
        checked = check_servers({"server_urls": server.url, "credential": "sglang"})
        seen.add(json.dumps(checked))
        assert checked["ok"]

        # refused keys and a key pasted where its variable's name belongs
        monkeypatch.setenv(KEY_VAR, API_KEY + "-wrong")
        wrong = RemotePipe([server.url], RemoteSettings())
        refused = seen.error(wrong.generate, GenerationRequest(prompt="x", width=256, height=256), NullHost())
        assert "HTTP 403" in refused
        wrong.release()
        seen.add(json.dumps(check_servers({"server_urls": server.url})))
        assert main(["check-remote", server.url, "--api-key-env", KEY_VAR]) == 1
        seen.error(Credentials.bound_to, [server.url], API_KEY)
        assert main(["generate", "--server", server.url, "--api-key-env", API_KEY, "--out", str(out)]) == 2
        monkeypatch.delenv(KEY_VAR)
        seen.error(ErnieImageRemoteBackend().connect, server_urls=server.url, connect_timeout_s=1.0,
                   read_timeout_s=30.0, api_key_env=API_KEY, api_key_file="")
        seen.error(ErnieImageRemoteBackend().connect, server_urls=server.url, connect_timeout_s=1.0,
                   read_timeout_s=30.0, pe_url=chat.url, pe_api_key_file=API_KEY)
        seen.error(check_servers, {"server_urls": server.url, "api_key_env": API_KEY})

        # a key pasted into the keys file where a variable's name or a path belongs
        keys_file({"label": "sglang", "origin": server.url, "env": API_KEY},
                  {"label": "pe", "origin": chat.url, "file": API_KEY})
        seen.error(RemotePipe, [server.url])
        seen.error(ChatEndpoint.bound, chat.url, load_credentials())
        seen.error(check_servers, {"server_urls": server.url})
        assert main(["check-remote", server.url]) == 2


@pytest.mark.parametrize("surface", ["credential", "pe_credential", "route"])
def test_a_key_pasted_where_a_credential_label_belongs_is_never_shown(keys_file, surface):
    """BUG: a label no credential has is echoed in the refusal ("credential names 'sk-live-...', which no credential
    of yours is labelled"), so a key pasted into the credential widget (as users pasted keys into api_key_env, whose
    refusal never showed them) lands in the node's error, ComfyUI's log and /history. Credentials._labelled shows
    any printable label of up to 64 characters; it should show none (or list the labels the keys file binds to
    that origin instead, which are the user's own and no secret)."""
    seen = Seen()
    with FakeSglang(api_key=API_KEY) as server, ChatServer(api_key=API_KEY) as chat:
        keys_file({"label": "sglang", "origin": server.url, "env": KEY_VAR})
        if surface == "route":
            message = seen.error(check_servers, {"server_urls": server.url, "credential": API_KEY})
        else:
            message = seen.error(ErnieImageRemoteBackend().connect, server_urls=server.url, connect_timeout_s=1.0,
                                 read_timeout_s=30.0, pe_url=chat.url, **{surface: API_KEY})
        setting = surface.replace("route", "credential")
        assert message.startswith(f"{setting} is not the label of any credential of yours ") and "keys file" in message
    assert server.wire == [] and not chat.headers
    seen.assert_clean()
