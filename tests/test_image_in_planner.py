"""The VRAM planner with an image in: the VAE encoder's weights and activations as a phase of their own, and a
2048x2048 second pass (16,384 image tokens) inside 12 GB."""
from __future__ import annotations

import torch

from ernie_image.runtime.core.request import GenerationRequest
from ernie_image.runtime.formats.config_json import load_config
from ernie_image.runtime.local.memory import PipeMemory
from ernie_image.runtime.offload.planner import GiB, allocator_slack, plan_memory
from ernie_image.runtime.offload.reserve import phase_needs
from ernie_image.runtime.offload.sizes import ModelSizes, vae_encoder_bytes
from ernie_image.runtime.offload.workspace import Job, dit_workspace, vae_encode_workspace

SIZES = ModelSizes.released("turbo")
HIRES = Job(2048, 2048, 1, 1.0, 512, encode=True)


def test_encoder_bytes_are_the_released_encoders_parameters():
    from diffusers import AutoencoderKLFlux2

    config = {k: v for k, v in load_config("turbo", "vae").items() if not k.startswith("_") and k != "force_upcast"}
    with torch.device("meta"):
        vae = AutoencoderKLFlux2.from_config(config)
    params = sum(p.numel() for name, p in vae.named_parameters() if name.startswith(("encoder.", "quant_conv.")))
    assert params == 34_425_856
    assert vae_encoder_bytes(load_config("turbo", "vae"), 2) == 2 * params + 2 * 128 * 4  # + fp32 BatchNorm mean and variance
    assert SIZES.vae_encoder_bytes == vae_encoder_bytes(load_config("turbo", "vae"), 2)


def test_dit_workspace_scales_with_image_tokens():
    fixed = 192 * 1024**2
    small = dit_workspace(SIZES, Job(1024, 1024, text_tokens=512)) - fixed
    large = dit_workspace(SIZES, Job(2048, 2048, text_tokens=512)) - fixed
    assert abs(large / small - (16384 + 512) / (4096 + 512)) < 0.01  # linear in tokens: flash attention holds no SxS


def test_encode_workspace_grows_with_pixels_and_tiles_bound_it():
    whole_1024 = vae_encode_workspace(SIZES, Job(1024, 1024, encode=True), None)
    whole_768 = vae_encode_workspace(SIZES, Job(768, 768, encode=True), None)
    tiled_2048 = vae_encode_workspace(SIZES, HIRES, 512)
    assert whole_768 < whole_1024
    assert tiled_2048 < whole_1024  # a 512 tile's maps and attention, plus the whole input on the device
    # above the decoder's threshold a 'whole image' pass runs in tiles of the VAE's sample size by itself
    assert vae_encode_workspace(SIZES, HIRES, None) < 1.2 * whole_1024


def test_a_2048_second_pass_fits_12_gb_with_every_phase_inside_it():
    plan = plan_memory(12 * GiB, HIRES, SIZES)
    usable = plan.budget - allocator_slack(plan.budget)
    assert set(plan.phase_peaks) == {"encode", "text", "dit", "vae"}
    assert all(peak <= usable for peak in plan.phase_peaks.values()), plan.table()
    assert plan.encode.tile == 512 and not plan.encode.persistent  # loaded for its phase, then dropped
    assert len(plan.dit.resident) >= 12  # the VAE's work at 2048 does not push the DiT out
    assert "VAE encode   loaded for its phase, then dropped, 512-pixel tiles" in plan.table()
    assert "VAE decode   resident, 1024-pixel tiles" in plan.table()  # a 2048 image tiles by itself: the plan says so


def test_an_image_job_costs_at_most_a_block_more_than_text_to_image():
    text_only = plan_memory(12 * GiB, Job(2048, 2048, 1, 1.0, 512), SIZES)
    with_image = plan_memory(12 * GiB, HIRES, SIZES)
    assert len(text_only.dit.resident) - len(with_image.dit.resident) <= 1
    assert text_only.encode is None and "VAE encode" not in text_only.table()


def test_a_large_budget_keeps_the_encoder_resident():
    plan = plan_memory(80 * GiB, Job(1024, 1024, encode=True), SIZES)
    assert plan.all_resident and plan.encode.persistent and plan.encode.tile is None
    assert plan.phase_peaks["encode"] <= plan.budget


def test_the_host_is_asked_for_the_encode_phase_only_when_the_job_encodes():
    assert "encode" not in phase_needs(SIZES, Job(1024, 1024))
    need = phase_needs(SIZES, Job(1024, 1024, encode=True))["encode"]
    assert need.weights == SIZES.vae_encoder_bytes and need.workspace > 0


def test_jobs_encode_only_when_they_need_the_images_latents():
    image = torch.rand(1, 256, 256, 3)
    common = dict(prompt="x", width=256, height=256)
    assert PipeMemory.job_for(GenerationRequest(**common, init_image=image, denoise=0.5), False).encode
    assert PipeMemory.job_for(GenerationRequest(**common, init_image=image, mask=torch.ones(256, 256)), False).encode
    assert not PipeMemory.job_for(GenerationRequest(**common, init_image=image, denoise=1.0), False).encode
    latents = torch.zeros(1, 128, 16, 16)
    assert not PipeMemory.job_for(GenerationRequest(**common, init_latents=latents, denoise=0.5), False).encode


def test_a_budgeted_pipe_plans_encodes_and_drops_the_encoder(tiny_turbo_folder):
    from ernie_image.runtime.core.host import NullHost
    from ernie_image.runtime.formats.sources import ModelSources
    from ernie_image.runtime.local.options import LoadOptions
    from ernie_image.runtime.local.pipe import LocalPipe

    sources = ModelSources(model_dir=tiny_turbo_folder)
    request = GenerationRequest(prompt="x", width=256, height=256, steps=2, cfg=1.0, init_image=torch.rand(1, 256, 256, 3),
                                denoise=0.5)
    free = LocalPipe.load(sources, LoadOptions(device="cpu"))
    budgeted = LocalPipe.load(sources, LoadOptions(device="cpu", vram_budget_gb=0.5, keep_loaded=True))
    images = budgeted.generate(request, NullHost()).images
    assert budgeted.memory.plan.encode is not None and "VAE encode" in budgeted.memory.describe()
    assert torch.equal(images, free.generate(request, NullHost()).images)
