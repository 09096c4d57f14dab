"""The Samplers over a real tiny local pipe, called as ComfyUI calls them (keyword arguments, no ComfyUI here)."""
from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

from ernie_image.nodes.live_pipes import summary, track
from ernie_image.nodes.sampler import ErnieImageSampler, ErnieImageTurboSampler, run_generation
from ernie_image.runtime.core.errors import InvalidInputError, ModelFileError
from ernie_image.runtime.core.host import NullHost
from ernie_image.runtime.core.request import GenerationRequest
from ernie_image.runtime.demo.tiny import TinySizes, build_tiny_model
from ernie_image.runtime.local.options import LoadOptions
from ernie_image.runtime.local.pipe import LocalPipe
from ernie_image.runtime.offload.planner import budget_bytes, gib_shown, gib_up, least_budget
from streaming_budgets import least_budget_gb


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


# -- the Loader's plan: made for a size it assumes, never a refusal of the size the Sampler runs ------------------
# A DiT wide enough (hidden 1024, one block) that a 1024x1024 image needs tenths of a GB more than a 256x256 one:
# the tiny model's figures all round up to 0.1 GB, so a plan text naming either size's would read the same.
WIDE_DIT = TinySizes(dit_hidden=1024, dit_heads=8, dit_ffn=2048, rope_axes=(32, 48, 48), dit_layers=1)


@pytest.fixture(scope="module")
def wide_sources(tmp_path_factory: pytest.TempPathFactory):
    return build_tiny_model(tmp_path_factory.mktemp("wide") / "turbo", layout="comfy", variant="turbo",
                            sizes=WIDE_DIT)


def in_comfy_folders(sources, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> dict[str, str]:
    """ComfyUI's models/ folders holding a model's three files, as the Loader's widgets pick them."""
    import shutil
    import sys

    from comfy_folders import fake_folder_paths

    models = tmp_path / "models"
    picked = {}
    for widget, folder, source in (("diffusion_model", "diffusion_models", sources.dit),
                                   ("text_encoder", "text_encoders", sources.text_encoder),
                                   ("vae", "vae", sources.vae)):
        (models / folder).mkdir(parents=True)
        shutil.copyfile(source, models / folder / source.name)
        picked[widget] = source.name
    monkeypatch.setitem(sys.modules, "folder_paths", fake_folder_paths(models))
    return picked


@pytest.fixture
def comfy_models(tiny_sources, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> dict[str, str]:
    return in_comfy_folders(tiny_sources, tmp_path, monkeypatch)


@pytest.fixture
def wide_comfy_models(wide_sources, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> dict[str, str]:
    return in_comfy_folders(wide_sources, tmp_path, monkeypatch)


def load_in_comfyui(models: dict[str, str], budget_gb: float) -> tuple[LocalPipe, str]:
    from ernie_image.nodes.loader import ErnieImageLoader

    pipe, text = ErnieImageLoader().load(diffusers_folder="(none)", prompt_enhancer="(none)", variant="auto",
                                         vram_budget_gb=budget_gb, keep_loaded=False, **models)["result"]
    return pipe, text


def plan_device() -> str:
    """Where the Loader's pipe plans: its device 'auto'."""
    return "cuda" if torch.cuda.is_available() else "cpu"


LOADER_PLAN_BELOW = re.compile(
    r"^VRAM plan for a 1024x1024 image: this budget \((?P<budget>[\d.]+) GiB\) is below the (?P<needed>[\d.]+) GiB a "
    r"1024x1024 image needs at least \(batch 1, CFG 1\); the Sampler checks its own size before it starts, and a "
    r"smaller image needs less$")


def planned_least_gb(pipe: LocalPipe, width: int, height: int) -> str:
    """The least budget the planner computes for a `width` x `height` image of `pipe`'s defaults (batch 1, no PE),
    rounded up to 0.1 GB as plan texts show it."""
    job = pipe.memory.job_for(GenerationRequest(prompt="", width=width, height=height).with_defaults(pipe.variant),
                              use_pe=False)
    return gib_up(least_budget(job, pipe.memory.planning_sizes(pipe.sources, pipe.variant), plan_device()))


@pytest.mark.parametrize("between", [0.1, 0.5, 0.9])
def test_a_budget_too_small_for_1024_but_enough_for_the_samplers_size_is_no_refusal_on_the_loader(
        wide_sources, wide_comfy_models, between) -> None:
    """Any budget between what the Sampler's 256x256 needs and what 1024x1024 needs: the Loader's text gives the
    budget and the planner's own least budget for 1024x1024 (figures more than their 0.1 GB rounding apart from
    the budget's and 256x256's), and the Sampler's size runs."""
    small = turbo_inputs(width=256, height=256, batch_size=1, use_pe=False)
    request = GenerationRequest(prompt="a red fox", width=256, height=256, steps=2, cfg=1.0, seed=3)
    least_small = least_budget_gb(wide_sources, request, plan_device())
    least_1024 = least_budget_gb(wide_sources, GenerationRequest(prompt="", width=1024, height=1024), plan_device())
    assert least_1024 - least_small > 0.2  # the figures below differ by more than their rounding
    budget = least_small + between * (least_1024 - least_small)
    pipe, text = load_in_comfyui(wide_comfy_models, budget)
    plan_lines = [line for line in text.splitlines() if line.startswith("VRAM plan")]
    said = LOADER_PLAN_BELOW.match(plan_lines[0]) if len(plan_lines) == 1 else None
    assert said, text
    needed = planned_least_gb(pipe, 1024, 1024)
    assert said["needed"] == needed != planned_least_gb(pipe, 256, 256)
    assert float(needed) - 0.1 < least_1024 <= float(needed)  # the least budget that plans, rounded up
    assert said["budget"] == gib_shown(budget_bytes(budget)) and "raise the budget" not in text
    images, _, _ = ErnieImageTurboSampler().generate(pipe=pipe, **small)["result"]  # the Sampler's size fits
    assert images.shape == (1, 256, 256, 3)


def test_a_plan_that_fits_is_labelled_with_the_size_it_is_for(tiny_sources, comfy_models) -> None:
    least_1024 = least_budget_gb(tiny_sources, GenerationRequest(prompt="", width=1024, height=1024), plan_device())
    _, text = load_in_comfyui(comfy_models, least_1024 + 0.5)
    plan_lines = [line for line in text.splitlines() if line.startswith("VRAM plan")]
    assert len(plan_lines) == 1 and plan_lines[0].startswith(
        "VRAM plan for a 1024x1024 image (the Sampler checks its own size before it starts): budget "), text
    assert "; 1024x1024, batch 1, CFG 1 (" in plan_lines[0] and "\npeak by phase (GiB): " in text  # the whole plan
