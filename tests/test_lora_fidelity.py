"""A LoRA applied by the pack, merged or as a branch, gives diffusers' image (load_lora_weights + set_adapters) for the layouts diffusers
reads, and the image of a hand-merged DiT for those it does not (kohya, OneTrainer, LoKr, LoHa); fp32 on the CPU,
within 1/255 of the decoded image."""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from ernie_image.runtime.core.host import NullHost
from ernie_image.runtime.core.request import GenerationRequest
from ernie_image.runtime.formats.sources import ModelSources
from ernie_image.runtime.local.options import LoadOptions
from ernie_image.runtime.local.pipe import LocalPipe
from ernie_image.runtime.sampling.euler import initial_noise

import lora_files as lf

TOLERANCE = 1 / 255
REQUEST = GenerationRequest(prompt="a red fox in snow", steps=3, cfg=1.0, width=256, height=256, seed=3)
RANK = 4

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny models: threads only add overhead


@pytest.fixture(scope="module")
def weights(tiny_turbo_folder):
    return lf.dit_weights(tiny_turbo_folder)


@pytest.fixture(scope="module")
def shapes(weights):
    return lf.linear_shapes(weights)


@pytest.fixture(scope="module", params=["merge", "branch"])
def pipe(tiny_turbo_folder, request):
    """Both ways of applying a LoRA: merged into the weights (the default) and as a branch beside them."""
    return LocalPipe.load(ModelSources(model_dir=tiny_turbo_folder),
                          LoadOptions(device="cpu", dtype="fp32", lora_mode=request.param))


@pytest.fixture(scope="module")
def reference(tiny_turbo_folder):
    from diffusers import ErnieImagePipeline

    return ErnieImagePipeline.from_pretrained(str(tiny_turbo_folder), torch_dtype=torch.float32)


def diffusers_image(reference, path: Path, strength: float) -> torch.Tensor:
    reference.load_lora_weights(str(path.parent), weight_name=path.name, adapter_name="test")
    try:
        reference.set_adapters(["test"], adapter_weights=[strength])
        output = reference(prompt=[REQUEST.prompt], width=REQUEST.width, height=REQUEST.height,
                           num_inference_steps=REQUEST.steps, guidance_scale=REQUEST.cfg,
                           latents=initial_noise(REQUEST.seed, 1, REQUEST.width, REQUEST.height),
                           output_type="pt", use_pe=False)
    finally:
        reference.unload_lora_weights()
    return output.images.permute(0, 2, 3, 1).float()


def ours(pipe, path: Path, strength: float) -> torch.Tensor:
    return pipe.with_loras([(path, strength)]).generate(REQUEST, NullHost()).images


@pytest.fixture(scope="module")
def base_image(pipe):
    return pipe.generate(REQUEST, NullHost()).images


def assert_close_and_changed(mine: torch.Tensor, theirs: torch.Tensor, base: torch.Tensor) -> None:
    assert (mine - theirs).abs().max().item() <= TOLERANCE
    assert (mine - base).abs().max().item() > 20 * TOLERANCE  # the LoRA really changes the image


def test_diffusers_layout_with_alpha_in_metadata_matches_diffusers(pipe, reference, shapes, base_image, tmp_path):
    path = lf.write_diffusers(tmp_path, lf.random_lora(shapes, RANK, seed=1), RANK, alpha=2 * RANK)
    assert "lora_adapter_metadata" in lf.read_metadata(path)
    assert_close_and_changed(ours(pipe, path, 0.8), diffusers_image(reference, path, 0.8), base_image)


def test_peft_layout_matches_diffusers(pipe, reference, tiny_turbo_folder, shapes, base_image, tmp_path):
    path = lf.write_peft(tmp_path, tiny_turbo_folder, lf.random_lora(shapes, RANK, seed=2), RANK)
    assert next(iter(lf.load_keys(path))).startswith("base_model.model.")
    assert_close_and_changed(ours(pipe, path, 1.0), diffusers_image(reference, path, 1.0), base_image)


def test_ai_toolkit_layout_matches_diffusers(pipe, reference, shapes, base_image, tmp_path):
    path = lf.write_ai_toolkit(tmp_path / "ai-toolkit.safetensors", lf.random_lora(shapes, RANK, seed=3))
    assert_close_and_changed(ours(pipe, path, -0.7), diffusers_image(reference, path, -0.7), base_image)


def merged_image(tiny_turbo_folder, weights, tmp_path, deltas) -> torch.Tensor:
    merged = lf.merged_dit(tmp_path / "merged.safetensors", weights, deltas)
    pipe = LocalPipe.load(ModelSources(model_dir=tiny_turbo_folder, dit=merged), LoadOptions(device="cpu", dtype="fp32"))
    return pipe.generate(REQUEST, NullHost()).images


def test_kohya_lora_equals_its_merge(pipe, tiny_turbo_folder, weights, shapes, base_image, tmp_path):
    lora = lf.random_lora(shapes, RANK, seed=4)
    path = lf.write_down_up(tmp_path / "kohya.safetensors", lora, alpha=1.0, name=lf.kohya_name)
    deltas = {m: lf.lora_delta(d, u, alpha=1.0) for m, (d, u) in lora.items()}
    assert_close_and_changed(ours(pipe, path, 1.5), merged_image(tiny_turbo_folder, weights, tmp_path, [(deltas, 1.5)]),
                             base_image)


def test_onetrainer_lora_equals_its_merge(pipe, tiny_turbo_folder, weights, shapes, base_image, tmp_path):
    lora = lf.random_lora(shapes, RANK, seed=5)
    path = lf.write_down_up(tmp_path / "onetrainer.safetensors", lora, alpha=8.0, name=lambda m: f"transformer.{m}")
    deltas = {m: lf.lora_delta(d, u, alpha=8.0) for m, (d, u) in lora.items()}
    assert_close_and_changed(ours(pipe, path, 0.5), merged_image(tiny_turbo_folder, weights, tmp_path, [(deltas, 0.5)]),
                             base_image)


@pytest.mark.parametrize("factored_w1", [False, True], ids=["full w1", "factored w1"])
def test_lokr_equals_its_merge(pipe, tiny_turbo_folder, weights, shapes, base_image, tmp_path, factored_w1):
    lokr = lf.random_lokr(shapes, rank=2, seed=6, factored_w1=factored_w1)
    path = lf.write_lycoris(tmp_path / "lokr.safetensors", lokr, alpha=1.0)
    deltas = {m: lf.lokr_delta(parts, alpha=1.0) for m, parts in lokr.items()}
    assert_close_and_changed(ours(pipe, path, 1.0), merged_image(tiny_turbo_folder, weights, tmp_path, [(deltas, 1.0)]),
                             base_image)


def test_loha_equals_its_merge(pipe, tiny_turbo_folder, weights, shapes, base_image, tmp_path):
    loha = lf.random_loha(shapes, rank=3, seed=7)
    path = lf.write_lycoris(tmp_path / "loha.safetensors", loha, alpha=2.0, name=lambda m: f"diffusion_model.{m}")
    deltas = {m: lf.loha_delta(parts, alpha=2.0) for m, parts in loha.items()}
    assert_close_and_changed(ours(pipe, path, 0.9), merged_image(tiny_turbo_folder, weights, tmp_path, [(deltas, 0.9)]),
                             base_image)


def test_two_stacked_loras_equal_both_merged(pipe, tiny_turbo_folder, weights, shapes, base_image, tmp_path):
    first, second = lf.random_lora(shapes, RANK, seed=8), lf.random_lora(shapes, 2, seed=9)
    first_path = lf.write_down_up(tmp_path / "a.safetensors", first, alpha=2.0, name=lf.kohya_name)
    second_path = lf.write_ai_toolkit(tmp_path / "b.safetensors", second)
    deltas = [({m: lf.lora_delta(d, u, 2.0) for m, (d, u) in first.items()}, 0.6),
              ({m: lf.lora_delta(d, u, None) for m, (d, u) in second.items()}, -1.2)]
    stacked = pipe.with_loras([(first_path, 0.6)]).with_loras([(second_path, -1.2)]).generate(REQUEST, NullHost())
    assert [item["name"] for item in stacked.info["loras"]] == ["a.safetensors", "b.safetensors"]
    assert_close_and_changed(stacked.images, merged_image(tiny_turbo_folder, weights, tmp_path, deltas), base_image)
