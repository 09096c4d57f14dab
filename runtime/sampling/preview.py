"""A cheap latent -> RGB preview (no VAE): a fixed 32x3 projection of the unpatchified latent.

The factors are the published Flux.2 latent-to-RGB fit (ERNIE-Image uses the Flux.2 VAE and its
BatchNorm-normalised latent space), the same numbers ComfyUI uses for its Flux2 latent previews.
"""
from __future__ import annotations

import torch

from ..model.vae_decode import unpatchify

_FACTORS = [
    [0.0058, 0.0113, 0.0073], [0.0495, 0.0443, 0.0836], [-0.0099, 0.0096, 0.0644], [0.2144, 0.3009, 0.3652],
    [0.0166, -0.0039, -0.0054], [0.0157, 0.0103, -0.0160], [-0.0398, 0.0902, -0.0235], [-0.0052, 0.0095, 0.0109],
    [-0.3527, -0.2712, -0.1666], [-0.0301, -0.0356, -0.0180], [-0.0107, 0.0078, 0.0013], [0.0746, 0.0090, -0.0941],
    [0.0156, 0.0169, 0.0070], [-0.0034, -0.0040, -0.0114], [0.0032, 0.0181, 0.0080], [-0.0939, -0.0008, 0.0186],
    [0.0018, 0.0043, 0.0104], [0.0284, 0.0056, -0.0127], [-0.0024, -0.0022, -0.0030], [0.1207, -0.0026, 0.0065],
    [0.0128, 0.0101, 0.0142], [0.0137, -0.0072, -0.0007], [0.0095, 0.0092, -0.0059], [0.0000, -0.0077, -0.0049],
    [-0.0465, -0.0204, -0.0312], [0.0095, 0.0012, -0.0066], [0.0290, -0.0034, 0.0025], [0.0220, 0.0169, -0.0048],
    [-0.0332, -0.0457, -0.0468], [-0.0085, 0.0389, 0.0609], [-0.0076, 0.0003, -0.0043], [-0.0111, -0.0460, -0.0614],
]
_BIAS = [-0.0329, -0.0718, -0.0851]


_projection_cache: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = {}


def _projection(device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    cached = _projection_cache.get(device)
    if cached is None:
        cached = (torch.tensor(_FACTORS, dtype=torch.float32, device=device),
                  torch.tensor(_BIAS, dtype=torch.float32, device=device))
        _projection_cache[device] = cached
    return cached


def preview_pixels(latents: torch.Tensor) -> torch.Tensor:
    """The first image of normalised DiT latents [B,128,h,w] as RGB bytes [2h, 2w, 3] (uint8), computed where the
    latents are: only these few bytes ever need to reach the host."""
    factors, bias = _projection(latents.device)
    spatial = unpatchify(latents[:1].float())[0]  # [32, 2h, 2w]
    rgb = torch.einsum("chw,cr->hwr", spatial, factors) + bias
    return ((rgb + 1) / 2).clamp(0, 1).mul(255).round().to(torch.uint8)


def preview_image(pixels: torch.Tensor, max_side: int = 512):
    """RGB bytes [H, W, 3] on the host -> a PIL image of their own (the tensor may be reused), capped at max_side."""
    from PIL import Image

    image = Image.fromarray(pixels.numpy())  # an RGB image copies the bytes
    if max(image.size) > max_side:
        image.thumbnail((max_side, max_side))
    return image
