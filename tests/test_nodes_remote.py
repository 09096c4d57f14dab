"""The Remote Backend node and the "Test connection" check against the fake SGLang server on loopback."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from ernie_image.nodes.remote import ErnieImageRemoteBackend, parse_urls
from ernie_image.nodes.routes import check_servers
from ernie_image.nodes.sampler import ErnieImageTurboSampler
from ernie_image.runtime.core.errors import InvalidInputError
from fake_sglang import FakeSglang, free_port


KEY = "s3cret-key-0123456789"
KEY_VAR = "ERNIE_TEST_SGLANG_KEY"
LEGACY_INPUTS = ("api_key_env", "api_key_file", "pe_api_key_env", "pe_api_key_file")


def connect(**changes):
    inputs = dict(server_urls="http://127.0.0.1:1", connect_timeout_s=2.0, read_timeout_s=30.0)
    inputs.update(changes)
    return ErnieImageRemoteBackend().connect(**inputs)


def generate_one(pipe) -> None:
    ErnieImageTurboSampler().generate(pipe=pipe, prompt="x", resolution="custom", width=256, height=256, steps=1,
                                      cfg=1.0, seed=0, batch_size=1, shift=4.0, use_pe=False)
    pipe.release()


def test_urls_one_per_line_with_comments_and_duplicates() -> None:
    assert parse_urls("http://a:30000\n\n  http://b:30000  # spare\nhttp://a:30000") == ["http://a:30000", "http://b:30000"]
    with pytest.raises(InvalidInputError, match="no server URL"):
        parse_urls("  \n# nothing\n")


def test_remote_pipe_drives_the_same_sampler() -> None:
    with FakeSglang(model_id="baidu/ERNIE-Image-Turbo") as server:
        node = connect(server_urls=server.url)
        pipe = node["result"][0]
        assert pipe.kind == "remote" and server.url in node["ui"]["text"][0]
        images, latent, prompt_used = ErnieImageTurboSampler().generate(
            pipe=pipe, prompt="a lighthouse", resolution="custom", width=256, height=320, steps=8, cfg=1.0,
            seed=11, batch_size=2, shift=4.0, use_pe=False)["result"]
        pipe.release()
    assert images.shape == (2, 320, 256, 3) and images.dtype == torch.float32
    assert [g.body["seed"] for g in server.generations] == [11, 12]
    assert all(g.body["num_inference_steps"] == 8 and g.body["guidance_scale"] == 1.0 for g in server.generations)
    assert prompt_used == "a lighthouse"
    assert latent is None  # no latents from a server; inside ComfyUI this is an ExecutionBlocker with a message


@pytest.mark.parametrize("name", LEGACY_INPUTS)
@pytest.mark.parametrize("value", [KEY_VAR, "sk-live-1234567890", "~/.config/sglang.key", "/etc/hostname"])
def test_a_workflow_naming_where_a_key_is_read_is_refused_in_one_line_naming_the_keys_file(
        name: str, value: str, keys_file_of_this_test: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The widgets of earlier versions named any variable or file, whose content went to any URL: refused."""
    monkeypatch.setenv(KEY_VAR, KEY)
    with pytest.raises(InvalidInputError) as refused:
        connect(server_urls="http://127.0.0.1:1", pe_url="http://127.0.0.1:2", **{name: value})
    prefix = "pe_" if name.startswith("pe_") else ""
    assert str(refused.value) == (
        f"this workflow names where an API key is read from ({name}, a widget of earlier versions); a workflow may "
        f"no longer do that: bind the key to the server in your keys file ({keys_file_of_this_test}) and leave "
        f"{prefix}credential empty, or pick it by its label")
    assert value not in str(refused.value), "the value (maybe a pasted key) is not echoed"


def test_a_legacy_key_input_maps_only_to_a_credential_of_that_label_bound_to_that_server(
        keys_file, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(KEY_VAR, KEY)
    with FakeSglang(api_key=KEY) as server, FakeSglang() as other:
        keys_file({"label": KEY_VAR, "origin": server.url, "env": KEY_VAR})
        generate_one(connect(server_urls=server.url, api_key_env=KEY_VAR)["result"][0])
        assert server.generations[0].headers.get("Authorization") == f"Bearer {KEY}"
        for refused in (dict(server_urls=other.url, api_key_env=KEY_VAR),  # the label is bound elsewhere
                        dict(server_urls=server.url, api_key_file=KEY_VAR + ".key"),  # no such label
                        dict(server_urls=f"{server.url}\n{other.url}", api_key_env=KEY_VAR)):  # one server is not
            with pytest.raises(InvalidInputError, match="keys file"):
                connect(**refused)
    assert other.wire == []


def test_an_unknown_input_is_refused() -> None:
    with pytest.raises(InvalidInputError, match="unknown input 'api_key'"):
        connect(api_key="sk-live-1234567890")


def test_a_key_bound_in_the_keys_file_reaches_its_server_by_origin_or_by_label(
        keys_file, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(KEY_VAR, KEY)
    with FakeSglang(api_key=KEY) as server:
        keys_file({"label": "gpu-box", "origin": server.url, "env": KEY_VAR})
        generate_one(connect(server_urls=server.url)["result"][0])
        generate_one(connect(server_urls=server.url, credential="gpu-box")["result"][0])
        assert [g.headers.get("Authorization") for g in server.generations] == [f"Bearer {KEY}"] * 2


def test_a_credential_label_bound_to_another_server_is_refused_naming_how_to_bind_one(
        keys_file, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(KEY_VAR, KEY)
    path = keys_file({"label": "gpu-box", "origin": "http://gpu-box:30000", "env": KEY_VAR})
    with pytest.raises(InvalidInputError) as refused:
        connect(server_urls="http://127.0.0.1:1", credential="gpu-box")
    assert str(refused.value) == (
        "credential 'gpu-box' is not bound to http://127.0.0.1:1: a key is sent only to the server it is bound to; "
        'add {"label": "NAME", "origin": "http://127.0.0.1:1", "env": "VARIABLE"} (or "file": PATH) to the keys file '
        f"{path}, or leave credential empty")


def test_a_password_in_a_url_is_refused_before_the_prompt_is_queued() -> None:
    said = ErnieImageRemoteBackend.VALIDATE_INPUTS(server_urls="http://127.0.0.1:1\nhttp://bob:pw-4321@gpu:1",
                                                   pe_url="")
    assert isinstance(said, str) and said.startswith("server_urls: http://***@gpu:1 holds a user name or password")
    assert "pw-4321" not in said and "keys file" in said
    assert ErnieImageRemoteBackend.VALIDATE_INPUTS(server_urls="http://127.0.0.1:1", pe_url=None) is True


@pytest.mark.parametrize("field, url", [
    *[(field, url) for field in ("server_urls", "pe_url")
      for url in ("http://gpu:1/?token=tk-4321", "http://gpu:1/sg?key=tk-4321&x=1", "gpu:1?tk-4321")],
    ("pe_url", "http://gpu:1/#tk-4321"),  # in server_urls a # starts a comment
])
def test_a_token_in_a_urls_query_or_fragment_is_refused_before_the_prompt_is_queued(url: str, field: str) -> None:
    """A query or fragment is where a token rides in a URL: the workflow would carry it, and /history keep it."""
    inputs = {"server_urls": "http://127.0.0.1:1", "pe_url": ""} | {field: url}
    said = ErnieImageRemoteBackend.VALIDATE_INPUTS(**inputs)
    assert isinstance(said, str) and said.startswith(f"{field}: ") and "has a query or fragment" in said, said
    assert "tk-4321" not in said and said.endswith("bind its key in your keys file (see the README)")


def test_check_reports_the_served_model_without_generating() -> None:
    with FakeSglang(model_id="baidu/ERNIE-Image", num_gpus=2) as server:
        result = check_servers({"server_urls": server.url})
        assert not server.generations
        paths = {r.path for r in server.received}
    assert result["ok"] and result["servers"][0]["model"] == "baidu/ERNIE-Image" and result["servers"][0]["gpus"] == 2
    assert paths <= {"/health", "/v1/models", "/server_info"}
    assert result["text"].startswith("OK ")


def test_check_refuses_a_timeout_that_is_not_a_number() -> None:
    with pytest.raises(InvalidInputError, match="connect_timeout_s 'soon' is not a number of seconds"):
        check_servers({"server_urls": "http://127.0.0.1:1", "connect_timeout_s": "soon"})


def test_check_reports_a_dead_server_as_a_row_not_an_exception() -> None:
    url = f"http://127.0.0.1:{free_port()}"
    result = check_servers({"server_urls": url, "connect_timeout_s": 1})
    assert not result["ok"] and result["servers"][0]["problems"]
    assert result["text"].startswith("!! ")


def test_wait_and_resend_widgets_reach_the_pipe_and_bad_timeouts_are_refused() -> None:
    pipe = connect(wait_for_servers_s=30.0, resend_unanswered=True)["result"][0]
    assert pipe.settings.wait_for_servers_s == 30.0 and pipe.settings.resend_unanswered is True
    assert connect()["result"][0].settings.resend_unanswered is False, "off unless asked for"
    for changes, name in ((dict(wait_for_servers_s=float("nan")), "wait_for_servers_s"),
                          (dict(read_timeout_s=0.0), "read_timeout_s"), (dict(connect_timeout_s=-1.0), "connect_timeout_s")):
        with pytest.raises(InvalidInputError, match=f"{name} .* is not allowed"):
            connect(**changes)


def test_a_key_is_picked_by_its_label_and_the_old_key_widgets_are_hidden_inputs() -> None:
    inputs = ErnieImageRemoteBackend.INPUT_TYPES()
    assert list(inputs["required"]) == ["server_urls", "connect_timeout_s", "read_timeout_s", "credential"]
    assert list(inputs["optional"]) == ["pe_url", "pe_model", "pe_credential", "wait_for_servers_s",
                                        "resend_unanswered"]
    assert inputs["required"]["credential"][0] == inputs["optional"]["pe_credential"][0] == "STRING"
    assert sorted(inputs["hidden"]) == sorted(LEGACY_INPUTS), "an old workflow's values still reach connect()"
    assert "keys file" in inputs["required"]["credential"][1]["tooltip"]


def in_comfyui_with_user_folder(monkeypatch: pytest.MonkeyPatch, user: Path) -> None:
    """ComfyUI's folder registry answering its user folder, as inside ComfyUI."""
    import sys
    import types

    folder_paths = types.ModuleType("folder_paths")
    folder_paths.folder_names_and_paths = {}
    folder_paths.get_user_directory = lambda: str(user)
    monkeypatch.setitem(sys.modules, "folder_paths", folder_paths)


@pytest.mark.parametrize("broken, said", [
    ("folder others can write", "http://127.0.0.1:1, bound to a key there, needs the keys file, which is not used: "
                                "the folder ComfyUI's user/ernie_image holding the keys file can be changed by other "
                                "users, who could put another keys file in its place and send your keys elsewhere: "
                                "run chmod go-w on ComfyUI's user/ernie_image folder"),
    ("unknown label", "credential is not the label of any credential of yours (what it holds is not repeated, in "
                      "case it is a key); those bound to http://127.0.0.1:1: 'lab': add {\"label\": \"NAME\", \"origin\": "
                      "\"http://127.0.0.1:1\", \"env\": \"VARIABLE\"} (or \"file\": PATH) to the keys file ComfyUI's "
                      "user/ernie_image/keys.json with that label, or leave credential empty"),
    ("key readable by others", "http://127.0.0.1:1, bound to a key there, needs the keys file, which is not used: "
                               "the keys file ComfyUI's user/ernie_image/keys.json holds a key and other users can "
                               "read it: run chmod 600 ComfyUI's user/ernie_image/keys.json, or name a variable "
                               "(env) or a file instead of writing the key"),
])
def test_a_keys_file_error_on_the_node_names_no_path_of_the_machine(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                                     broken: str, said: str) -> None:
    """The node's error lands in ComfyUI's /history, which anyone with the page reads: the keys file is named by
    ComfyUI's user folder, never by the install or home path, and the error still says what to change."""
    import json
    import os

    user = tmp_path / "ComfyUI" / "user"
    keys = user / "ernie_image" / "keys.json"
    keys.parent.mkdir(parents=True)
    key_entry = {"label": "lab", "origin": "http://127.0.0.1:1", "key": KEY}
    keys.write_text(json.dumps({"credentials": [key_entry]}))
    os.chmod(keys, 0o644 if broken == "key readable by others" else 0o600)
    if broken == "folder others can write":
        os.chmod(keys.parent, 0o777)
    in_comfyui_with_user_folder(monkeypatch, user)
    try:
        with pytest.raises(InvalidInputError) as refused:
            connect(server_urls="http://127.0.0.1:1", credential="gpu-box" if broken == "unknown label" else "")
    finally:
        os.chmod(keys.parent, 0o755)
    assert str(refused.value) == said
    assert str(tmp_path) not in str(refused.value) and KEY not in str(refused.value)
