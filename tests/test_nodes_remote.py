"""The Remote Backend node and the "Test connection" check against the fake SGLang server on loopback."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from ernie_image.nodes.remote import ErnieImageRemoteBackend, parse_urls
from ernie_image.nodes.routes import check_servers
from ernie_image.nodes.sampler import ErnieImageTurboSampler
from ernie_image.runtime.errors import InvalidInputError
from fake_sglang import FakeSglang, free_port


def connect(**changes):
    inputs = dict(server_urls="http://127.0.0.1:1", connect_timeout_s=2.0, read_timeout_s=30.0, api_key_env="",
                  api_key_file="")
    inputs.update(changes)
    return ErnieImageRemoteBackend().connect(**inputs)


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


def test_the_api_key_is_named_never_given(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(InvalidInputError, match="NAME of an environment variable") as error:
        connect(api_key_env="sk-live-1234567890")
    assert "1234567890" not in str(error.value)
    # A pasted key that looks like a name names no variable of ComfyUI's: refused, and not echoed either.
    monkeypatch.delenv("mysecretkey42", raising=False)
    with pytest.raises(InvalidInputError, match="api_key_env names no variable of ComfyUI's environment, and the "
                                                "value given looks like a key") as error:
        connect(api_key_env="mysecretkey42")
    assert "mys" not in str(error.value)
    big = tmp_path / "not_a_key.txt"
    big.write_bytes(b"x" * 10_000)
    with pytest.raises(InvalidInputError, match="not a key file"):
        connect(api_key_file=str(big))
    with pytest.raises(InvalidInputError, match="is not a file"):
        connect(api_key_file=str(tmp_path / "missing"))


def test_a_key_from_the_environment_reaches_the_server(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ERNIE_TEST_SGLANG_KEY", "s3cret-key")
    with FakeSglang(api_key="s3cret-key") as server:
        pipe = connect(server_urls=server.url, api_key_env="ERNIE_TEST_SGLANG_KEY")["result"][0]
        ErnieImageTurboSampler().generate(pipe=pipe, prompt="x", resolution="custom", width=256, height=256,
                                          steps=1, cfg=1.0, seed=0, batch_size=1, shift=4.0, use_pe=False)
        pipe.release()
        assert server.generations[0].headers.get("Authorization") == "Bearer s3cret-key"


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


def test_the_new_widgets_come_after_the_pe_ones_so_saved_workflows_keep_their_values() -> None:
    optional = list(ErnieImageRemoteBackend.INPUT_TYPES()["optional"])
    assert optional[:4] == ["pe_url", "pe_model", "pe_api_key_env", "pe_api_key_file"]
    assert optional[4:] == ["wait_for_servers_s", "resend_unanswered"]
