"""Token sampling on the PE's own device: no copy of the vocabulary to the host, no CPU draw per token.

transformers' warpers in generate's order, restricted to what survives them: temperature, top-k (the k largest),
top-p over those k (the same ascending cumulative-softmax rule as TopPLogitsWarper, whose softmax over the full
vocabulary is the softmax over the k survivors, the others being -inf), then multinomial's exponential race
(argmax of probs / q, q ~ Exp(1)) over the kept candidates only, drawn from a private generator on the device.
About ten small kernels on 131072 + k floats, queued behind the decode step; the host reads back one token id.

The generator is seeded from the request's seed and belongs to this call: a seed and prompt give the same rewrite
on the same device whatever else used the global RNG. It is not the CPU path's draw (that one consumes one Exp(1)
per vocabulary entry from a CPU generator), so a seed's rewrite on a GPU may differ from the same seed's on the CPU.
Ties at the k-th logit keep the first k in topk's order (transformers keeps every tie): exact float ties of the
logits there are the only difference in the kept set.
"""
from __future__ import annotations

import torch

from ..core.request import SEED_MASK


class DeviceTokenDraws:
    """`sample(logits)` -> the next token as a [1] int64 tensor on the logits' device (no host sync)."""

    def __init__(self, temperature: float, top_k: int, top_p: float, seed: int, device: torch.device) -> None:
        if temperature <= 0:
            raise ValueError("device sampling is for temperature > 0; greedy decoding takes the argmax")
        self.temperature = float(temperature)
        self.top_k = int(top_k)
        self.top_p = float(top_p)
        self.generator = torch.Generator(device=device).manual_seed(int(seed) & SEED_MASK)

    def sample(self, logits: torch.Tensor) -> torch.Tensor:
        """One token from float32 `logits` [1, vocab]."""
        scores = logits.reshape(-1)
        if self.temperature != 1.0:
            scores = scores / self.temperature
        k = scores.numel() if self.top_k <= 0 else min(self.top_k, scores.numel())
        kept, indices = torch.topk(scores, k)  # descending
        if self.top_p < 1.0:
            ascending = kept.flip(0)
            cumulative = ascending.softmax(dim=-1).cumsum(dim=-1)
            remove = cumulative <= (1 - self.top_p)
            remove[-1] = False  # min_tokens_to_keep=1: the most likely token always stays
            kept = kept.masked_fill(remove.flip(0), -float("inf"))
        probs = kept.softmax(dim=-1)
        race = torch.empty_like(probs).exponential_(1, generator=self.generator)
        return indices.gather(0, torch.argmax(probs / race).reshape(1))
