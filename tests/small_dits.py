"""Small ErnieDiTs with random weights for the LoRA tests, on the CPU or a CUDA GPU; one step's inputs for them;
and the count of graphs torch.compile has made."""
from __future__ import annotations

import torch

from ernie_image.runtime.model.dit import DiTConfig, ErnieDiT

TEXT_TOKENS = 24


def compiled_graphs() -> int:
    """Graphs torch.compile has made in this process: a difference of two counts is the recompiles between them."""
    return int(torch._dynamo.utils.counters["stats"]["unique_graphs"])


def scaled_random_dit(config: DiTConfig, device: str = "cpu", dtype: torch.dtype = torch.float32) -> ErnieDiT:
    """An ErnieDiT of `config` built in `dtype` on `device`, seeded: its matrices drawn with std 0.5 / sqrt(fan-in)
    to keep activations O(1), its other parameters as built."""
    torch.manual_seed(0)
    with torch.device(device):
        dit = ErnieDiT(config).to(dtype)
    with torch.no_grad():
        for param in dit.parameters():
            if param.ndim >= 2:
                param.normal_(0.0, 0.5 / param.shape[-1] ** 0.5)
    return dit.eval().requires_grad_(False)


def step_inputs(config: DiTConfig, device: str = "cpu", dtype: torch.dtype = torch.float32
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, list[int]]:
    """One 256x256 image's latents, timestep 600 and 24 text tokens, seeded on `device`, in `dtype`."""
    generator = torch.Generator(device=device).manual_seed(1)
    latents = torch.randn((1, 128, 16, 16), device=device, generator=generator).to(dtype)
    text = torch.randn((1, TEXT_TOKENS, config.text_in_dim), device=device, generator=generator).to(dtype)
    return latents, torch.full((1,), 600.0, device=device, dtype=dtype), text, [TEXT_TOKENS]
