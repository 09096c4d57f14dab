"""The per-step latent preview: a cheap RGB picture of the first image, no VAE."""
from __future__ import annotations

import numpy
import torch

from ernie_image.runtime.sampling.preview import latent_preview


def test_preview_is_the_unpatchified_size_and_capped():
    latents = torch.zeros(2, 128, 20, 16)
    assert latent_preview(latents).size == (32, 40)  # PIL size is (width, height): 2x the latent grid
    assert max(latent_preview(torch.zeros(1, 128, 400, 300)).size) == 512


def test_preview_brightens_where_the_bright_latent_channel_is_high():
    # Unpatchified channel 3 has the largest positive RGB factors; DiT channel 3*4 + 0 holds its (dy=0, dx=0) pixels.
    latents = torch.zeros(1, 128, 8, 8)
    latents[0, 12, :, :4] = 3.0
    pixels = torch.from_numpy(numpy.array(latent_preview(latents))).float()  # [16, 16, 3]
    assert pixels[0::2, 0:8:2].mean() > pixels[0::2, 8::2].mean() + 60
