"""Image in on CUDA (tiny models): the same job as on the CPU within bf16 tolerance, inside a small budget, with
the encoder's device memory handed back after its phase."""
from __future__ import annotations

import pytest
import torch

from ernie_image.runtime.core.host import NullHost
from ernie_image.runtime.core.request import GenerationRequest
from ernie_image.runtime.formats.sources import ModelSources
from ernie_image.runtime.local.options import LoadOptions
from ernie_image.runtime.local.pipe import LocalPipe

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def test_img2img_and_inpainting_on_cuda_match_the_cpu_and_free_the_encoder(tiny_turbo_folder):
    sources = ModelSources(model_dir=tiny_turbo_folder)
    image = torch.rand((1, 512, 512, 3), generator=torch.Generator().manual_seed(0))
    mask = torch.zeros(512, 512)
    mask[128:384, 128:384] = 1
    request = GenerationRequest(prompt="a harbour", width=512, height=512, steps=4, cfg=1.0, seed=1,
                                init_image=image, denoise=0.5, mask=mask, mask_feather=8)
    cpu = LocalPipe.load(sources, LoadOptions(device="cpu", dtype="fp32")).generate(request, NullHost()).images
    gpu_pipe = LocalPipe.load(sources, LoadOptions(device="cuda", dtype="bf16", vram_budget_gb=2.0, compile=False))
    try:
        result = gpu_pipe.generate(request, NullHost())
        assert gpu_pipe.memory.plan.encode is not None
        assert gpu_pipe.parts.vae_encoder is None or gpu_pipe.memory.encoder_is_persistent()
        assert (result.images - cpu).abs().mean().item() < 0.02
        from ernie_image.runtime.sampling.image_in import pixel_mask

        kept = pixel_mask(request)[0, 0] == 0  # outside the feathered edge
        assert torch.equal(result.images[0][kept], image[0][kept])  # composited, exactly, on any device
    finally:
        gpu_pipe.release()
