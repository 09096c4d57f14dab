"""The standalone Prompt Enhancer node: the revised prompt as a STRING, from a Loader's PE or a chat server.

Local: a tiny PE built in code gives the node the same revision the pipe's own use_pe gives the DiT. Remote: a
real aiohttp chat-completions server on loopback. Missing or wrong inputs stop with a one-line error.
"""
from __future__ import annotations

import re
from pathlib import Path

import pytest

from ernie_image.nodes import NODE_CLASS_MAPPINGS
from ernie_image.nodes.enhancer import ErnieImagePromptEnhancer
from ernie_image.nodes.remote import ErnieImageRemoteBackend
from ernie_image.runtime.core.errors import InvalidInputError, ModelFileError
from ernie_image.runtime.core.host import NullHost
from ernie_image.runtime.core.request import GenerationRequest
from ernie_image.runtime.demo.tiny import build_tiny_model
from ernie_image.runtime.formats.sources import ModelSources
from ernie_image.runtime.local.options import LoadOptions
from ernie_image.runtime.local.pipe import LocalPipe
from ernie_image.runtime.remote.backend import RemotePipe

from test_enhancer_remote import SECRET, ChatServer

PROMPT = "a lighthouse at dusk"


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def model_dir(tiny_turbo_with_pe) -> Path:
    return tiny_turbo_with_pe


def cpu_pipe(sources: ModelSources, **options) -> LocalPipe:
    return LocalPipe.load(sources, LoadOptions(device="cpu", dtype="fp32", previews=False, **options))


def enhance(**changes):
    """The node's outputs (revised_prompt, info) and the text it shows on itself."""
    inputs = dict(prompt=PROMPT, resolution="custom", width=256, height=256, seed=21, temperature=0.6, top_p=0.95,
                  max_new_tokens=12)
    inputs.update(changes)
    output = ErnieImagePromptEnhancer().enhance(**inputs)
    assert output["ui"]["text"] == [output["result"][0]]
    return output["result"]


# -------------------------------------------------------------------------------------------- definition
def test_definition_has_baidus_defaults_a_seed_widget_and_optional_sources() -> None:
    node = NODE_CLASS_MAPPINGS["ErnieImagePromptEnhancer"]
    assert node is ErnieImagePromptEnhancer and node.CATEGORY == "ERNIE-Image"
    assert node.RETURN_TYPES == ("STRING", "STRING") and node.RETURN_NAMES == ("revised_prompt", "info")
    required, optional = node.INPUT_TYPES()["required"], node.INPUT_TYPES()["optional"]
    assert list(required) == ["prompt", "resolution", "width", "height", "seed", "temperature", "top_p",
                              "max_new_tokens"]
    assert required["prompt"][1]["multiline"]
    assert required["seed"][1]["control_after_generate"] is True
    assert (required["temperature"][1]["default"], required["top_p"][1]["default"],
            required["max_new_tokens"][1]["default"]) == (0.6, 0.95, 512)
    assert required["width"][1]["step"] == required["height"][1]["step"] == 16
    assert optional["pipe"][0] == "ERNIE_PIPE"
    assert list(optional) == ["pipe", "pe_url", "pe_model", "pe_credential"]
    assert set(node.INPUT_TYPES()["hidden"]) == {"unique_id", "pe_api_key_env", "pe_api_key_file"}
    for section in (required, optional):
        assert all(spec[1].get("tooltip") for spec in section.values())
    # the size is checked once, when the node runs (resolve_size); a password in pe_url before the prompt is queued
    assert node.VALIDATE_INPUTS(pe_url="http://127.0.0.1:8000") is True
    refused = node.VALIDATE_INPUTS(pe_url="http://pe:pw-5678@127.0.0.1:8000")
    assert refused.startswith("pe_url: http://***@127.0.0.1:8000 holds a user name or password")
    assert "pw-5678" not in refused


# ------------------------------------------------------------------------------------------ local PE
def test_local_pe_gives_the_revision_the_pipes_use_pe_gives_the_dit(model_dir) -> None:
    generated = cpu_pipe(ModelSources(model_dir=model_dir), keep_loaded=False).generate(
        GenerationRequest(prompt=PROMPT, width=256, height=256, steps=1, cfg=1.0, seed=21, use_pe=True,
                          pe_max_new_tokens=12), NullHost())
    pipe = cpu_pipe(ModelSources(model_dir=model_dir), keep_loaded=False)
    revised, info = enhance(pipe=pipe)
    assert revised == generated.prompts_used[0] != PROMPT
    assert info.startswith("prompt enhancer (local): ") and "tokens/s" in info
    assert pipe.parts.enhancer is None, "keep_loaded off: the PE is freed after the node ran"
    assert enhance(pipe=pipe)[0] == revised, "same seed, same revision"
    assert enhance(pipe=pipe, seed=22)[0] != revised


def test_preset_resolution_is_what_the_pe_is_told(model_dir) -> None:
    pipe = cpu_pipe(ModelSources(model_dir=model_dir), keep_loaded=True)
    revised, _ = enhance(pipe=pipe, resolution="848x1264 (2:3)", width=256, height=256)
    expected = pipe.enhance(PROMPT, 848, 1264, 21, max_new_tokens=12).prompts[0]
    assert revised == expected
    assert pipe.parts.enhancer is not None, "keep_loaded on: the PE is kept (in host RAM) for the next run"
    pipe.release()


# ----------------------------------------------------------------------------------------- remote PE
def test_a_chat_server_reporting_no_token_counts_is_shown_its_seconds_alone() -> None:
    with ChatServer(faults=["no_usage"]) as server:
        revised, info = enhance(pe_url=server.url, seed=7)
    assert revised == f"revised: {PROMPT} @7"
    assert re.fullmatch(r"prompt enhancer \(remote\): \d+\.\d\d s \(no token count reported\)", info), info


def test_chat_endpoint_revises_with_the_nodes_settings_and_the_key_bound_to_it(monkeypatch: pytest.MonkeyPatch,
                                                                               keys_file) -> None:
    monkeypatch.setenv("ERNIE_TEST_PE_KEY", SECRET)
    with ChatServer(api_key=SECRET) as server:
        keys_file({"label": "pe-box", "origin": server.url, "env": "ERNIE_TEST_PE_KEY"})
        revised, info = enhance(pe_url=server.url, pe_credential="pe-box", resolution="1264x848 (3:2)",
                                seed=7, temperature=0.3, top_p=0.9, max_new_tokens=300)
    assert revised == f"revised: {PROMPT} @7"
    body = server.received[0]
    assert body["messages"][-1]["content"] == f'{{"prompt": "{PROMPT}", "width": 1264, "height": 848}}'
    assert (body["temperature"], body["top_p"], body["max_tokens"], body["seed"]) == (0.3, 0.9, 300, 7)
    assert server.headers[0]["Authorization"] == f"Bearer {SECRET}"
    assert info.startswith("prompt enhancer (remote): 17 tokens in ") and "tokens/s" in info
    assert SECRET not in revised + info


def test_the_endpoint_wins_over_the_pipe_and_loads_nothing_locally(model_dir) -> None:
    pipe = cpu_pipe(ModelSources(model_dir=model_dir))
    with ChatServer() as server:
        revised, _ = enhance(pipe=pipe, pe_url=server.url + "/v1", pe_model="baidu/ERNIE-Image-PE")
    assert revised == f"revised: {PROMPT} @21"
    assert not pipe.is_loaded()


def test_a_failing_server_passes_the_original_prompt_on_and_says_so() -> None:
    with ChatServer(faults=["500", "500", "500"]) as server:
        revised, info = enhance(pe_url=server.url)
    assert revised == PROMPT
    assert info.splitlines()[0] == "prompt enhancer did not revise the prompt: the original prompt is passed on"
    assert "original prompt is used" in info


def test_a_remote_backend_with_a_pe_endpoint_feeds_the_node() -> None:
    with ChatServer() as server:
        backend = ErnieImageRemoteBackend().connect(
            server_urls="http://127.0.0.1:1", connect_timeout_s=1.0, read_timeout_s=30.0, pe_url=server.url)
        pipe = backend["result"][0]
        assert "prompt enhancer: chat endpoint" in backend["result"][1]
        revised, _ = enhance(pipe=pipe, seed=3)
        pipe.release()
    assert revised == f"revised: {PROMPT} @3"


# ------------------------------------------------------------------------------------------ bad inputs
def test_neither_a_pipe_nor_an_endpoint_is_a_one_line_error() -> None:
    with pytest.raises(InvalidInputError, match="no prompt enhancer to run: connect a Loader") as error:
        enhance()
    assert "\n" not in str(error.value)


def test_a_pipe_without_a_pe_says_what_to_do(tmp_path) -> None:
    without_pe = cpu_pipe(build_tiny_model(tmp_path / "no-pe", layout="diffusers", variant="turbo"))
    with pytest.raises(InvalidInputError, match="no prompt enhancer to run"):
        enhance(pipe=without_pe)
    with pytest.raises(ModelFileError, match="this model has no prompt enhancer"):
        without_pe.enhance(PROMPT, 256, 256, 0)
    with pytest.raises(InvalidInputError, match="no prompt enhancer to run"):
        enhance(pipe=RemotePipe(["http://127.0.0.1:1"]))
    with pytest.raises(InvalidInputError, match="no PE endpoint"):
        RemotePipe(["http://127.0.0.1:1"]).enhance(PROMPT, 256, 256, 0)


def test_bad_endpoint_settings_are_refused_before_anything_is_sent(keys_file_of_this_test: Path) -> None:
    with ChatServer() as server:
        for name in ("pe_api_key_env", "pe_api_key_file"):
            with pytest.raises(InvalidInputError, match=rf"^this workflow names where an API key is read from "
                                                        rf"\({name}, a widget of earlier versions\)") as error:
                enhance(pe_url=server.url, **{name: "sk-live-1234567890"})
            assert "1234567890" not in str(error.value) and str(keys_file_of_this_test) in str(error.value)
        with pytest.raises(InvalidInputError, match=r"^pe_credential is not the label of any credential of yours \(what it holds is not repeated, in case "
                                                    r"it is a key\): add .* to the "
                                                    "keys file"):
            enhance(pe_url=server.url, pe_credential="pe-box")
        with pytest.raises(InvalidInputError, match="pe_url 'ftp://pe-box:8000' has the scheme 'ftp'"):
            enhance(pe_url="ftp://pe-box:8000")
        with pytest.raises(InvalidInputError, match="prompt is empty"):
            enhance(prompt="  ", pe_url=server.url)
        with pytest.raises(InvalidInputError, match="temperature"):
            enhance(pe_url=server.url, temperature=9.0)
    assert server.models_asked == 0 and not server.headers


@pytest.mark.parametrize("widget, value, shown", [("temperature", 7.0, "7"), ("top_p", 1.5, "1.5"),
                                                  ("max_new_tokens", 9000, "9000")])
def test_a_sampling_setting_out_of_range_is_named_as_the_widget_before_anything_is_sent(widget, value, shown) -> None:
    """ComfyUI checks a widget's bounds for the graph; a workflow sent to the API is checked by the pack, in the
    node's words."""
    with ChatServer() as server:
        with pytest.raises(InvalidInputError, match=rf"^the Prompt Enhancer's {widget} {shown} is not allowed: use "):
            enhance(pe_url=server.url, **{widget: value})
        assert server.received == [] and server.models_asked == 0
