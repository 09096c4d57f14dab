"""The Samplers over a real tiny local pipe, called as ComfyUI calls them (keyword arguments, no ComfyUI here)."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from ernie_image.nodes.live_pipes import summary, track
from ernie_image.nodes.sampler import ErnieImageSampler, ErnieImageTurboSampler, run_generation
from ernie_image.runtime.core.errors import InvalidInputError, ModelFileError
from ernie_image.runtime.core.host import NullHost
from ernie_image.runtime.core.request import GenerationRequest
from ernie_image.runtime.demo.tiny import build_tiny_model
from ernie_image.runtime.local.options import LoadOptions
from ernie_image.runtime.local.pipe import LocalPipe


@pytest.fixture(scope="module")
def tiny_sources(tmp_path_factory: pytest.TempPathFactory):
    return build_tiny_model(tmp_path_factory.mktemp("tiny") / "turbo", layout="comfy", variant="turbo")


def turbo_inputs(**changes):
    inputs = dict(prompt="a red fox", resolution="custom", width=320, height=256, steps=2, cfg=1.0, seed=3,
                  batch_size=2, shift=4.0, use_pe=True, unique_id="7")
    inputs.update(changes)
    return inputs


def test_turbo_sampler_outputs_image_latent_and_prompt(tiny_sources) -> None:
    pipe = LocalPipe.load(tiny_sources, LoadOptions(device="cpu"))
    images, latent, prompt_used = ErnieImageTurboSampler().generate(pipe=pipe, **turbo_inputs())["result"]
    assert images.shape == (2, 256, 320, 3) and images.dtype == torch.float32
    assert 0.0 <= float(images.min()) and float(images.max()) <= 1.0
    assert latent["samples"].shape == (2, 128, 16, 20)
    assert prompt_used == "a red fox"  # no enhancer loaded: use_pe is harmless and the prompt is kept


def test_node_output_equals_the_runtime_output_for_the_same_seed(tiny_sources) -> None:
    pipe = LocalPipe.load(tiny_sources, LoadOptions(device="cpu"))
    images, _, _ = ErnieImageTurboSampler().generate(pipe=pipe, **turbo_inputs(batch_size=1))["result"]
    request = GenerationRequest(prompt="a red fox", width=320, height=256, steps=2, cfg=1.0, seed=3, use_pe=True)
    reference = LocalPipe.load(tiny_sources, LoadOptions(device="cpu")).generate(request, NullHost())
    assert torch.equal(images, reference.images)


def test_base_sampler_sends_the_negative_prompt_through_cfg(tiny_sources) -> None:
    pipe = LocalPipe.load(tiny_sources, LoadOptions(device="cpu"))
    common = turbo_inputs(batch_size=1, cfg=4.0)
    plain, _, _ = ErnieImageSampler().generate(pipe=pipe, negative_prompt="", **common)["result"]
    negative, _, _ = ErnieImageSampler().generate(pipe=pipe, negative_prompt="blurry, dark", **common)["result"]
    assert not torch.equal(plain, negative)


def test_an_invalid_custom_size_is_refused_before_anything_runs(tiny_sources) -> None:
    pipe = LocalPipe.load(tiny_sources, LoadOptions(device="cpu"))
    with pytest.raises(InvalidInputError, match="width 300 is not allowed"):
        ErnieImageTurboSampler().generate(pipe=pipe, **turbo_inputs(width=300))
    assert not pipe.is_loaded()


def test_an_unconnected_pipe_is_a_clear_error() -> None:
    with pytest.raises(InvalidInputError, match="pipe input is not connected"):
        run_generation(None, GenerationRequest(prompt="x", width=256, height=256), None)


def test_a_failed_run_releases_the_weights(tiny_sources, tmp_path: Path) -> None:
    broken = build_tiny_model(tmp_path / "broken", layout="comfy", variant="turbo")
    pipe = track(LocalPipe.load(broken, LoadOptions(device="cpu")))
    broken.vae.write_bytes(b"not a safetensors file")  # damaged after the Loader checked it
    with pytest.raises(ModelFileError):  # the VAE fails after the text encoder and the DiT have run
        ErnieImageTurboSampler().generate(pipe=pipe, **turbo_inputs(batch_size=1))
    assert not pipe.is_loaded()
    assert summary()["pipes"] and not any(p["loaded"] for p in summary()["pipes"] if p["kind"] == "local")


def test_keep_loaded_keeps_weights_between_runs(tiny_sources) -> None:
    pipe = track(LocalPipe.load(tiny_sources, LoadOptions(device="cpu", keep_loaded=True)))
    first, _, _ = ErnieImageTurboSampler().generate(pipe=pipe, **turbo_inputs(batch_size=1))["result"]
    assert pipe.is_loaded() and any(p["kind"] == "local" and p["loaded"] for p in summary()["pipes"])
    second, _, _ = ErnieImageTurboSampler().generate(pipe=pipe, **turbo_inputs(batch_size=1))["result"]
    assert pipe.is_loaded() and torch.equal(first, second)
    pipe.release()
    assert not pipe.is_loaded()
    assert not any(p["loaded"] for p in summary()["pipes"] if p["kind"] == "local")
