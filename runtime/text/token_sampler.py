"""Seeded autoregressive sampling for the prompt enhancer, with transformers' sampling semantics.

Same maths as `model.generate(do_sample=True, temperature, top_k, top_p)` (the warpers are transformers' own,
applied in generate's order to float32 logits), but every draw comes from a private CPU `torch.Generator`: the
global RNG is neither read nor changed, and a seed gives the same tokens whatever ran before. Drawing on the
CPU also keeps a seed's tokens independent of the GPU model, as long as the logits agree.
Cancel is checked between tokens.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable, Optional, Sequence

import torch

from ..request import SEED_MASK

# transformers' generate() applies top_k=50 when neither the call nor generation_config.json sets it.
TRANSFORMERS_DEFAULT_TOP_K = 50


@dataclass(frozen=True)
class SamplingSettings:
    temperature: float = 0.6
    top_p: float = 0.95
    top_k: int = TRANSFORMERS_DEFAULT_TOP_K  # 0: off
    max_new_tokens: int = 512
    min_new_tokens: int = 0  # EOS is masked until this many tokens exist (benchmarks with random weights)

    @property
    def greedy(self) -> bool:
        # Temperature 0 means greedy, as in vLLM and SGLang. (diffusers instead turns sampling off exactly when
        # temperature == 1 and top_p == 1, which silently makes "plain sampling" greedy; not copied.)
        return self.temperature <= 0.0


@dataclass
class SampledTokens:
    token_ids: list[int]
    prefill_s: float
    decode_s: float
    stopped_by_eos: bool

    @property
    def seconds(self) -> float:
        return self.prefill_s + self.decode_s


def _warpers(settings: SamplingSettings):
    from transformers.generation.logits_process import (
        LogitsProcessorList,
        TemperatureLogitsWarper,
        TopKLogitsWarper,
        TopPLogitsWarper,
    )

    warpers = LogitsProcessorList()
    if settings.temperature != 1.0:
        warpers.append(TemperatureLogitsWarper(float(settings.temperature)))
    if settings.top_k:
        warpers.append(TopKLogitsWarper(top_k=settings.top_k, min_tokens_to_keep=1))
    if settings.top_p < 1.0:
        warpers.append(TopPLogitsWarper(top_p=float(settings.top_p), min_tokens_to_keep=1))
    return warpers


def _new_cache(model):
    from transformers import DynamicCache

    try:
        return DynamicCache(config=model.config)
    except TypeError:  # older transformers
        return DynamicCache()


def _next_logits(model, input_ids: torch.Tensor, cache) -> torch.Tensor:
    # The cache goes positionally: its keyword is `past_key_values` before transformers 5.2x and `cache` after.
    output = model(input_ids, None, None, cache, use_cache=True, logits_to_keep=1)
    return output.logits[:, -1, :].to(dtype=torch.float32)


@torch.inference_mode()
def sample_tokens(
    model,
    prompt_ids: Sequence[int],
    settings: SamplingSettings,
    seed: int,
    eos_ids: Sequence[int],
    check_cancel: Optional[Callable[[], None]] = None,
    on_token: Optional[Callable[[int], None]] = None,
) -> SampledTokens:
    """New tokens after `prompt_ids` (the EOS that ended them not included)."""
    device = model.get_input_embeddings().weight.device
    generator = torch.Generator(device="cpu").manual_seed(int(seed) & SEED_MASK)
    warpers = None if settings.greedy else _warpers(settings)
    eos = torch.tensor(sorted(set(eos_ids)), dtype=torch.long, device=device)
    ids = torch.tensor([list(prompt_ids)], dtype=torch.long, device=device)
    cache = _new_cache(model)
    generated: list[int] = []
    stopped_by_eos = False

    started = time.perf_counter()
    logits = _next_logits(model, ids, cache)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    prefilled = time.perf_counter()
    while len(generated) < settings.max_new_tokens:
        if check_cancel is not None:
            check_cancel()
        if len(generated) < settings.min_new_tokens and eos.numel():
            logits[:, eos] = -float("inf")
        if settings.greedy:
            token = int(torch.argmax(logits, dim=-1).item())
        else:
            scores = warpers(ids, logits)  # these warpers ignore the ids
            probs = torch.softmax(scores, dim=-1).cpu()
            token = int(torch.multinomial(probs, num_samples=1, generator=generator).item())
        if token in eos_ids and len(generated) >= settings.min_new_tokens:
            stopped_by_eos = True
            break
        generated.append(token)
        if on_token is not None:
            on_token(len(generated))
        if len(generated) >= settings.max_new_tokens:
            break
        logits = _next_logits(model, torch.tensor([[token]], dtype=torch.long, device=device), cache)
    finished = time.perf_counter()
    del cache
    return SampledTokens(generated, prefilled - started, finished - prefilled, stopped_by_eos)
