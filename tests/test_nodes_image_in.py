"""The Samplers' image inputs (IMAGE, LATENT with or without noise_mask, MASK) as ComfyUI passes them."""
from __future__ import annotations

import pytest
import torch

from ernie_image.nodes.sampler import ErnieImageTurboSampler
from ernie_image.runtime.core.errors import InvalidInputError
from ernie_image.runtime.core.host import NullHost
from ernie_image.runtime.core.request import GenerationRequest
from ernie_image.runtime.demo.tiny import build_tiny_model
from ernie_image.runtime.local.options import LoadOptions
from ernie_image.runtime.local.pipe import LocalPipe


@pytest.fixture(scope="module")
def pipe(tmp_path_factory):
    sources = build_tiny_model(tmp_path_factory.mktemp("tiny-nodes-image") / "turbo", layout="comfy", variant="turbo")
    return LocalPipe.load(sources, LoadOptions(device="cpu"))


def inputs(**changes):
    values = dict(prompt="a red fox", resolution="1024x1024 (1:1)", width=1024, height=1024, steps=3, cfg=1.0,
                  seed=3, batch_size=1, shift=4.0, use_pe=False, unique_id="9")
    values.update(changes)
    return values


IMAGE = torch.rand(1, 256, 320, 3)  # what Load Image gives: [B, H, W, 3] float in 0..1


def test_the_image_sets_the_size_and_the_node_equals_the_runtime(pipe):
    images, latent, _ = ErnieImageTurboSampler().generate(pipe=pipe, **inputs(image=IMAGE, denoise=0.5))["result"]
    assert images.shape == (1, 256, 320, 3)  # the preset 1024x1024 is not used: the image decides
    assert latent["samples"].shape == (1, 128, 16, 20)
    request = GenerationRequest(prompt="a red fox", width=320, height=256, steps=3, cfg=1.0, seed=3,
                                init_image=IMAGE, denoise=0.5)
    assert torch.equal(images, pipe.generate(request, NullHost()).images)


def test_the_latent_output_feeds_a_second_pass_and_a_noise_mask_inpaints(pipe):
    first, latent, _ = ErnieImageTurboSampler().generate(pipe=pipe, **inputs(image=IMAGE, denoise=0.6))["result"]
    refined, _, _ = ErnieImageTurboSampler().generate(pipe=pipe, **inputs(latent=latent, denoise=0.4, seed=4))["result"]
    assert refined.shape == first.shape and not torch.equal(refined, first)
    # core SetLatentNoiseMask: s["noise_mask"] = mask.reshape((-1, 1, H, W)), at the image's pixel size
    mask = torch.zeros(1, 256, 320)
    mask[:, 64:192, 96:224] = 1
    masked = {**latent, "noise_mask": mask.reshape(-1, 1, 256, 320)}
    from_latent, _, _ = ErnieImageTurboSampler().generate(pipe=pipe,
                                                          **inputs(latent=masked, denoise=0.7, seed=5))["result"]
    request = GenerationRequest(prompt="a red fox", width=320, height=256, steps=3, cfg=1.0, seed=5,
                                init_latents=latent["samples"], mask=mask, denoise=0.7)
    assert torch.equal(from_latent, pipe.generate(request, NullHost()).images)


def test_a_mask_with_the_image_composites_onto_the_original(pipe):
    mask = torch.zeros(1, 256, 320)
    mask[:, :128, :] = 1
    images, _, _ = ErnieImageTurboSampler().generate(pipe=pipe, **inputs(image=IMAGE, mask=mask, denoise=0.8))["result"]
    assert torch.equal(images[0, 128:], IMAGE[0, 128:])
    kept, _, _ = ErnieImageTurboSampler().generate(pipe=pipe, **inputs(image=IMAGE, mask=mask, denoise=0.8,
                                                                       composite=False))["result"]
    assert not torch.equal(kept[0, 128:], IMAGE[0, 128:])


@pytest.mark.parametrize("changes, expected", [
    (dict(image=IMAGE, mask=torch.zeros(1, 64, 64)), "the mask is Load Image's empty 64x64 mask"),
    (dict(image=IMAGE, mask=torch.zeros(1, 256, 320)), "the mask input is all 0: it marks nothing to repaint"),
    (dict(latent={"samples": torch.zeros(1, 4, 32, 40)}), "the latent input is an SD1.5/SDXL LATENT (4 channels)"),
    (dict(latent={"samples": torch.zeros(1, 16, 32, 40)}), "the latent input is a FLUX.1 / SD3 LATENT (16 channels)"),
    (dict(latent=torch.zeros(1, 128, 16, 20)), "the latent input is not a LATENT"),
    (dict(image=torch.rand(1, 250, 320, 3)), "the image input is 320x250"),
    (dict(image=torch.rand(2, 256, 320, 3), batch_size=3),
     "the image input holds 2 images but the run makes 3: give one (used for every image) or 3, or set batch_size "
     "to 2"),
    (dict(denoise=0.5), "denoise 0.5 needs the image input or the latent input to start from"),
])
def test_bad_image_inputs_are_one_line_before_anything_loads(pipe, changes, expected):
    pipe.release()
    with pytest.raises(InvalidInputError) as caught:
        ErnieImageTurboSampler().generate(pipe=pipe, **inputs(**changes))
    assert expected in str(caught.value) and "\n" not in str(caught.value)
    assert not pipe.is_loaded()
