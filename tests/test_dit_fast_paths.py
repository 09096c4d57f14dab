"""The speed levers keep diffusers' numbers: fused projections, length-grouped CFG batches, regional compile.

Bounds: float32 on the CPU, relative L2 error <= 1e-5 (only summation order changes); bf16 on a GPU with the
compiled blocks, <= 1e-2 (bf16 keeps 8 mantissa bits, 3.9e-3 per rounding; fused kernels round in another
order; measured 8e-4 on the full-size model on the H200).
"""
from __future__ import annotations

import pytest
import torch

from ernie_image.runtime.model.compile import compile_blocks, fuse_projections
from ernie_image.runtime.model.dit import ErnieDiT
from ernie_image.runtime.sampling.euler import length_grouped_denoiser
from reference_models import DIT_CONFIG as CONFIG, diffusers_dit, random_dit, relative_error


def models(device: str, dtype: torch.dtype):
    ours = random_dit(device, dtype)
    return ours, diffusers_dit(ours)


def cfg_batch(device: str, dtype: torch.dtype):
    generator = torch.Generator().manual_seed(1)
    latents = torch.randn(2, 128, 12, 10, generator=generator).to(device, dtype)
    timestep = torch.full((2,), 730.0).to(device, dtype)
    negative, positive = torch.randn(1, 96, generator=generator), torch.randn(9, 96, generator=generator)
    rows = [negative.to(device, dtype), positive.to(device, dtype)]
    padded = torch.zeros(2, 9, 96, dtype=dtype, device=device)
    padded[0, :1], padded[1] = rows[0], rows[1]
    return latents, timestep, rows, padded, torch.tensor([1, 9], device=device)


@torch.inference_mode()
def test_fused_projections_and_length_groups_match_diffusers_in_float32():
    ours, reference = models("cpu", torch.float32)
    latents, timestep, rows, padded, lens = cfg_batch("cpu", torch.float32)
    want = reference(latents, timestep, padded, lens, return_dict=False)[0]
    assert fuse_projections(ours) == 2 * CONFIG.num_layers
    got = length_grouped_denoiser(ours, rows, "cpu", torch.float32)(latents, timestep)
    assert relative_error(got, want) <= 1e-5


TEXT_ROWS = {  # text lengths of the rows of a batch: the call groups they make
    "one prompt": [9],
    "CFG, negative shorter": [1, 9],
    "a batch of three, two lengths": [4, 7, 4],
}


@pytest.mark.parametrize("lengths", list(TEXT_ROWS.values()), ids=list(TEXT_ROWS))
@torch.inference_mode()
def test_text_projected_once_for_the_run_gives_every_step_the_same_velocity_bit_for_bit(lengths):
    ours = random_dit("cpu", torch.float32)
    generator = torch.Generator().manual_seed(2)
    rows = [torch.randn(length, CONFIG.text_in_dim, generator=generator) for length in lengths]
    latents = torch.randn(len(lengths), 128, 6, 4, generator=generator)
    projected: list[int] = []
    ours.text_proj.register_forward_hook(lambda module, args, output: projected.append(args[0].shape[0]))
    per_step = length_grouped_denoiser(ours, rows, "cpu", torch.float32)  # the forward projects in every call
    once = length_grouped_denoiser(ours, rows, "cpu", torch.float32, ours.project_text)
    groups = len(set(lengths))
    assert len(projected) == groups
    for step in range(3):
        timestep = torch.full((len(lengths),), 900.0 - 300 * step)
        assert torch.equal(once(latents, timestep), per_step(latents, timestep))
    assert len(projected) == groups + 3 * groups  # only the per-step denoiser projected again, once per call


def bf16_error_against_diffusers_on_the_gpu(compiled: bool) -> tuple[ErnieDiT, float]:
    """Our bf16 DiT on CUDA, projections fused and its blocks compiled or not, run on a CFG batch of two length
    groups; that DiT, and the relative error of its (finite) output against diffusers' on the same weights."""
    ours, reference = models("cuda", torch.bfloat16)
    latents, timestep, rows, padded, lens = cfg_batch("cuda", torch.bfloat16)
    want = reference(latents, timestep, padded, lens, return_dict=False)[0]
    fuse_projections(ours)
    if compiled:
        assert compile_blocks(ours)
    got = length_grouped_denoiser(ours, rows, "cuda", torch.bfloat16)(latents, timestep)
    assert torch.isfinite(got).all()
    return ours, relative_error(got, want)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@torch.inference_mode()
def test_compiled_bf16_fast_path_matches_diffusers_on_the_gpu():
    _, error = bf16_error_against_diffusers_on_the_gpu(compiled=True)
    assert error <= 1e-2
