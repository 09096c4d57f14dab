"""A small bf16 ErnieDiT with random weights on a CUDA GPU, one step's inputs for it, and the count of graphs
torch.compile has made: for the GPU tests of compiled DiTs that take LoRAs (test_lora_gpu, test_lora_merge_gpu)."""
from __future__ import annotations

import torch

from ernie_image.runtime.model.dit import DiTConfig, ErnieDiT

TEXT_TOKENS = 24


def compiled_graphs() -> int:
    """Graphs torch.compile has made in this process: a difference of two counts is the recompiles between them."""
    return int(torch._dynamo.utils.counters["stats"]["unique_graphs"])


def random_bf16_dit(config: DiTConfig) -> ErnieDiT:
    """An ErnieDiT of `config` in bf16 on CUDA, seeded: matrices scaled to keep activations O(1)."""
    torch.manual_seed(0)
    with torch.device("cuda"):
        dit = ErnieDiT(config).to(torch.bfloat16)
    with torch.no_grad():
        for param in dit.parameters():
            if param.ndim >= 2:
                param.normal_(0.0, 0.5 / param.shape[-1] ** 0.5)
    return dit.eval().requires_grad_(False)


def step_inputs(config: DiTConfig) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, list[int]]:
    """One 256x256 image's latents, a timestep and 24 text tokens, seeded, in bf16 on CUDA."""
    generator = torch.Generator(device="cuda").manual_seed(1)
    latents = torch.randn((1, 128, 16, 16), device="cuda", generator=generator).bfloat16()
    text = torch.randn((1, TEXT_TOKENS, config.text_in_dim), device="cuda", generator=generator).bfloat16()
    return latents, torch.full((1,), 600.0, device="cuda", dtype=torch.bfloat16), text, [TEXT_TOKENS]
