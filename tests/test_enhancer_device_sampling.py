"""Sampling on the PE's device (device_sampling.py) draws from transformers' warped distribution.

Checked on the CPU (the same code runs on any device): every draw lies in the support transformers' temperature,
top-k and top-p warpers leave, and the draw frequencies follow the warped softmax. On the GPU: a seed gives one
token sequence whatever the global RNG did, and the sampler's device loop ends at EOS and at the cap as the CPU
loop does.
"""
from __future__ import annotations

import pytest
import torch

from ernie_image.runtime.text.device_sampling import DeviceTokenDraws
from ernie_image.runtime.text.token_sampler import SamplingSettings, _warpers, sample_tokens


def warped_probs(logits: torch.Tensor, temperature: float, top_k: int, top_p: float) -> torch.Tensor:
    scores = logits
    for warp in _warpers(SamplingSettings(temperature=temperature, top_p=top_p, top_k=top_k)):
        scores = warp(None, scores)
    return torch.softmax(scores, dim=-1).reshape(-1)


@pytest.mark.parametrize("temperature, top_k, top_p", [(0.6, 50, 0.95), (1.0, 10, 1.0), (0.8, 0, 0.7),
                                                       (1.3, 5, 0.5)])
def test_draws_stay_in_the_warpers_support(temperature, top_k, top_p):
    draws = DeviceTokenDraws(temperature, top_k, top_p, seed=3, device=torch.device("cpu"))
    for step in range(30):
        logits = torch.randn((1, 4096), generator=torch.Generator().manual_seed(step)) * 3
        support = warped_probs(logits, temperature, top_k, top_p) > 0
        for _ in range(5):
            token = draws.sample(logits)
            assert token.shape == (1,) and token.dtype == torch.long
            assert support[token.item()]


def test_draw_frequencies_follow_the_warped_softmax():
    logits = torch.tensor([[2.0, 1.5, 1.0, 0.5, 0.0, -0.5, -1.0, -3.0] + [-6.0] * 56])
    expected = warped_probs(logits, 0.9, 6, 0.9)
    draws = DeviceTokenDraws(0.9, 6, 0.9, seed=11, device=torch.device("cpu"))
    count = 20000
    seen = torch.bincount(torch.cat([draws.sample(logits) for _ in range(count)]), minlength=64).float() / count
    assert seen[expected == 0].sum() == 0
    # binomial standard error at p=0.3 and n=20000 is 0.0032: 5 of them
    assert (seen - expected).abs().max() < 0.016


def test_a_seed_repeats_its_draws_and_greedy_is_refused():
    logits = torch.randn((1, 1000), generator=torch.Generator().manual_seed(0))
    first = [DeviceTokenDraws(0.6, 50, 0.95, 7, torch.device("cpu")).sample(logits).item() for _ in range(3)]
    torch.manual_seed(123)
    again = [DeviceTokenDraws(0.6, 50, 0.95, 7, torch.device("cpu")).sample(logits).item() for _ in range(3)]
    assert first == again
    with pytest.raises(ValueError, match="greedy"):
        DeviceTokenDraws(0.0, 50, 0.95, 7, torch.device("cpu"))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_on_the_gpu_a_seed_gives_one_sequence_and_eos_and_the_cap_end_it():
    from ernie_image.runtime.demo.tiny_pe import lively_prompt_enhancer

    model = lively_prompt_enhancer(seed=4).to(torch.bfloat16).eval().requires_grad_(False).cuda()
    prompt = [1] + [(7 * i) % 200 + 20 for i in range(39)]
    settings = SamplingSettings(max_new_tokens=40)
    first = sample_tokens(model, prompt, settings, seed=5, eos_ids=[])
    torch.cuda.manual_seed_all(99)
    torch.rand(100, device="cuda")
    again = sample_tokens(model, prompt, settings, seed=5, eos_ids=[])
    assert first.token_ids == again.token_ids and len(first.token_ids) == 40 and not first.stopped_by_eos
    stop = first.token_ids[3]  # that token acts as EOS: the same draws, cut where it first appears
    ended = sample_tokens(model, prompt, settings, seed=5, eos_ids=[stop])
    assert ended.stopped_by_eos and ended.token_ids == first.token_ids[:first.token_ids.index(stop)]
    forced = sample_tokens(model, prompt, SamplingSettings(max_new_tokens=12, min_new_tokens=12), seed=5,
                           eos_ids=[stop])
    assert len(forced.token_ids) == 12 and stop not in forced.token_ids and not forced.stopped_by_eos
