"""Sampling on the PE's device (device_sampling.py) draws from transformers' warped distribution.

Checked on the CPU (the same code runs on any device): every draw lies in the support transformers' temperature,
top-k and top-p warpers leave, and the draw frequencies follow the warped softmax. On the GPU: a seed gives one
token sequence whatever the global RNG did, and the sampler's device loop ends at EOS and at the cap as the CPU
loop does. Greedy decoding (temperature 0) picks its tokens on the device on any device: the same tokens, the same
EOS, as a token-by-token read, with no token read through `.item()`.
"""
from __future__ import annotations

import pytest
import torch

from ernie_image.runtime.text import token_sampler
from ernie_image.runtime.text.device_sampling import DeviceTokenDraws
from ernie_image.runtime.text.token_sampler import SamplingSettings, _warpers, sample_tokens

VOCAB = 16


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


class ScriptedDecoder:
    """Logits whose best token at position n is script[n] (position 0: after the prompt), the next id second best;
    it takes its tokens as device tensors only."""

    def __init__(self, script: list[int]) -> None:
        self.script = script
        self.position = 0
        self.steps = 0

    def prefill(self, prompt_ids) -> torch.Tensor:
        return self._logits()

    def next_logits_device(self, token: torch.Tensor) -> torch.Tensor:
        assert token.shape == (1,) and token.dtype == torch.long
        self.position += 1
        self.steps += 1
        return self._logits()

    def next_logits(self, token: int) -> torch.Tensor:
        raise AssertionError("a token went through the host")

    def close(self) -> None:
        pass

    def _logits(self) -> torch.Tensor:
        logits = torch.zeros(1, VOCAB)
        best = self.script[self.position]
        logits[0, best], logits[0, (best + 1) % VOCAB] = 2.0, 1.0
        return logits


def token_by_token(script: list[int], eos_ids: list[int], settings: SamplingSettings) -> tuple[list[int], bool]:
    """Greedy decoding as a host reading each token would do it: the specification."""
    tokens: list[int] = []
    for best in script[:settings.max_new_tokens]:
        token = (best + 1) % VOCAB if best in eos_ids and len(tokens) < settings.min_new_tokens else best
        if token in eos_ids and len(tokens) >= settings.min_new_tokens:
            return tokens, True
        tokens.append(token)
    return tokens, False


GREEDY_CASES = {  # script of best tokens, EOS ids, max and min new tokens
    "EOS after three tokens": ([5, 6, 7, 2, 8, 9], [2], 6, 0),
    "EOS first": ([2, 5, 6], [2], 3, 0),
    "no EOS: the cap": ([5, 6, 7, 8, 9, 10], [2], 4, 0),
    "EOS masked until two tokens": ([2, 2, 5, 2, 6, 7], [2], 6, 2),
    "either of two EOS ids": ([5, 6, 3, 2, 8], [2, 3], 5, 0),
    "one token allowed": ([5, 6, 7], [2], 1, 0),
}


@pytest.mark.parametrize("case", list(GREEDY_CASES), ids=list(GREEDY_CASES))
def test_greedy_decoding_picks_on_the_device_the_tokens_and_eos_of_a_token_by_token_read(case, monkeypatch):
    script, eos_ids, max_new, min_new = GREEDY_CASES[case]
    settings = SamplingSettings(temperature=0.0, max_new_tokens=max_new, min_new_tokens=min_new)
    decoder = ScriptedDecoder(script)
    monkeypatch.setattr(token_sampler, "open_decoder", lambda *args, **kwargs: decoder)
    reads = []
    item = torch.Tensor.item
    monkeypatch.setattr(torch.Tensor, "item", lambda self: reads.append(self) or item(self))
    model = torch.nn.Module()
    model.embed = torch.nn.Embedding(VOCAB, 4)
    model.get_input_embeddings = lambda: model.embed
    sampled = sample_tokens(model, [1, 4], settings, seed=0, eos_ids=eos_ids)
    tokens, stopped = token_by_token(script, eos_ids, settings)
    assert (sampled.token_ids, sampled.stopped_by_eos) == (tokens, stopped)
    assert decoder.steps == len(tokens) - (0 if stopped else 1)  # on the CPU no step is decoded ahead in vain
    assert not reads  # no token read through .item(): on a GPU each would wait for the device


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_on_the_gpu_greedy_decoding_gives_the_cpus_tokens_without_a_read_per_token(monkeypatch):
    from ernie_image.runtime.demo.tiny_pe import lively_prompt_enhancer

    model = lively_prompt_enhancer(seed=4).float().eval().requires_grad_(False)
    prompt = [1] + [(7 * i) % 200 + 20 for i in range(39)]
    settings = SamplingSettings(temperature=0.0, max_new_tokens=40, min_new_tokens=40)
    on_cpu = sample_tokens(model, prompt, settings, seed=0, eos_ids=[2])
    reads = []
    item = torch.Tensor.item
    monkeypatch.setattr(torch.Tensor, "item", lambda self: reads.append(self) or item(self))
    on_gpu = sample_tokens(model.cuda(), prompt, settings, seed=0, eos_ids=[2])
    assert on_gpu.token_ids == on_cpu.token_ids  # fp32: the logits agree far inside greedy's margins
    assert len(reads) < 5, "a token read per step"
    stop = on_gpu.token_ids[5]
    ended = sample_tokens(model, prompt, SamplingSettings(temperature=0.0, max_new_tokens=40), seed=0, eos_ids=[stop])
    assert ended.stopped_by_eos and ended.token_ids == on_gpu.token_ids[:on_gpu.token_ids.index(stop)]
