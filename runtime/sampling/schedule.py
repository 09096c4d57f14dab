"""ERNIE-Image's flow-match schedule: the sigmas every sampler (text-to-image, img2img) steps through."""
from __future__ import annotations

import torch


def shifted_sigmas(steps: int, shift: float) -> torch.Tensor:
    """steps+1 sigmas from 1 to 0: linspace(1, 0) shifted by s' = shift*s / (1 + (shift-1)*s), terminal 0."""
    sigmas = torch.linspace(1.0, 0.0, steps + 1, dtype=torch.float64)[:-1]
    sigmas = shift * sigmas / (1 + (shift - 1) * sigmas)
    return torch.cat([sigmas, torch.zeros(1, dtype=torch.float64)]).to(torch.float32)

