"""A shared workflow cannot send the user's secrets anywhere: attacked through a real ComfyUI's headless API.

The user's machine holds secrets (a variable in ComfyUI's environment, a key file, a credential bound to their own
server in the keys file <base>/user/ernie_image/keys.json). The attacker writes the workflow and runs a server of
their own that records every request. Every way a workflow or a web page can name a key source or a server is
tried; the attacker's server must receive no secret, the run must stop in one line saying how to bind a key, and
no secret may reach /history, the queue or ComfyUI's log. The user's own bound server gets its key.

Needs ERNIE_COMFYUI_DIR / ERNIE_COMFYUI_PYTHON, as the other ComfyUI suites.
"""
from __future__ import annotations

import json
import re
import struct
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from comfyui_server import (COMFYUI_SUITE, COMFY_PYTHON, Server, api_workflow, base_directory, free_port, node_of,
                            post, run_prompt, running)
from fake_sglang import FakeSglang, dead_url

KEY_VARIABLE = "ERNIE_E2E_BOUND_KEY"
STRAY_VARIABLE = "HF_TOKEN"  # a secret of ComfyUI's environment that no credential names
BOUND_KEY = "bound-" + uuid.uuid4().hex
STRAY_SECRET = "hf_" + uuid.uuid4().hex
FILE_SECRET = "ssh-" + uuid.uuid4().hex
SECRETS = (BOUND_KEY, STRAY_SECRET, FILE_SECRET)
LABEL = "my-gpu"
START_TIMEOUT_S = 180
TEXT_EVENT = 3  # ComfyUI's BinaryEventTypes.TEXT: a node's progress text

pytestmark = COMFYUI_SUITE

aiohttp = pytest.importorskip("aiohttp")


@dataclass
class Machine(Server):
    """ComfyUI with the user's secrets, their own server bound in the keys file, and a secret file at home."""

    own: FakeSglang
    secret_file: Path


@pytest.fixture(scope="module")
def machine(tmp_path_factory: pytest.TempPathFactory):
    base = base_directory(tmp_path_factory, "comfy_secrets")
    secret_file = base / "home" / ".ssh" / "id_ed25519"
    secret_file.parent.mkdir(parents=True)
    secret_file.write_text(FILE_SECRET + "\n")
    with FakeSglang(model_id="baidu/ERNIE-Image-Turbo", api_key=BOUND_KEY) as own:
        keys = base / "user" / "ernie_image" / "keys.json"
        keys.parent.mkdir(parents=True, exist_ok=True)
        keys.write_text(json.dumps({"credentials": [{"label": LABEL, "origin": own.url, "env": KEY_VARIABLE}]}))
        port = free_port()
        command = [COMFY_PYTHON, "main.py", "--cpu", "--listen", "127.0.0.1", "--port", str(port),
                   "--base-directory", str(base)]
        env = {KEY_VARIABLE: BOUND_KEY, STRAY_VARIABLE: STRAY_SECRET, "HOME": str(base / "home"),
               "XDG_CONFIG_HOME": str(base / "config"), "ERNIE_IMAGE_KEYS_FILE": ""}
        with running(command, base / "comfyui.log", port, START_TIMEOUT_S, stop_timeout_s=20, env=env) as process:
            yield Machine(f"http://127.0.0.1:{port}", process, base / "comfyui.log", own, secret_file)


@pytest.fixture
def attacker():
    with FakeSglang(model_id="baidu/ERNIE-Image-Turbo") as server:
        yield server


def remote_graph(**backend_inputs: Any) -> dict[str, Any]:
    graph = api_workflow("ernie_image_remote_sglang")
    _, backend = node_of(graph, "ErnieImageRemoteBackend")
    backend["inputs"].update(wait_for_servers_s=0.0, **backend_inputs)
    _, sampler = node_of(graph, "ErnieImageTurboSampler")
    sampler["inputs"].update(resolution="custom", width=256, height=256)
    return graph


def assert_received_no_secret(server: FakeSglang) -> None:
    seen = json.dumps([[r.path, r.headers, r.body] for r in server.received])
    for secret in SECRETS:
        assert secret not in seen, f"the attacker's server received a secret: {seen[:400]}"


async def history_and_queue(machine: Machine) -> str:
    async with aiohttp.ClientSession() as session:
        texts = []
        for path in ("/history", "/queue"):
            async with session.get(machine.url + path) as response:
                texts.append(await response.text())
    return "\n".join(texts)


def legacy_sources(machine: Machine) -> list[dict[str, str]]:
    return [{"api_key_env": STRAY_VARIABLE}, {"api_key_env": KEY_VARIABLE}, {"api_key_file": str(machine.secret_file)},
            {"api_key_file": "/proc/self/environ"}, {"pe_api_key_env": KEY_VARIABLE},
            {"credential": STRAY_VARIABLE}, {"credential": str(machine.secret_file)}, {"credential": LABEL},
            {"pe_credential": LABEL}]


# ------------------------------------------------------------------------------------------------ tests
async def test_the_users_bound_key_reaches_their_server_and_no_record(machine: Machine) -> None:
    run = await run_prompt(machine, remote_graph(server_urls=machine.own.url))
    assert run.outcome == "execution_success", run.error
    assert machine.own.generations[-1].headers.get("Authorization") == f"Bearer {BOUND_KEY}"
    everything = json.dumps(run.history) + json.dumps(run.messages) + machine.log() + await history_and_queue(machine)
    for secret in SECRETS:
        assert secret not in everything


async def test_no_workflow_input_sends_a_secret_to_the_attackers_server(machine: Machine, attacker: FakeSglang) -> None:
    for source in legacy_sources(machine):
        pe = {"pe_url": attacker.url} if any(name.startswith("pe_") for name in source) else {}
        run = await run_prompt(machine, remote_graph(server_urls=attacker.url, **pe, **source))
        assert run.outcome == "execution_error", (source, run.outcome)
        message = run.error["exception_message"].strip()
        assert "keys file" in message and "\n" not in message, (source, message)
    assert_received_no_secret(attacker)
    everything = machine.log() + await history_and_queue(machine)
    for secret in SECRETS:
        assert secret not in everything


async def test_a_password_or_token_in_a_url_never_reaches_the_queue_or_history(machine: Machine) -> None:
    password = "pw-" + uuid.uuid4().hex
    for inputs, says in (({"server_urls": f"http://user:{password}@127.0.0.1:1"}, "password"),
                         ({"server_urls": machine.own.url, "pe_url": f"http://user:{password}@127.0.0.1:2"}, "password"),
                         ({"server_urls": f"http://127.0.0.1:1/?token={password}"}, "query or fragment"),
                         ({"server_urls": machine.own.url, "pe_url": f"http://127.0.0.1:2/v1#{password}"},
                          "query or fragment")):
        status, body = await post(machine, "/prompt", {"prompt": remote_graph(**inputs)})
        assert status == 400, body
        assert password not in json.dumps(body) and says in json.dumps(body)
    assert password not in await history_and_queue(machine) + machine.log()


FOREIGN_PAGES = [{"Origin": "http://evil.example"}, {"Origin": "null"}, {"Sec-Fetch-Site": "cross-site"},
                 {"Origin": "http://127.0.0.1:1", "Sec-Fetch-Site": "same-site"}]


@pytest.mark.parametrize("headers", FOREIGN_PAGES)
async def test_a_foreign_page_cannot_use_the_routes(machine: Machine, attacker: FakeSglang,
                                                    headers: dict[str, str]) -> None:
    body = json.dumps({"server_urls": attacker.url, "credential": LABEL})
    async with aiohttp.ClientSession() as session:
        send = {"Content-Type": "application/json", **headers}
        async with session.post(f"{machine.url}/ernie_image/test_connection", data=body, headers=send) as answer:
            assert answer.status == 403, await answer.text()
        async with session.post(f"{machine.url}/ernie_image/free", headers=headers) as answer:
            assert answer.status == 403, await answer.text()
        for query in ("", "?holders=1"):  # the plans name servers; the heap walk would stall prompts
            async with session.get(f"{machine.url}/ernie_image/memory{query}", headers=headers) as answer:
                assert answer.status == 403, await answer.text()
    assert attacker.received == []


async def test_a_form_or_text_post_to_test_connection_is_refused(machine: Machine, attacker: FakeSglang) -> None:
    async with aiohttp.ClientSession() as session:
        for content_type in ("text/plain", "application/x-www-form-urlencoded", "multipart/form-data; boundary=x"):
            async with session.post(f"{machine.url}/ernie_image/test_connection",
                                    data=json.dumps({"server_urls": attacker.url}),
                                    headers={"Content-Type": content_type}) as answer:
                assert answer.status == 415, (content_type, await answer.text())
    assert attacker.received == []


async def test_test_connection_takes_no_key_source_and_sends_no_key_elsewhere(machine: Machine,
                                                                            attacker: FakeSglang) -> None:
    for extra in ({"api_key_env": STRAY_VARIABLE}, {"api_key_file": str(machine.secret_file)},
                  {"credential": LABEL}, {"credential": STRAY_VARIABLE}):
        status, body = await post(machine, "/ernie_image/test_connection", {"server_urls": attacker.url, **extra})
        assert status == 400, (extra, body)
        assert "keys file" in body["error"] and "\n" not in body["error"], (extra, body)
    status, body = await post(machine, "/ernie_image/test_connection", {"server_urls": attacker.url})
    assert status == 200 and body["ok"], body  # no key bound there: the check runs without one
    assert_received_no_secret(attacker)
    status, body = await post(machine, "/ernie_image/test_connection", {"server_urls": machine.own.url})
    assert status == 200 and body["ok"], body
    assert machine.own.received[-1].headers.get("Authorization") == f"Bearer {BOUND_KEY}"


async def test_a_waiting_backend_says_on_the_node_what_it_waits_for(machine: Machine) -> None:
    graph = remote_graph(server_urls=dead_url())
    _, backend = node_of(graph, "ErnieImageRemoteBackend")
    backend["inputs"]["wait_for_servers_s"] = 2.0
    sampler_id, _ = node_of(graph, "ErnieImageTurboSampler")
    texts: list[str] = []
    client_id = uuid.uuid4().hex
    async with aiohttp.ClientSession() as session:
        async with session.ws_connect(f"{machine.url}/ws?clientId={client_id}") as ws:
            async with session.post(f"{machine.url}/prompt", json={"prompt": graph, "client_id": client_id}) as answer:
                assert answer.status == 200, await answer.text()
            deadline = time.monotonic() + 60
            outcome = ""
            while not outcome and time.monotonic() < deadline:
                message = await ws.receive(timeout=60)
                if message.type == aiohttp.WSMsgType.BINARY and struct.unpack(">I", message.data[:4])[0] == TEXT_EVENT:
                    length = struct.unpack(">I", message.data[4:8])[0]
                    node = message.data[8:8 + length].decode()
                    texts.append(f"{node}:{message.data[8 + length:].decode()}")
                elif message.type == aiohttp.WSMsgType.TEXT:
                    event = json.loads(message.data)
                    if event["type"] in ("execution_success", "execution_error", "execution_interrupted"):
                        outcome = event["type"]
    assert outcome == "execution_error"
    waiting = [text for text in texts if text.startswith(f"{sampler_id}:waiting for ")]
    assert any("refused" in text for text in waiting), texts
    assert re.search(r"\d+ s \(up to 2 s", waiting[-1]), texts
