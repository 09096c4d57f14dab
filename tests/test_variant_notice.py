"""Settings meant for the other variant run with a notice, never silently: a Turbo model under the base Sampler (50
steps at CFG 4 burn a Turbo picture), the base model under the Turbo Sampler (8 steps at CFG 1 leave it unfinished).

The Samplers say whose settings theirs are (GenerationRequest.settings_for); the pipe that runs the request compares
them with its variant and logs the notice, so the library and the CLI (`--variant` against a server of the other
variant) get it too. In ComfyUI it is a console line and the Sampler node's text; it is a notice, not an error.
"""
from __future__ import annotations

import logging

import pytest

from ernie_image.nodes.sampler import ErnieImageSampler, ErnieImageTurboSampler
from ernie_image.runtime.core.errors import InvalidInputError
from ernie_image.runtime.core.host import NullHost
from ernie_image.runtime.core.request import GenerationRequest
from ernie_image.runtime.demo.tiny import build_tiny_model
from ernie_image.runtime.formats.sources import ModelSources
from ernie_image.runtime.local.options import LoadOptions
from ernie_image.runtime.local.pipe import LocalPipe
from ernie_image.runtime.remote.backend import RemotePipe
from conftest import LoggingHost
from fake_sglang import FakeSglang

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny models: one thread

TURBO_UNDER_BASE = ("the model is Turbo, from the transformer config, but these settings (1 step, CFG 4) were given "
                    "for the base model: Turbo is made for 8 steps at CFG 1: use {own}, or set {variant} if the "
                    "model is not Turbo")
BASE_UNDER_TURBO = ("the model is Base, from the transformer config, but these settings (1 step, CFG 1) were given for "
                    "Turbo: Base is made for 50 steps at CFG 4: use {own}, or set {variant} if the model is not Base")
IN_COMFYUI = dict(variant="the Loader's variant widget")


@pytest.fixture(scope="module")
def turbo_pipe(tiny_turbo_folder) -> LocalPipe:
    return LocalPipe.load(ModelSources(model_dir=tiny_turbo_folder), LoadOptions(device="cpu"))


@pytest.fixture(scope="module")
def base_pipe(tmp_path_factory) -> LocalPipe:
    folder = build_tiny_model(tmp_path_factory.mktemp("base"), layout="diffusers", variant="base").model_dir
    return LocalPipe.load(ModelSources(model_dir=folder), LoadOptions(device="cpu"))


def sampler_inputs(cfg: float) -> dict:
    return dict(prompt="a red fox", resolution="custom", width=256, height=256, steps=1, cfg=cfg, seed=3,
                batch_size=1, shift=4.0, use_pe=False)


def test_a_turbo_model_under_the_base_sampler_runs_with_a_notice_on_the_node_and_the_console(turbo_pipe, caplog):
    with caplog.at_level(logging.INFO, logger="ernie_image"):
        shown = ErnieImageSampler().generate(pipe=turbo_pipe, negative_prompt="", **sampler_inputs(4.0))
    notice = TURBO_UNDER_BASE.format(own="the Turbo Sampler", **IN_COMFYUI)
    assert shown["ui"]["text"] == [notice]
    assert f"[ERNIE-Image] {notice}" in caplog.messages
    images, latent, prompt_used = shown["result"]  # it still runs: a notice, not an error
    assert images.shape == (1, 256, 256, 3) and prompt_used == "a red fox"


def test_a_base_model_under_the_turbo_sampler_runs_with_a_notice_on_the_node(base_pipe):
    shown = ErnieImageTurboSampler().generate(pipe=base_pipe, **sampler_inputs(1.0))
    assert shown["ui"]["text"] == [BASE_UNDER_TURBO.format(own="the Sampler", **IN_COMFYUI)]
    assert shown["result"][0].shape == (1, 256, 256, 3)


def test_each_sampler_on_its_own_variant_gives_no_notice(turbo_pipe, base_pipe):
    assert ErnieImageTurboSampler().generate(pipe=turbo_pipe, **sampler_inputs(1.0))["ui"]["text"] == [""]
    shown = ErnieImageSampler().generate(pipe=base_pipe, negative_prompt="", **sampler_inputs(4.0))
    assert shown["ui"]["text"] == [""]


def test_the_library_notices_settings_meant_for_the_other_variant(turbo_pipe):
    request = GenerationRequest(prompt="a red fox", width=256, height=256, steps=1, cfg=4.0, settings_for="base")
    host = LoggingHost()
    turbo_pipe.generate(request, host)
    assert TURBO_UNDER_BASE.format(own="steps=8, cfg=1", variant="variant") in host.messages
    unsaid = LoggingHost()
    turbo_pipe.generate(GenerationRequest(prompt="a red fox", width=256, height=256, steps=1, cfg=4.0), unsaid)
    assert not any("were given for" in message for message in unsaid.messages)  # nobody said whose they are


def test_a_settings_for_that_is_not_a_variant_is_refused_in_one_line(turbo_pipe):
    with pytest.raises(InvalidInputError) as refused:
        turbo_pipe.generate(GenerationRequest(prompt="x", width=256, height=256, settings_for="Turbo"), NullHost())
    assert str(refused.value) == "settings_for 'Turbo' is not allowed: give 'base', 'turbo' or None"


@pytest.mark.parametrize("steps, said", [(1, "1 step"), (2, "2 steps")])
def test_the_notice_counts_steps_in_words_that_read_right(turbo_pipe, steps, said):
    host = LoggingHost()
    turbo_pipe.generate(GenerationRequest(prompt="a fox", width=256, height=256, steps=steps, cfg=4.0,
                                          settings_for="base"), host)
    assert any(f"but these settings ({said}, CFG 4) were given for the base model" in m for m in host.messages)


def test_the_model_s_own_settings_give_no_notice_whichever_sampler_gave_them(turbo_pipe, base_pipe):
    """A Base Sampler set to 8 steps at CFG 1 runs a Turbo model as it is made to run: nothing to say."""
    shown = ErnieImageSampler().generate(pipe=turbo_pipe, negative_prompt="", **{**sampler_inputs(1.0), "steps": 8})
    assert shown["ui"]["text"] == [""]
    shown = ErnieImageTurboSampler().generate(pipe=base_pipe, **{**sampler_inputs(4.0), "steps": 50})
    assert shown["ui"]["text"] == [""]  # and a Turbo Sampler set to Base's 50 steps at CFG 4 on a Base model


# ------------------------------------------------------------------------------------------- on a remote pipe
REMOTE = ("{url} serves {model}, {variant}, by its model path, but these settings ({settings}) were given for {other}: "
          "{variant} is made for {own_values}: use {own}, or point {urls} at a server of {other}")
TURBO_SERVER = dict(model="baidu/ERNIE-Image-Turbo", variant="Turbo", settings="50 steps, CFG 4",
                    other="the base model", own_values="8 steps at CFG 1")
BASE_SERVER = dict(model="baidu/ERNIE-Image", variant="Base", settings="8 steps, CFG 1", other="Turbo",
                   own_values="50 steps at CFG 4")
NOT_ON_A_REMOTE_PIPE = ("Loader", "variant widget", "set variant", "--variant")


def remote_sampler_inputs(steps: int, cfg: float) -> dict:
    return {**sampler_inputs(cfg), "steps": steps}


@pytest.mark.parametrize("sampler, server, steps, cfg, own", [
    (ErnieImageSampler, TURBO_SERVER, 50, 4.0, "the Turbo Sampler"),
    (ErnieImageTurboSampler, BASE_SERVER, 8, 1.0, "the Sampler"),
])
def test_a_sampler_on_a_server_of_the_other_model_names_the_server_and_what_applies_on_a_remote_pipe(
        sampler, server, steps, cfg, own):
    with FakeSglang(model_id=server["model"]) as fake:
        pipe = RemotePipe([fake.url])
        try:
            extra = {"negative_prompt": ""} if sampler is ErnieImageSampler else {}
            shown = sampler().generate(pipe=pipe, **extra, **remote_sampler_inputs(steps, cfg))
        finally:
            pipe.release()
    notice = REMOTE.format(url=fake.url, own=own, urls="the Remote Backend's server_urls", **server)
    assert shown["ui"]["text"][0].splitlines()[0] == notice  # then the batch's own lines
    assert not any(word in notice for word in NOT_ON_A_REMOTE_PIPE)


def test_the_library_s_remote_notice_names_its_own_arguments():
    with FakeSglang(model_id="baidu/ERNIE-Image") as server:
        pipe = RemotePipe([server.url])
        host = LoggingHost()
        try:
            pipe.generate(GenerationRequest(prompt="a fox", width=256, height=256, steps=8, cfg=1.0,
                                            settings_for="turbo"), host)
        finally:
            pipe.release()
    assert REMOTE.format(url=server.url, own="steps=50, cfg=4", urls="urls", **BASE_SERVER) in host.messages


def test_the_cli_s_remote_notice_names_its_flags(capsys, tmp_path):
    from ernie_image.runtime.cli.commands import main

    with FakeSglang(model_id="baidu/ERNIE-Image-Turbo") as server:
        code = main(["generate", "--server", server.url, "--variant", "base", "--prompt", "a fox", "--width", "256",
                     "--height", "256", "--out", str(tmp_path / "a.png")])
    err = capsys.readouterr().err
    assert code == 0, err
    notice = REMOTE.format(url=server.url, own="--steps 8 --cfg 1", urls="--server", **TURBO_SERVER)
    assert notice in err.splitlines()
    assert not any(word in notice for word in ("Loader", "widget", "Sampler"))
