"""From images to normalised DiT latents: VAE encode (posterior mean), 2x2 patchify, BatchNorm normalisation.

The inverse of vae_decode.py, step by step: `patchify` undoes `unpatchify`, `normalise` undoes `denormalise` with the
same epsilon. The posterior's mean, not a sample, as ComfyUI's VAE Encode and diffusers' pipelines ("argmax") take
it: the same image always gives the same latents.
"""
from __future__ import annotations

from typing import Optional

import torch

from .vae_decode import BN_EPS, configure_tiling, vae_tile


def normalise(latents: torch.Tensor, vae) -> torch.Tensor:
    mean = vae.bn.running_mean.view(1, -1, 1, 1).to(latents.device, latents.dtype)
    std = torch.sqrt(vae.bn.running_var.view(1, -1, 1, 1) + BN_EPS).to(latents.device, latents.dtype)
    return (latents - mean) / std


def patchify(latents: torch.Tensor) -> torch.Tensor:
    """[B, 32, 2h, 2w] -> [B, 128, h, w]; pixel (2y+dy, 2x+dx) of channel c goes to channel c*4 + 2*dy + dx."""
    b, c, h, w = latents.shape
    return latents.reshape(b, c, h // 2, 2, w // 2, 2).permute(0, 1, 3, 5, 2, 4).reshape(b, c * 4, h // 2, w // 2)


def encoder_weight(vae) -> torch.Tensor:
    return vae.encoder.conv_in.weight


@torch.no_grad()
def encode_images(images: torch.Tensor, vae, tile: Optional[int] = None) -> torch.Tensor:
    """float32 [B, H, W, 3] in 0..1 (ComfyUI's IMAGE) -> normalised latents [B, 128, H/16, W/16], float32 on the
    VAE's device.

    `tile`: the memory plan's tile side (vae_decode.vae_tile); without a plan large images tile by themselves.
    """
    weight = encoder_weight(vae)
    pixels = images.to(weight.device, torch.float32).permute(0, 3, 1, 2) * 2 - 1
    configure_tiling(vae, vae_tile(tile, images.shape[1] * images.shape[2], int(vae.config.sample_size)))
    moments = vae.encode(pixels.to(weight.dtype), return_dict=False)[0]
    mean = moments.mean.float()  # DiagonalGaussianDistribution: the posterior mean, no sampling
    return normalise(patchify(mean), vae)
