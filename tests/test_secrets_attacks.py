"""A shared workflow must never be able to send the user's secrets anywhere: the pack attacked as its author would.

The attacker writes the workflow: every widget and hidden input of every node, and the body and headers of every
request to the pack's routes (a web page the user visits can POST to ComfyUI on 127.0.0.1). The attacker also runs
a server: a FakeSglang on loopback that answers like SGLang and records every request exactly as it arrived
(`wire`: method, path and query, every header, the raw body).

The user's machine holds secrets, each marked with CANARY: environment variables (HF_TOKEN, HOME), files in the
home folder (a key file, a symlink to it, ~/.ssh/id_rsa), /proc/self/environ, and the keys the user bound to their
own servers in the keys file (one read from a variable, one written in the file). The attacker names each of them
in each place a workflow can name something, points it at their own server, and tries every detour: a label of the
user's for the attacker's URL, the user's own server answering a redirect to the attacker, the same host on
another port or scheme, URL tricks. Whatever happens, the attacker's server receives no secret, and every refusal
is one line naming the input and the keys file, where the user binds a key.
"""
from __future__ import annotations

import asyncio
import http.client
import json
import os
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator, Optional

import pytest
from aiohttp import web

from ernie_image.nodes.enhancer import ErnieImagePromptEnhancer
from ernie_image.nodes.remote import ErnieImageRemoteBackend
from ernie_image.nodes.routes import add_routes, check_servers
from ernie_image.nodes.sampler import ErnieImageTurboSampler
from ernie_image.runtime.core.errors import ErnieImageError

from fake_sglang import FakeSglang

CANARY = "c4n4ry"
HF_TOKEN = f"hf_{CANARY}HFTOKEN0123456789abcdef"
USER_KEY = f"sk-{CANARY}-user-sglang-0123456789"  # bound to the user's SGLang server, read from a variable
INLINE_KEY = f"sk-{CANARY}-inline-pe-9876543210"  # bound to the user's PE server, written in the keys file
FILE_KEY = f"sk-{CANARY}-file-5555555555"
SSH_KEY = (f"-----BEGIN OPENSSH PRIVATE KEY-----\nb3BlbnNzaC1rZXktdjEAAAAA{CANARY}IDRSA\n"
           f"-----END OPENSSH PRIVATE KEY-----\n")
USER_KEY_VAR = "ERNIE_USER_SGLANG_KEY"
KEYS = (HF_TOKEN, USER_KEY, INLINE_KEY, FILE_KEY, f"b3BlbnNzaC1rZXktdjEAAAAA{CANARY}IDRSA")

# What a workflow names, by how it names it. The label "legit" is the user's own, bound to the user's server.
SOURCES = {
    "variable HF_TOKEN": "HF_TOKEN",
    "variable HOME": "HOME",
    "the variable the user's key is in": USER_KEY_VAR,
    "~/secret.key": "~/secret.key",
    "absolute path of a key file": "{home}/secret.key",
    "symlink to a key file": "{home}/link.key",
    "~/.ssh/id_rsa": "~/.ssh/id_rsa",
    "/proc/self/environ": "/proc/self/environ",
    "the keys file itself": "{keys_file}",
    "the user's label for their server": "legit",
    "the user's label for their PE server": "legit-pe",
}


# ----------------------------------------------------------------------------------------------- the machine
@dataclass
class Machine:
    """The user's machine with secrets planted, their two servers bound in the keys file, and the attacker's server."""

    home: Path
    keys_file: Path
    legit: FakeSglang  # the user's SGLang server, bound as "legit" (key from USER_KEY_VAR)
    legit_pe: FakeSglang  # the user's PE server, bound as "legit-pe" (key written in the keys file)
    attacker: FakeSglang
    write_keys: Callable[..., Path]
    routes_url: str = ""  # the pack's routes served by aiohttp, as ComfyUI serves them
    environ: list[str] = field(default_factory=list)

    def name_of(self, source: str) -> str:
        return SOURCES[source].format(home=self.home, keys_file=self.keys_file)

    def bind(self, *extra: dict[str, Any]) -> None:
        """The user's keys file: their two servers, and `extra` entries."""
        self.keys_file = self.write_keys({"label": "legit", "origin": self.legit.url, "env": USER_KEY_VAR},
                                         {"label": "legit-pe", "origin": self.legit_pe.url, "key": INLINE_KEY},
                                         *extra)

    def secrets(self) -> tuple[str, ...]:
        """Everything the attacker must never learn: every key, HOME, /proc/self/environ's entries."""
        return (*KEYS, str(self.home), *self.environ)

    def leaks(self, server: FakeSglang) -> list[str]:
        found = []
        for request in server.wire:
            text = request.text()
            found += [f"{request.method} {request.path_qs}: {secret[:24]}..." for secret in self.secrets()
                      if secret in text]
            if CANARY in text:
                found.append(f"{request.method} {request.path_qs}: {CANARY}")
        return found

    def assert_attacker_learnt_nothing(self) -> None:
        assert self.leaks(self.attacker) == []
        assert not [r for r in self.attacker.wire if any(name.lower() == "authorization" for name, _ in r.headers)], \
            "no key of any kind went to the attacker"

    def assert_attacker_got_nothing(self) -> None:
        assert self.attacker.wire == [], [f"{r.method} {r.path_qs}" for r in self.attacker.wire]


def environ_entries() -> list[str]:
    """The entries of /proc/self/environ (NAME=value) long enough not to occur by chance."""
    try:
        raw = Path("/proc/self/environ").read_bytes()
    except OSError:
        return []
    return [entry.decode("utf-8", "replace") for entry in raw.split(b"\0") if b"=" in entry and len(entry) >= 12]


@pytest.fixture(scope="module")
def routes_url() -> Iterator[str]:
    """The pack's routes (add_routes) on a real aiohttp server on loopback, as ComfyUI's PromptServer serves them."""
    loop_ready = threading.Event()
    state: dict[str, Any] = {}

    def serve() -> None:
        loop = asyncio.new_event_loop()
        asyncio.set_event_loop(loop)
        routes = web.RouteTableDef()
        add_routes(routes)
        app = web.Application()
        app.add_routes(routes)
        runner = web.AppRunner(app, handle_signals=False)
        loop.run_until_complete(runner.setup())
        site = web.TCPSite(runner, "127.0.0.1", 0)
        loop.run_until_complete(site.start())
        port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        state.update(loop=loop, runner=runner, port=port)
        loop_ready.set()
        loop.run_forever()

    thread = threading.Thread(target=serve, name="comfy-routes", daemon=True)
    thread.start()
    assert loop_ready.wait(10)
    yield f"127.0.0.1:{state['port']}"
    asyncio.run_coroutine_threadsafe(state["runner"].cleanup(), state["loop"]).result(10)
    state["loop"].call_soon_threadsafe(state["loop"].stop)
    thread.join(10)


@pytest.fixture
def machine(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, keys_file: Callable[..., Path],
            routes_url: str) -> Iterator[Machine]:
    home = tmp_path / f"home-{CANARY}"
    (home / ".ssh").mkdir(parents=True)
    (home / "secret.key").write_text(FILE_KEY + "\n")
    (home / "link.key").symlink_to(home / "secret.key")
    (home / ".ssh" / "id_rsa").write_text(SSH_KEY)
    os.chmod(home / ".ssh" / "id_rsa", 0o600)
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.setenv("HF_TOKEN", HF_TOKEN)
    monkeypatch.setenv(USER_KEY_VAR, USER_KEY)
    with FakeSglang(api_key=USER_KEY, image_side_cap=32) as legit, \
            FakeSglang(api_key=INLINE_KEY, image_side_cap=32) as legit_pe, \
            FakeSglang(image_side_cap=32) as attacker:
        planted = Machine(home, Path(), legit, legit_pe, attacker, keys_file, routes_url, environ_entries())
        planted.bind()
        yield planted
    planted.assert_attacker_learnt_nothing()  # again once every connection is closed: nothing arrived late


# ------------------------------------------------------------------------------------------- driving a surface
def one_line(message: str, *named: str) -> str:
    assert "\n" not in message and "\r" not in message, f"not one line: {message!r}"
    for part in named:
        assert part in message, f"{part!r} not named in: {message}"
    for key in KEYS:
        assert key not in message, f"a key is shown: {message}"
    return message


def sample(pipe: Any, use_pe: bool = False, batch: int = 1) -> str:
    """A Turbo Sampler run on the pipe (what the workflow does next); the prompt it used."""
    try:
        _, _, prompt_used = ErnieImageTurboSampler().generate(
            pipe=pipe, prompt="a fox", resolution="custom", width=256, height=256, steps=1, cfg=1.0, seed=0,
            batch_size=batch, shift=4.0, use_pe=use_pe)["result"]
        return prompt_used
    finally:
        pipe.release()


def backend(machine: Machine, run: bool = True, use_pe: bool = False, batch: int = 1, **inputs: Any) -> Optional[str]:
    """The Remote Backend node with the workflow's inputs, then a Sampler on its pipe; the refusal, or None."""
    values = dict(server_urls=machine.attacker.url, connect_timeout_s=1.0, read_timeout_s=30.0, wait_for_servers_s=0.0)
    values.update(inputs)
    try:
        pipe = ErnieImageRemoteBackend().connect(**values)["result"][0]
        if run:
            sample(pipe, use_pe=use_pe, batch=batch)
    except ErnieImageError as error:
        return str(error)
    return None


def enhancer(machine: Machine, **inputs: Any) -> Optional[str]:
    try:
        ErnieImagePromptEnhancer().enhance(prompt="a fox", resolution="custom", width=256, height=256, seed=0,
                                           temperature=0.6, top_p=0.95, max_new_tokens=16, **inputs)
    except ErnieImageError as error:
        return str(error)
    return None


def route_function(body: dict[str, Any]) -> Optional[str]:
    try:
        check_servers(body)
    except ErnieImageError as error:
        return str(error)
    return None


@dataclass
class Answer:
    status: int
    body: Any

    @property
    def error(self) -> Optional[str]:
        return self.body.get("error") if self.status != 200 and isinstance(self.body, dict) else None


def post(machine: Machine, body: Any, *, path: str = "/ernie_image/test_connection",
         content_type: str = "application/json", headers: Optional[dict[str, str]] = None,
         method: str = "POST") -> Answer:
    """A POST (or `method`) to the pack's route over HTTP, by default as ComfyUI's own page sends it (same origin)."""
    data = None if body is None else body if isinstance(body, (bytes, str)) else json.dumps(body)
    sent = {"Content-Type": content_type, "Origin": f"http://{machine.routes_url}", "Sec-Fetch-Site": "same-origin"}
    sent.update(headers or {})
    connection = http.client.HTTPConnection(machine.routes_url, timeout=30)
    try:
        connection.request(method, path, body=data, headers={k: v for k, v in sent.items() if v is not None})
        response = connection.getresponse()
        raw = response.read()
    finally:
        connection.close()
    return Answer(response.status, json.loads(raw) if raw.strip().startswith(b"{") else raw.decode())


def route_http(machine: Machine, body: dict[str, Any]) -> Optional[str]:
    answer = post(machine, body)
    return answer.error


@dataclass(frozen=True)
class Surface:
    """A place a workflow names something, driven with the attacker's URL; `named`: what its refusal must name."""

    attack: Callable[[Machine, str], Optional[str]]
    named: str


NAMING_SURFACES = {
    "Remote Backend credential": Surface(lambda m, name: backend(m, credential=name), "credential"),
    "Remote Backend pe_credential": Surface(
        lambda m, name: backend(m, server_urls=m.legit.url, pe_url=m.attacker.url, pe_credential=name, use_pe=True),
        "pe_credential"),
    "Remote Backend api_key_env (hidden, legacy)": Surface(lambda m, name: backend(m, api_key_env=name),
                                                           "api_key_env"),
    "Remote Backend api_key_file (hidden, legacy)": Surface(lambda m, name: backend(m, api_key_file=name),
                                                            "api_key_file"),
    "Remote Backend pe_api_key_env (hidden, legacy)": Surface(
        lambda m, name: backend(m, server_urls=m.legit.url, pe_url=m.attacker.url, pe_api_key_env=name, use_pe=True),
        "pe_api_key_env"),
    "Remote Backend pe_api_key_file (hidden, legacy)": Surface(
        lambda m, name: backend(m, server_urls=m.legit.url, pe_url=m.attacker.url, pe_api_key_file=name, use_pe=True),
        "pe_api_key_file"),
    "Prompt Enhancer pe_credential": Surface(lambda m, name: enhancer(m, pe_url=m.attacker.url, pe_credential=name),
                                             "pe_credential"),
    "Prompt Enhancer pe_api_key_env (hidden, legacy)": Surface(
        lambda m, name: enhancer(m, pe_url=m.attacker.url, pe_api_key_env=name), "pe_api_key_env"),
    "Prompt Enhancer pe_api_key_file (hidden, legacy)": Surface(
        lambda m, name: enhancer(m, pe_url=m.attacker.url, pe_api_key_file=name), "pe_api_key_file"),
    "check_servers credential": Surface(
        lambda m, name: route_function({"server_urls": m.attacker.url, "credential": name}), "credential"),
    "check_servers api_key_env": Surface(
        lambda m, name: route_function({"server_urls": m.attacker.url, "api_key_env": name}), "'api_key_env'"),
    "check_servers api_key_file": Surface(
        lambda m, name: route_function({"server_urls": m.attacker.url, "api_key_file": name}), "'api_key_file'"),
    "POST test_connection credential": Surface(
        lambda m, name: route_http(m, {"server_urls": m.attacker.url, "credential": name}), "credential"),
    "POST test_connection api_key_env": Surface(
        lambda m, name: route_http(m, {"server_urls": m.attacker.url, "api_key_env": name, "credential": ""}),
        "'api_key_env'"),
    "POST test_connection api_key_file": Surface(
        lambda m, name: route_http(m, {"server_urls": m.attacker.url, "api_key_file": name}), "'api_key_file'"),
}

# the surfaces that take a credential's label for a URL the workflow gives
LABEL_SURFACES = {
    "Remote Backend credential": lambda m, url, label: backend(m, server_urls=url, credential=label),
    "Remote Backend pe_credential": lambda m, url, label: backend(m, server_urls=m.legit.url, pe_url=url,
                                                                  pe_credential=label, use_pe=True),
    "Prompt Enhancer pe_credential": lambda m, url, label: enhancer(m, pe_url=url, pe_credential=label),
    "check_servers credential": lambda m, url, label: route_function({"server_urls": url, "credential": label}),
    "POST test_connection credential": lambda m, url, label: route_http(m, {"server_urls": url, "credential": label}),
}


# ------------------------------------------------------------------------------------------------- the attacks
class TestAWorkflowNamingAnySecretIsRefusedBeforeAnythingIsSent:
    """Every name a workflow can give (a variable, a path, a symlink, /proc, the user's own labels), in every place
    it can give one, for the attacker's URL: refused in one line naming the input and the keys file, and the
    attacker's server is not even asked."""

    @pytest.mark.parametrize("source", SOURCES)
    @pytest.mark.parametrize("surface", NAMING_SURFACES)
    def test_refused_in_one_line_and_the_attacker_gets_nothing(self, machine: Machine, surface: str,
                                                               source: str) -> None:
        refusal = NAMING_SURFACES[surface].attack(machine, machine.name_of(source))
        assert refusal is not None, "the workflow's choice was taken"
        one_line(refusal, NAMING_SURFACES[surface].named, "keys file")
        machine.assert_attacker_got_nothing()


class TestTheUsersLabelGoesOnlyToTheOriginItIsBoundTo:
    """The user's label "legit" is bound to http://127.0.0.1:<legit port>. A workflow asking for it with any other
    origin (the attacker's port on the same host, another scheme, another name for the same machine) is refused;
    a key bound to https is never sent over plain http to the same host and port."""

    VARIANTS = {
        "the attacker's port on the same host": lambda m: m.attacker.url,
        "https to the same host and port": lambda m: m.legit.url.replace("http://", "https://"),
        "another name for the same machine": lambda m: m.legit.url.replace("127.0.0.1", "localhost"),
        "IPv6 loopback, same port": lambda m: f"http://[::1]:{m.legit.port}",
        "the legit URL with a path into the attacker's": lambda m: f"{m.attacker.url}/{m.legit.url}",
    }

    @pytest.mark.parametrize("variant", VARIANTS)
    @pytest.mark.parametrize("surface", LABEL_SURFACES)
    def test_another_origin_is_refused_naming_how_to_bind_one(self, machine: Machine, surface: str,
                                                               variant: str) -> None:
        url = self.VARIANTS[variant](machine)
        label = "legit-pe" if "pe_credential" in surface else "legit"
        refusal = LABEL_SURFACES[surface](machine, url, label)
        assert refusal is not None
        one_line(refusal, f"'{label}' is not bound to", "a key is sent only to the server it is bound to",
                 "keys file")
        machine.assert_attacker_got_nothing()

    @pytest.mark.parametrize("surface", LABEL_SURFACES)
    def test_a_key_bound_to_https_is_never_sent_over_http_to_the_same_host_and_port(self, machine: Machine,
                                                                                    surface: str) -> None:
        machine.bind({"label": "tls", "origin": machine.attacker.url.replace("http://", "https://"),
                      "file": "~/secret.key"})
        refusal = LABEL_SURFACES[surface](machine, machine.attacker.url, "tls")
        assert refusal is not None
        one_line(refusal, "'tls' is not bound to", "keys file")
        machine.assert_attacker_got_nothing()
        LABEL_SURFACES[surface](machine, machine.attacker.url, "")  # no label: the http origin has no key
        assert machine.attacker.wire, "the attack reached the attacker's server"
        machine.assert_attacker_learnt_nothing()

    TRICKS = {
        "user info naming the legit host": lambda m: f"http://127.0.0.1:{m.legit.port}@127.0.0.1:{m.attacker.port}",
        "backslash before user info": lambda m: f"http://127.0.0.1:{m.attacker.port}\\@127.0.0.1:{m.legit.port}",
        "fragment before user info": lambda m: f"http://127.0.0.1:{m.attacker.port}#@127.0.0.1:{m.legit.port}",
        "query naming the legit host": lambda m: f"http://127.0.0.1:{m.attacker.port}?127.0.0.1:{m.legit.port}",
        "a tab inside the host": lambda m: f"http://127.0.0.1:{m.legit.port}\t.127.0.0.1:{m.attacker.port}",
    }

    @pytest.mark.parametrize("trick", TRICKS)
    @pytest.mark.parametrize("surface", LABEL_SURFACES)
    def test_url_tricks_send_nothing_anywhere(self, machine: Machine, surface: str, trick: str) -> None:
        url = self.TRICKS[trick](machine)
        refusal = LABEL_SURFACES[surface](machine, url, "legit-pe" if "pe_credential" in surface else "legit")
        if refusal is not None:
            one_line(refusal)
        else:  # the routes answer a malformed URL with its row's error
            assert surface.startswith(("check_servers", "POST"))
        machine.assert_attacker_got_nothing()
        assert machine.legit.wire == [] and machine.legit_pe.wire == []


    NODE_URL_INPUTS = {
        "Remote Backend server_urls": lambda m, url: backend(m, server_urls=url),
        "Remote Backend pe_url": lambda m, url: backend(m, server_urls=m.legit.url, pe_url=url, use_pe=True),
        "Prompt Enhancer pe_url": lambda m, url: enhancer(m, pe_url=url),
    }

    @pytest.mark.parametrize("carried", ["a password", "a token in the query"])
    @pytest.mark.parametrize("surface", NODE_URL_INPUTS)
    def test_a_url_carrying_a_key_is_refused_naming_the_keys_file(self, machine: Machine, surface: str,
                                                                  carried: str) -> None:
        """BUG: a URL that reaches connect()/enhance() through a link (VALIDATE_INPUTS sees None for a link) is refused
        by runtime/net/urls.py normalize_base_url with advice from before the keys file: "use an API key
        environment variable or key file" / "a token belongs in an API key environment variable or key file", which
        no workflow can name any more. Fix: say "bind the server's API key in your keys file (the CLI: --api-key-env
        or --api-key-file)" in both messages."""
        url = (f"http://user:{USER_KEY}@127.0.0.1:{machine.attacker.port}" if carried == "a password"
               else f"{machine.attacker.url}/?api_key={USER_KEY}")
        refusal = self.NODE_URL_INPUTS[surface](machine, url)
        assert refusal is not None
        one_line(refusal, "keys file")
        machine.assert_attacker_got_nothing()


class TestAServerTheWorkflowAddsGetsNoKey:
    """Left empty, a credential means each server gets the key bound to its own origin: a server the workflow adds
    gets none, beside the user's own server that gets its own. These requests do reach the attacker; none carries
    a key or any secret."""

    def test_a_fleet_of_the_users_server_and_the_attackers(self, machine: Machine) -> None:
        assert backend(machine, server_urls=f"{machine.legit.url}\n{machine.attacker.url}", batch=4) is None
        assert machine.attacker.generations and machine.legit.generations, "the batch went to both"
        assert {dict(r.headers).get("Authorization") for r in machine.legit.wire} == {f"Bearer {USER_KEY}"}
        machine.assert_attacker_learnt_nothing()

    def test_an_attackers_server_asking_for_a_key_is_told_none_and_the_user_how_to_bind_one(self,
                                                                                            machine: Machine) -> None:
        machine.attacker.api_key = "whatever-it-asks-for"
        refusal = backend(machine)
        assert refusal is not None
        one_line(refusal, f"{machine.attacker.url} asks for an API key (HTTP 401): no key is bound to it: add",
                 f'"origin": "{machine.attacker.url}"', f"to the keys file {machine.keys_file}")
        assert machine.attacker.wire, "the attacker's server was asked"
        machine.assert_attacker_learnt_nothing()

    def test_a_pe_endpoint_of_the_attackers_beside_the_users_server(self, machine: Machine) -> None:
        refusal = backend(machine, server_urls=machine.legit.url, pe_url=machine.attacker.url, use_pe=True)
        assert refusal is not None and one_line(refusal).startswith("remote prompt enhancer: "), "its 404 is said"
        assert any(r.path_qs == "/v1/chat/completions" for r in machine.attacker.wire), "the PE was asked"
        machine.assert_attacker_learnt_nothing()

    def test_the_prompt_enhancer_node(self, machine: Machine) -> None:
        assert one_line(enhancer(machine, pe_url=machine.attacker.url) or "").startswith("remote prompt enhancer: ")
        assert any(r.path_qs == "/v1/chat/completions" for r in machine.attacker.wire)
        machine.assert_attacker_learnt_nothing()

    def test_check_servers(self, machine: Machine) -> None:
        result = check_servers({"server_urls": f"{machine.legit.url}\n{machine.attacker.url}"})
        assert [row["ok"] for row in result["servers"]] == [True, True]
        assert {dict(r.headers).get("Authorization") for r in machine.legit.wire} == {f"Bearer {USER_KEY}"}
        machine.assert_attacker_learnt_nothing()

    @pytest.mark.parametrize("origin", ["own page", "no browser", "rebound name"])
    def test_the_test_connection_route(self, machine: Machine, origin: str) -> None:
        """As ComfyUI's page sends it, as a script does (no Origin), and from a name the attacker's DNS points at
        127.0.0.1 (Origin equals Host: allowed, as it is ComfyUI's own page to the browser)."""
        headers: dict[str, Optional[str]] = {
            "own page": {},
            "no browser": {"Origin": None, "Sec-Fetch-Site": None},
            "rebound name": {"Origin": f"http://rebound.example:{machine.routes_url.split(':')[1]}",
                             "Host": f"rebound.example:{machine.routes_url.split(':')[1]}"},
        }[origin]
        answer = post(machine, {"server_urls": f"{machine.legit.url}\n{machine.attacker.url}"}, headers=headers)
        assert answer.status == 200 and [row["ok"] for row in answer.body["servers"]] == [True, True]
        assert {dict(r.headers).get("Authorization") for r in machine.legit.wire} == {f"Bearer {USER_KEY}"}
        machine.assert_attacker_learnt_nothing()
        assert CANARY not in json.dumps(answer.body), "nor does the page that asked"
        refused = post(machine, {"server_urls": machine.attacker.url, "credential": "legit"}, headers=headers)
        assert refused.status == 400 and "'legit' is not bound to" in one_line(refused.error, "keys file")


class TestTheUsersServerRedirectingToTheAttackerNeverForwardsTheKey:
    """The user's own server (or a proxy in front of it) answers a redirect to the attacker's: the key went to the
    server it is bound to, and nothing goes to the attacker, as no redirect is ever followed."""

    STATUSES = [301, 302, 303, 307, 308]

    @pytest.mark.parametrize("path", [None, "/v1/images/generations"], ids=["every path", "the generation POST"])
    @pytest.mark.parametrize("status", STATUSES)
    def test_the_remote_backend_and_sampler(self, machine: Machine, status: int, path: Optional[str]) -> None:
        machine.legit.redirect_to, machine.legit.redirect_status, machine.legit.redirect_path = (
            machine.attacker.url, status, path)
        refusal = backend(machine, server_urls=machine.legit.url, credential="legit")
        assert refusal is not None
        one_line(refusal, f"{machine.legit.url} redirected", f"to {machine.attacker.url}", f"(HTTP {status}); "
                 f"redirects are not followed: use the final server URL")
        machine.assert_attacker_got_nothing()
        assert {dict(r.headers).get("Authorization") for r in machine.legit.wire} == {f"Bearer {USER_KEY}"}

    @pytest.mark.parametrize("status", STATUSES)
    def test_test_connection(self, machine: Machine, status: int) -> None:
        machine.legit.redirect_to, machine.legit.redirect_status = machine.attacker.url, status
        answer = post(machine, {"server_urls": machine.legit.url, "credential": "legit"})
        assert answer.status == 200 and not answer.body["ok"]
        assert f"HTTP {status}" in answer.body["text"] and "redirect" in answer.body["text"]
        machine.assert_attacker_got_nothing()

    @pytest.mark.parametrize("path", [None, "/v1/chat/completions"], ids=["every path", "the chat POST"])
    @pytest.mark.parametrize("status", STATUSES)
    def test_the_prompt_enhancer_node(self, machine: Machine, status: int, path: Optional[str]) -> None:
        machine.legit_pe.redirect_to, machine.legit_pe.redirect_status, machine.legit_pe.redirect_path = (
            machine.attacker.url, status, path)
        enhancer(machine, pe_url=machine.legit_pe.url, pe_credential="legit-pe")
        assert machine.legit_pe.wire, "the user's PE server was asked"
        assert {dict(r.headers).get("Authorization") for r in machine.legit_pe.wire} == {f"Bearer {INLINE_KEY}"}
        machine.assert_attacker_got_nothing()


class TestAForeignPageCannotDriveTheRoutes:
    """Any web page the user visits can POST to ComfyUI on 127.0.0.1: a request from another origin, one a browser
    marks cross-site, or one that is not JSON (a form or text/plain POST skips the browser's preflight) is refused
    before anything runs, and the attacker's server is not asked."""

    REQUESTS: dict[str, dict[str, Any]] = {
        "another origin": dict(headers={"Origin": "http://evil.example"}),
        "an opaque origin": dict(headers={"Origin": "null"}),
        "another port of the same host": dict(headers={"Origin": "http://127.0.0.1:1"}),
        "cross-site": dict(headers={"Origin": None, "Sec-Fetch-Site": "cross-site"}),
        "same-site, another origin": dict(headers={"Origin": None, "Sec-Fetch-Site": "same-site"}),
        "text/plain": dict(content_type="text/plain"),
        "a form": dict(content_type="application/x-www-form-urlencoded", form=True),
        "multipart": dict(content_type="multipart/form-data; boundary=x", form=True),
    }
    STATUS = {"text/plain": 415, "a form": 415, "multipart": 415}

    @pytest.mark.parametrize("fields", [{}, {"credential": "legit"}, {"api_key_env": "HF_TOKEN"},
                                        {"api_key_file": "~/.ssh/id_rsa"}], ids=["no key", "label", "env", "file"])
    @pytest.mark.parametrize("request_kind", REQUESTS)
    def test_refused_before_anything_runs(self, machine: Machine, request_kind: str, fields: dict[str, str]) -> None:
        spec = self.REQUESTS[request_kind]
        body: Any = {"server_urls": machine.attacker.url, **fields}
        if spec.get("form"):
            body = "&".join(f"{name}={value}" for name, value in body.items())
        answer = post(machine, body, content_type=spec.get("content_type", "application/json"),
                      headers=spec.get("headers"))
        assert answer.status == self.STATUS.get(request_kind, 403)
        one_line(answer.error)
        assert ("ComfyUI's own page only" in answer.error) == (answer.status == 403)
        machine.assert_attacker_got_nothing()

    def test_free_is_refused_from_another_origin(self, machine: Machine) -> None:
        answer = post(machine, {}, path="/ernie_image/free", headers={"Origin": "http://evil.example"})
        assert answer.status == 403 and "ComfyUI's own page only" in one_line(answer.error)

    @pytest.mark.parametrize("request_kind", ["another origin", "an opaque origin", "another port of the same host",
                                              "cross-site", "same-site, another origin"])
    def test_the_memory_route_is_refused_to_another_page(self, machine: Machine, request_kind: str) -> None:
        """A no-cors GET from any page reaches the route: its plans name servers and its heap walk is slow."""
        for query in ("", "?holders=1"):
            answer = post(machine, None, path=f"/ernie_image/memory{query}", method="GET",
                          headers=self.REQUESTS[request_kind]["headers"])
            assert answer.status == 403 and "ComfyUI's own page only" in one_line(answer.error)

    def test_the_memory_routes_heap_walks_are_rationed(self, machine: Machine, monkeypatch) -> None:
        from ernie_image.nodes import live_pipes, routes
        from ernie_image.nodes.heap_holders import HolderWalks

        walks = HolderWalks()
        walks.QUIET_FACTOR = 1e9  # after one walk, none for the rest of the test
        walked: list[int] = []
        monkeypatch.setattr(routes, "HOLDER_WALKS", walks)
        monkeypatch.setattr(live_pipes, "orphan_holders", lambda pipes: walked.append(1) or ["held"])
        answers = [post(machine, None, path="/ernie_image/memory?holders=1", method="GET") for _ in range(3)]
        assert [a.status for a in answers] == [200] * 3 and len(walked) == 1
        assert all(a.body["orphaned_weights_held_by"] == ["held"] for a in answers)
        assert "holders_walked_s_ago" in answers[-1].body

    @pytest.mark.parametrize("body", [["server_urls"], "not json", {"server_urls": 5, "x": 1}],
                             ids=["array", "text", "unknown field"])
    def test_a_same_origin_body_that_is_not_the_expected_object_is_400(self, machine: Machine, body: Any) -> None:
        answer = post(machine, body)
        assert answer.status == 400 and one_line(answer.error)
        machine.assert_attacker_got_nothing()
