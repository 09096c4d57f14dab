"""The runtime reproduces diffusers' ErnieImagePipeline: same weights, same noise, same settings -> same image.

Tolerance: max abs difference of the decoded image (0..1) <= 1e-4 in float32 on the CPU.
"""
from __future__ import annotations

import pytest
import torch

from ernie_image.runtime.core.host import NullHost
from ernie_image.runtime.core.request import GenerationRequest
from ernie_image.runtime.sampling.euler import initial_noise
from reference_models import pipe, reference, tiny_folder  # noqa: F401  (fixtures used by name)

TOLERANCE = 1e-4


def reference_images(reference, request: GenerationRequest) -> torch.Tensor:
    prompts = request.prompt_list()
    output = reference(
        prompt=prompts,
        negative_prompt=[request.negative_prompt] * len(prompts),
        width=request.width,
        height=request.height,
        num_inference_steps=request.steps,
        guidance_scale=request.cfg,
        latents=initial_noise(request.seed, request.batch, request.width, request.height),
        output_type="pt",
        use_pe=False,
    )
    return output.images.permute(0, 2, 3, 1).float()


CASES = {
    "turbo preset 8 steps cfg 1": GenerationRequest(prompt="a red fox in snow", steps=8, cfg=1.0, width=256, height=256, seed=1),
    "base preset 50 steps cfg 4": GenerationRequest(prompt="a lighthouse at dusk", steps=50, cfg=4.0, width=256, height=256, seed=2),
    "negative prompt": GenerationRequest(prompt="a cat", negative_prompt="blurry, low quality", steps=4, cfg=4.0,
                                         width=256, height=256, seed=3),
    "batch 2 prompts of different lengths": GenerationRequest(
        prompt="", prompts=("a cat", "an old stone bridge over a river, autumn, oil painting"), batch=2,
        steps=4, cfg=4.0, width=256, height=256, seed=4),
    "non-square 256x384 cfg off": GenerationRequest(prompt="a tall tower", steps=4, cfg=1.0, width=256, height=384, seed=5),
    "non-square 400x272 cfg on": GenerationRequest(prompt="a wide valley", steps=4, cfg=3.0, width=400, height=272, seed=6),
    "empty prompt is one BOS token": GenerationRequest(prompt="", steps=2, cfg=4.0, width=256, height=256, seed=7),
}


@pytest.mark.parametrize("case", list(CASES), ids=list(CASES))
def test_image_matches_diffusers(case, pipe, reference):
    request = CASES[case]
    ours = pipe.generate(request, NullHost()).images
    theirs = reference_images(reference, request)
    assert ours.shape == (request.batch, request.height, request.width, 3)
    assert torch.isfinite(ours).all()
    assert (ours - theirs).abs().max().item() <= TOLERANCE


def test_batch_images_differ_and_seed_reproduces(pipe):
    request = GenerationRequest(prompt="a fox", batch=2, steps=2, cfg=1.0, width=256, height=256, seed=11)
    first = pipe.generate(request, NullHost())
    again = pipe.generate(request, NullHost())
    assert torch.equal(first.images, again.images)
    assert (first.images[0] - first.images[1]).abs().max() > 0.05


def test_noise_is_comfyui_draw():
    expected = torch.randn((2, 128, 16, 24), dtype=torch.float32, generator=torch.manual_seed(42), device="cpu")
    assert torch.equal(initial_noise(42, 2, 384, 256), expected)


def test_latent_output_is_normalised_dit_space(pipe):
    from ernie_image.runtime.model.vae_decode import decode_images

    result = pipe.generate(GenerationRequest(prompt="x", steps=2, cfg=1.0, width=256, height=320), NullHost())
    assert result.latents.shape == (1, 128, 20, 16)  # the DiT's 128 channels at 1/16 of the image, not the VAE's 32
    # Still BatchNorm-normalised: the decoder's de-normalisation turns them into exactly the returned image.
    assert torch.equal(decode_images(result.latents, pipe.parts.load_vae()), result.images)


def test_progress_and_cancel_between_steps(pipe):
    from ernie_image.runtime.core.errors import Cancelled

    class CancelAfterTwo(NullHost):
        def progress(self, value, total, preview=None):
            super().progress(value, total, preview)
            if value == 2:
                self.cancel_requested = True

    host = CancelAfterTwo()
    with pytest.raises(Cancelled):
        pipe.generate(GenerationRequest(prompt="x", steps=6, cfg=1.0, width=256, height=256), host)
    assert host.progress_calls == [(1, 6), (2, 6)]


def test_tiled_decode_stays_close_to_whole_and_is_switched_off_again(pipe):
    from ernie_image.runtime.model.vae_decode import decode_images

    latents = pipe.generate(GenerationRequest(prompt="x", steps=2, cfg=1.0, width=512, height=512), NullHost()).latents
    vae = pipe.parts.load_vae()
    whole = decode_images(latents, vae)
    tiled = decode_images(latents, vae, tile=256)
    assert vae.use_tiling and vae.tile_latent_min_size == 32
    assert tiled.shape == whole.shape == (1, 512, 512, 3)
    assert (tiled - whole).abs().mean().item() < 0.05  # overlapping tiles are blended: close, not identical
    decode_images(latents, vae)
    assert not vae.use_tiling
