"""From normalised DiT latents to images: BatchNorm de-normalisation, 2x2 unpatchify, VAE decode."""
from __future__ import annotations

from typing import Optional

import torch

# diffusers hard-codes this epsilon (the VAE config says 1e-4); the reference image depends on it.
BN_EPS = 1e-5
TILED_DECODE_ABOVE_PIXELS = 1536 * 1536  # a larger image is decoded and encoded in tiles of the VAE's sample size


def denormalise(latents: torch.Tensor, vae) -> torch.Tensor:
    mean = vae.bn.running_mean.view(1, -1, 1, 1).to(latents.device, latents.dtype)
    std = torch.sqrt(vae.bn.running_var.view(1, -1, 1, 1) + BN_EPS).to(latents.device, latents.dtype)
    return latents * std + mean


def unpatchify(latents: torch.Tensor) -> torch.Tensor:
    """[B, 128, h, w] -> [B, 32, 2h, 2w]; channel c*4 + 2*dy + dx holds pixel (2y+dy, 2x+dx) of channel c."""
    b, c, h, w = latents.shape
    return latents.reshape(b, c // 4, 2, 2, h, w).permute(0, 1, 4, 2, 5, 3).reshape(b, c // 4, h * 2, w * 2)


def vae_tile(planned: Optional[int], pixels: int, sample_size: int) -> Optional[int]:
    """The tile side a VAE pass over an image of `pixels` pixels runs with: the memory plan's (`planned`) when it
    has one; else, above TILED_DECODE_ABOVE_PIXELS, the VAE's `sample_size`; else None, the whole image at once.
    The planner records this (its plan's table says it) and the pass runs with what the plan records."""
    if planned is None and pixels > TILED_DECODE_ABOVE_PIXELS:
        return sample_size
    return planned


def configure_tiling(vae, tile: Optional[int]) -> None:
    """Decode in overlapping `tile`-pixel tiles, one image at a time (None: whole images, the reference's way)."""
    if tile is None:
        vae.disable_tiling()
        vae.disable_slicing()
        return
    vae.enable_tiling()
    vae.enable_slicing()
    vae.tile_sample_min_size = tile
    vae.tile_latent_min_size = tile // 8


@torch.no_grad()
def decode_images(latents: torch.Tensor, vae, tile: Optional[int] = None) -> torch.Tensor:
    """Normalised latents -> float32 [B, H, W, 3] in 0..1 on the CPU (ComfyUI's IMAGE).

    `tile`: the memory plan's tile side (`vae_tile`); without a plan large images tile by themselves.
    """
    vae_dtype = vae.decoder.conv_in.weight.dtype  # post_quant_conv is None in a VAE built without one
    device = vae.decoder.conv_in.weight.device
    spatial = unpatchify(denormalise(latents.to(device, torch.float32), vae)).to(vae_dtype)
    pixels = spatial.shape[-1] * spatial.shape[-2] * 64
    configure_tiling(vae, vae_tile(tile, pixels, int(vae.config.sample_size)))
    decoded = vae.decode(spatial, return_dict=False)[0]
    return (decoded.float() / 2 + 0.5).clamp(0, 1).permute(0, 2, 3, 1).cpu().contiguous()
