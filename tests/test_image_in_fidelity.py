"""Image in reproduces a reference built from diffusers' own components, with ComfyUI's KSampler semantics.

The reference: AutoencoderKLFlux2.encode -> latent_dist.mean, the ERNIE pipeline's 2x2 patchify, BatchNorm
normalisation (diffusers' epsilon 1e-5), then ErnieImagePipeline itself with its FlowMatchEulerDiscreteScheduler
held to the truncated sigmas (the last `steps` of int(steps / denoise)) and started from sigma0 * noise +
(1 - sigma0) * x0. Inpainting's reference blends the latent outside the mask back to the noised original after
every scheduler step (a step callback). Tolerance: 1/255 of the decoded image, fp32 on the CPU.
"""
from __future__ import annotations

import pytest
import torch

from ernie_image.runtime.core.host import NullHost
from ernie_image.runtime.core.request import GenerationRequest
from ernie_image.runtime.demo.tiny import build_tiny_model
from ernie_image.runtime.model.vae_decode import denormalise, unpatchify
from ernie_image.runtime.model.vae_encode import encode_images, normalise, patchify
from ernie_image.runtime.sampling.euler import initial_noise, shifted_sigmas
from ernie_image.runtime.sampling.image_in import denoise_sigmas
from reference_models import pipe, reference, tiny_folder  # noqa: F401  (fixtures used by name)

TOLERANCE = 1 / 255


def photo(batch: int, height: int, width: int, seed: int = 0) -> torch.Tensor:
    """A smooth image with structure (gradients and a disc), float32 [B, H, W, 3] in 0..1."""
    generator = torch.Generator().manual_seed(seed)
    y = torch.linspace(0, 1, height).view(height, 1)
    x = torch.linspace(0, 1, width).view(1, width)
    disc = (((y - 0.5) ** 2 + (x - 0.4) ** 2) < 0.08).float()
    base = torch.stack([y.expand(height, width), x.expand(height, width), disc], dim=-1)
    images = base.unsqueeze(0).repeat(batch, 1, 1, 1)
    return (0.8 * images + 0.2 * torch.rand(images.shape, generator=generator)).clamp(0, 1)


def reference_latents(vae, images: torch.Tensor) -> torch.Tensor:
    """diffusers' way: encode -> latent_dist.mean -> the pipeline's patchify -> BatchNorm with epsilon 1e-5."""
    from diffusers import ErnieImagePipeline

    with torch.no_grad():
        mean = vae.encode(images.permute(0, 3, 1, 2) * 2 - 1).latent_dist.mean
    patched = ErnieImagePipeline._patchify_latents(mean)
    bn_mean = vae.bn.running_mean.view(1, -1, 1, 1)
    bn_std = torch.sqrt(vae.bn.running_var.view(1, -1, 1, 1) + 1e-5)
    return (patched - bn_mean) / bn_std


def held_scheduler(reference, steps: int, denoise: float):
    """The pipeline's scheduler, told to run the truncated (unshifted) sigmas whatever the pipeline asks."""
    from diffusers import FlowMatchEulerDiscreteScheduler

    full = torch.linspace(1.0, 0.0, int(steps / denoise) + 1)[:-1]
    held = full[-steps:] if denoise <= 0.9999 else full

    class HeldToSigmas(FlowMatchEulerDiscreteScheduler):
        def set_timesteps(self, *args, device=None, **kwargs):
            super().set_timesteps(sigmas=held.clone(), device=device)

    scheduler = HeldToSigmas.from_config(reference.scheduler.config)
    scheduler.set_timesteps()
    return scheduler


def reference_img2img(reference, request: GenerationRequest, latent_mask=None) -> torch.Tensor:
    """ErnieImagePipeline from x0 noised to the truncated schedule's first sigma; with `latent_mask`, the latent
    outside it is put back on the noised original after each step."""
    scheduler = held_scheduler(reference, request.steps, request.denoise)
    original_scheduler, reference.scheduler = reference.scheduler, scheduler
    try:
        x0 = reference_latents(reference.vae, request.init_image).expand(request.batch, -1, -1, -1)
        noise = initial_noise(request.seed, request.batch, request.width, request.height)
        sigma0 = float(scheduler.sigmas[0])
        start = sigma0 * noise + (1 - sigma0) * x0

        def keep_outside(pipeline, index, timestep, tensors):
            sigma_next = float(scheduler.sigmas[index + 1])
            kept = sigma_next * noise + (1 - sigma_next) * x0
            return {"latents": latent_mask * tensors["latents"] + (1 - latent_mask) * kept}

        output = reference(
            prompt=request.prompt_list(), negative_prompt=[request.negative_prompt] * request.batch,
            width=request.width, height=request.height, num_inference_steps=request.steps,
            guidance_scale=request.cfg, latents=start, output_type="pt", use_pe=False,
            callback_on_step_end=keep_outside if latent_mask is not None else None,
        )
    finally:
        reference.scheduler = original_scheduler
    return output.images.permute(0, 2, 3, 1).float()


def test_the_truncated_schedule_is_ksamplers():
    # KSampler.set_steps: new_steps = int(steps / denoise); sigmas = full[-(steps + 1):]
    assert torch.equal(denoise_sigmas(8, 4.0, 0.4), shifted_sigmas(20, 4.0)[-9:])
    assert torch.equal(denoise_sigmas(8, 4.0, 0.3), shifted_sigmas(26, 4.0)[-9:])  # int(26.67) = 26
    assert torch.equal(denoise_sigmas(8, 4.0, 1.0), shifted_sigmas(8, 4.0))
    assert torch.equal(denoise_sigmas(8, 4.0, 0.99995), shifted_sigmas(8, 4.0))  # above 0.9999: the full schedule
    assert denoise_sigmas(8, 4.0, 0.4)[-1] == 0 and len(denoise_sigmas(8, 4.0, 0.4)) == 9


def test_encoded_latents_match_diffusers_and_the_inverses_hold(pipe, reference):
    images = photo(2, 256, 320)
    ours = encode_images(images, pipe.parts.load_vae_encoder())
    theirs = reference_latents(reference.vae, images)
    assert ours.shape == (2, 128, 16, 20)
    assert (ours - theirs).abs().max().item() < 1e-5
    # patchify and normalise undo the decoder's unpatchify and de-normalisation
    latents = torch.randn(1, 128, 12, 10)
    assert torch.equal(patchify(unpatchify(latents)), latents)
    assert torch.allclose(normalise(denormalise(latents, pipe.parts.load_vae()), pipe.parts.load_vae()), latents, atol=1e-5)


def test_the_encoder_is_the_same_from_bfl_named_single_files(tmp_path, pipe):
    from ernie_image.runtime.formats import open_component
    from ernie_image.runtime.model.builders import build_vae

    comfy = build_tiny_model(tmp_path / "comfy", layout="comfy", variant="base")
    component = open_component(comfy.vae, "vae")
    assert component.layout == "single-file-bfl"
    encoder = build_vae(component, torch.device("cpu"), torch.float32, part="encoder")
    assert encoder.decoder is None and encoder.post_quant_conv is None
    images = photo(1, 256, 256)
    assert torch.equal(encode_images(images, encoder), encode_images(images, pipe.parts.load_vae_encoder()))


def test_large_images_encode_in_diffusers_tiles_and_tiling_is_switched_off_again(pipe, reference):
    encoder = pipe.parts.load_vae_encoder()
    images = photo(1, 512, 512)
    tiled = encode_images(images, encoder, tile=256)
    assert encoder.use_tiling and encoder.tile_latent_min_size == 32 and tiled.shape == (1, 128, 32, 32)
    vae = reference.vae
    vae.enable_tiling()
    vae.tile_sample_min_size, vae.tile_latent_min_size = 256, 32
    try:
        theirs = reference_latents(vae, images)
    finally:
        vae.disable_tiling()
    assert (tiled - theirs).abs().max().item() < 1e-5  # diffusers' overlapping, blended tiles
    whole = encode_images(images, encoder)
    assert not encoder.use_tiling
    assert (whole - reference_latents(vae, images)).abs().max().item() < 1e-5


CASES = {
    "turbo-like 8 steps denoise 0.4": dict(steps=8, cfg=1.0, denoise=0.4, width=256, height=256, seed=1),
    "cfg 4 denoise 0.6 non-square": dict(steps=6, cfg=4.0, denoise=0.6, width=320, height=256, seed=2),
    "batch 2 from one image denoise 0.3": dict(steps=5, cfg=1.0, denoise=0.3, width=256, height=256, seed=3, batch=2),
}


@pytest.mark.parametrize("case", list(CASES), ids=list(CASES))
def test_img2img_matches_the_diffusers_reference(case, pipe, reference):
    settings = CASES[case]
    image = photo(1, settings["height"], settings["width"], seed=settings["seed"])
    request = GenerationRequest(prompt="a quiet harbour", init_image=image, **settings)
    ours = pipe.generate(request, NullHost())
    theirs = reference_img2img(reference, request)
    assert ours.images.shape == theirs.shape == (request.batch, request.height, request.width, 3)
    assert torch.isfinite(ours.images).all()
    assert (ours.images - theirs).abs().max().item() <= TOLERANCE
    assert ours.info["image_encode_s"] >= 0


def test_a_latent_input_is_the_same_job_as_its_image(pipe):
    image = photo(1, 256, 256, seed=4)
    from_image = GenerationRequest(prompt="a lane", init_image=image, denoise=0.5, steps=4, cfg=1.0,
                                   width=256, height=256, seed=5)
    latents = encode_images(image, pipe.parts.load_vae_encoder())
    from_latent = GenerationRequest(prompt="a lane", init_latents=latents, denoise=0.5, steps=4, cfg=1.0,
                                    width=256, height=256, seed=5)
    assert torch.equal(pipe.generate(from_image, NullHost()).images, pipe.generate(from_latent, NullHost()).images)


def test_denoise_one_with_an_image_is_exactly_text_to_image(pipe):
    text_only = GenerationRequest(prompt="a fox", steps=3, cfg=4.0, width=256, height=256, seed=6)
    image = photo(1, 256, 256)
    with_image = GenerationRequest(prompt="a fox", steps=3, cfg=4.0, width=256, height=256, seed=6,
                                   init_image=image, denoise=1.0)
    full_mask = GenerationRequest(prompt="a fox", steps=3, cfg=4.0, width=256, height=256, seed=6,
                                  init_image=image, denoise=1.0, mask=torch.ones(256, 256), composite=False)
    expected = pipe.generate(text_only, NullHost())
    assert torch.equal(pipe.generate(with_image, NullHost()).images, expected.images)
    # a mask over everything repaints everything: still the text-to-image sampling, bit for bit
    assert torch.equal(pipe.generate(full_mask, NullHost()).latents, expected.latents)


def block_mask(height: int, width: int) -> torch.Tensor:
    """1 (repaint) on a 16-pixel-aligned rectangle, so the latent grid sees it exactly."""
    mask = torch.zeros(height, width)
    mask[64:192, 96:224] = 1.0
    return mask


def test_inpainting_matches_the_reference_and_keeps_the_rest_exactly(pipe, reference):
    image = photo(1, 256, 256, seed=7)
    mask = block_mask(256, 256)
    settings = dict(prompt="a red door", steps=6, cfg=1.0, width=256, height=256, seed=8, init_image=image,
                    mask=mask, denoise=0.8)
    raw = pipe.generate(GenerationRequest(**settings, composite=False), NullHost())
    latent_mask = torch.nn.functional.interpolate(mask.view(1, 1, 256, 256), size=(16, 16), mode="bilinear")
    assert set(latent_mask.unique().tolist()) == {0.0, 1.0}
    theirs = reference_img2img(reference, GenerationRequest(**settings, composite=False), latent_mask)
    assert (raw.images - theirs).abs().max().item() <= TOLERANCE

    composited = pipe.generate(GenerationRequest(**settings, composite=True), NullHost()).images
    keep = mask == 0
    assert torch.equal(composited[0][keep], image[0][keep])  # untouched pixels are the original, exactly
    assert torch.equal(composited[0][~keep], raw.images[0][~keep])  # the repainted part is the sampler's
    assert (composited[0][~keep] - image[0][~keep]).abs().mean() > 0.01


def test_a_grown_feathered_mask_blends_softly_and_keeps_far_pixels(pipe):
    image = photo(1, 256, 256, seed=9)
    mask = block_mask(256, 256)
    request = GenerationRequest(prompt="a window", steps=3, cfg=1.0, width=256, height=256, seed=10,
                                init_image=image, mask=mask, denoise=0.7, mask_grow=8, mask_feather=8)
    images = pipe.generate(request, NullHost()).images[0]
    from ernie_image.runtime.sampling.image_in import pixel_mask

    soft = pixel_mask(request)[0, 0]
    assert soft[120, 150] > 0.999 and 0 < soft[56, 150] < 1 and soft[40, 150] == 0  # grown 8 px, feathered 8 px
    far = soft == 0
    assert torch.equal(images[far], image[0][far])
    assert metadata_of(request) == {"init": "image", "denoise": 0.7, "inpaint": True, "mask_grow": 8,
                                    "mask_feather": 8, "composite": True}


def metadata_of(request: GenerationRequest) -> dict:
    keys = ("init", "denoise", "inpaint", "mask_grow", "mask_feather", "composite")
    return {key: value for key, value in request.metadata().items() if key in keys}
