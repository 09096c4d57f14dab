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

TURBO_UNDER_BASE = ("the model is Turbo, from the transformer config, but these settings (1 step, CFG 4) are meant "
                    "for the base model: Turbo is made for 8 steps at CFG 1: use its settings (in ComfyUI: the Turbo "
                    "Sampler){override} if the model is not Turbo")
BASE_UNDER_TURBO = ("the model is Base, from the transformer config, but these settings (1 step, CFG 1) are meant for "
                    "Turbo: Base is made for 50 steps at CFG 4: use its settings (in ComfyUI: the Sampler){override} "
                    "if the model is not Base")


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
    notice = TURBO_UNDER_BASE.format(override=", or set the Loader's variant widget")
    assert shown["ui"]["text"] == [notice]
    assert f"[ERNIE-Image] {notice}" in caplog.messages
    images, latent, prompt_used = shown["result"]  # it still runs: a notice, not an error
    assert images.shape == (1, 256, 256, 3) and prompt_used == "a red fox"


def test_a_base_model_under_the_turbo_sampler_runs_with_a_notice_on_the_node(base_pipe):
    shown = ErnieImageTurboSampler().generate(pipe=base_pipe, **sampler_inputs(1.0))
    assert shown["ui"]["text"] == [BASE_UNDER_TURBO.format(override=", or set the Loader's variant widget")]
    assert shown["result"][0].shape == (1, 256, 256, 3)


def test_each_sampler_on_its_own_variant_gives_no_notice(turbo_pipe, base_pipe):
    assert ErnieImageTurboSampler().generate(pipe=turbo_pipe, **sampler_inputs(1.0))["ui"]["text"] == [""]
    shown = ErnieImageSampler().generate(pipe=base_pipe, negative_prompt="", **sampler_inputs(4.0))
    assert shown["ui"]["text"] == [""]


def test_the_library_notices_settings_meant_for_the_other_variant(turbo_pipe):
    request = GenerationRequest(prompt="a red fox", width=256, height=256, steps=1, cfg=4.0, settings_for="base")
    host = LoggingHost()
    turbo_pipe.generate(request, host)
    assert TURBO_UNDER_BASE.format(override=", or set variant") in host.messages
    unsaid = LoggingHost()
    turbo_pipe.generate(GenerationRequest(prompt="a red fox", width=256, height=256, steps=1, cfg=4.0), unsaid)
    assert not any("meant for" in message for message in unsaid.messages)  # nobody said whose they are


def test_a_settings_for_that_is_not_a_variant_is_refused_in_one_line(turbo_pipe):
    with pytest.raises(InvalidInputError) as refused:
        turbo_pipe.generate(GenerationRequest(prompt="x", width=256, height=256, settings_for="Turbo"), NullHost())
    assert str(refused.value) == "settings_for 'Turbo' is not allowed: give 'base', 'turbo' or None"


def test_turbo_settings_sent_to_a_base_server_give_a_notice_naming_its_model_id():
    with FakeSglang(model_id="baidu/ERNIE-Image") as server:
        pipe = RemotePipe([server.url])
        host = LoggingHost()
        try:
            pipe.generate(GenerationRequest(prompt="a fox", width=256, height=256, steps=8, cfg=1.0,
                                            settings_for="turbo"), host)
        finally:
            pipe.release()
    assert ("the model is Base, from the served model's id baidu/ERNIE-Image, but these settings (8 steps, CFG 1) are "
            "meant for Turbo: Base is made for 50 steps at CFG 4: use its settings (in ComfyUI: the Sampler), or set "
            "variant if the model is not Base") in host.messages
