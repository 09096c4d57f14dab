"""Seeded autoregressive sampling for the prompt enhancer, with transformers' sampling semantics.

Same maths as `model.generate(do_sample=True, temperature, top_k, top_p)` (the warpers are transformers' own,
applied in generate's order to float32 logits), but every draw comes from a private `torch.Generator`: the
global RNG is neither read nor changed, and a seed gives the same tokens whatever ran before. On the CPU the draws
are the ones multinomial would make from a CPU generator, prepared on a worker thread. On a CUDA device the
warpers and the draw run there (device_sampling.py, a CUDA generator seeded from the seed), and greedy decoding
(temperature 0) takes its argmax there on any device: the token stays on the device as the next step's input and
only its id comes back, read while the next token's decode step is already queued (that step is dropped if the
token was EOS), so the GPU never waits for Python and the tokens and the EOS they stop at are the ones a
token-by-token read gives. A seed's rewrite is the same on the same device; CPU and GPU may differ.
Cancel is checked between tokens. A PE resident on one CUDA device decodes through static_decoder.py (one CUDA
graph per token); a CPU or streamed PE runs transformers' forward.
"""
from __future__ import annotations

import logging
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Callable, Optional, Sequence

import torch

from ..core.non_finite import refuse_non_finite
from ..core.request import SEED_MASK
from .device_sampling import DeviceTokenDraws

log = logging.getLogger(__name__)

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


def _warpers(settings: SamplingSettings) -> list:
    """transformers' warpers in generate's order. Called one by one, not through LogitsProcessorList, which
    inspects every warper's signature on every call (~40 us each, per token)."""
    from transformers.generation.logits_process import TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

    warpers = []
    if settings.temperature != 1.0:
        warpers.append(TemperatureLogitsWarper(float(settings.temperature)))
    if settings.top_k:
        warpers.append(TopKLogitsWarper(top_k=settings.top_k, min_tokens_to_keep=1))
    if settings.top_p < 1.0:
        warpers.append(TopPLogitsWarper(top_p=float(settings.top_p), min_tokens_to_keep=1))
    return warpers


class ExponentialDraws:
    """`torch.multinomial(probs, 1, generator=cpu_generator)`, seed for seed, off the critical path.

    ATen samples one token without replacement as argmax(probs / q), q ~ Exp(1) drawn from the generator for every
    vocabulary entry. Those 131072 draws take ~3.4 ms on the CPU and do not depend on the logits, so a worker thread
    draws the next token's q while the device computes its logits (tests check the equality with multinomial).
    """

    def __init__(self, generator: torch.Generator, size: int) -> None:
        self.generator = generator
        self.size = size
        self._worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ernie-pe-draws")
        self._next = self._worker.submit(self._draw)

    def _draw(self) -> torch.Tensor:
        return torch.empty(self.size, dtype=torch.float32).exponential_(1, generator=self.generator)

    def sample(self, probs: torch.Tensor) -> int:
        """One token from CPU float32 `probs` [1, vocab]."""
        token = int(torch.argmax(probs.reshape(-1) / self._next.result()))
        # Only now: the draw and this argmax share the CPU's intra-op threads (measured: 3.7 ms a token when they
        # overlapped, against a GPU step of 4.8 ms that the draw can hide behind instead).
        self._next = self._worker.submit(self._draw)
        return token

    def close(self) -> None:
        self._worker.shutdown(wait=True, cancel_futures=True)


class TransformersDecoder:
    """transformers' own forward with a growing DynamicCache: the reference path (CPU, streamed layers)."""

    def __init__(self, model) -> None:
        from transformers import DynamicCache

        self.model = model
        self.device = model.get_input_embeddings().weight.device
        try:
            self.cache = DynamicCache(config=model.config)
        except TypeError:  # older transformers
            self.cache = DynamicCache()

    def prefill(self, prompt_ids: Sequence[int]) -> torch.Tensor:
        return self._logits(torch.tensor([list(prompt_ids)], dtype=torch.long, device=self.device))

    def next_logits(self, token: int) -> torch.Tensor:
        return self._logits(torch.tensor([[token]], dtype=torch.long, device=self.device))

    def next_logits_device(self, token: torch.Tensor) -> torch.Tensor:
        """`next_logits` for a token id held in a device tensor (no host sync)."""
        return self._logits(token.reshape(1, 1))

    def close(self) -> None:
        self.cache = None

    def _logits(self, input_ids: torch.Tensor) -> torch.Tensor:
        # The cache goes positionally: its keyword is `past_key_values` before transformers 5.2x and `cache` after.
        output = self.model(input_ids, None, None, self.cache, use_cache=True, logits_to_keep=1)
        return output.logits[:, -1, :].to(dtype=torch.float32)


def open_decoder(model, capacity: int, fast: bool = True, compiled: bool = False):
    """The static-cache CUDA-graph decoder for a resident PE on a CUDA device, else transformers'. `compiled`: its
    layer step through torch.compile (needs Triton; compiled once per process and allocator backend)."""
    from .static_decoder import StaticCacheDecoder, static_decoding_device

    if fast and static_decoding_device(model) is not None:
        for compile_step in ((True, False) if compiled else (False,)):
            try:
                return StaticCacheDecoder(model, capacity, use_graph=True, compiled=compile_step)
            except RuntimeError as error:  # the compiler failed, or a layer cannot be captured (a host sync)
                what = "compiled decode step" if compile_step else "CUDA-graph decoding"
                log.warning("prompt enhancer: %s unavailable (%s); using %s", what, str(error).splitlines()[0][:200],
                            "the uncompiled step" if compile_step else "transformers' forward")
    return TransformersDecoder(model)


@torch.inference_mode()
def sample_tokens(
    model,
    prompt_ids: Sequence[int],
    settings: SamplingSettings,
    seed: int,
    eos_ids: Sequence[int],
    check_cancel: Optional[Callable[[], None]] = None,
    on_token: Optional[Callable[[int], None]] = None,
    fast: bool = True,
    compiled: bool = False,
    weights: object = "its files",
) -> SampledTokens:
    """New tokens after `prompt_ids` (the EOS that ended them not included). `fast`: allow the CUDA-graph decoder;
    `compiled`: its layer step compiled (open_decoder). `weights`: where the model's weights are, named when its
    logits are not finite (damaged weights would otherwise sample a garbage prompt without a word)."""
    device = model.get_input_embeddings().weight.device
    eos = torch.tensor(sorted(set(eos_ids)), dtype=torch.long, device=device)
    generated: list[int] = []
    stopped_by_eos = False

    started = time.perf_counter()
    decoder = open_decoder(model, len(prompt_ids) + settings.max_new_tokens, fast, compiled)
    if settings.greedy or device.type == "cuda":
        try:
            logits = decoder.prefill(prompt_ids)
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            refuse_non_finite(logits, "prompt enhancer", weights, "logits")
            prefilled = time.perf_counter()
            pick = _argmax if settings.greedy else DeviceTokenDraws(settings.temperature, settings.top_k,
                                                                     settings.top_p, seed, logits.device).sample
            generated, stopped_by_eos = _decode_on_device(decoder, logits, pick, settings, eos, eos_ids, check_cancel,
                                                          on_token)
            finished = time.perf_counter()
        finally:
            if device.type == "cuda":
                torch.cuda.synchronize(device)  # a cancel can leave a queued step behind: let it end before the close
            decoder.close()
        return SampledTokens(generated, prefilled - started, finished - prefilled, stopped_by_eos)
    generator = torch.Generator(device="cpu").manual_seed(int(seed) & SEED_MASK)
    warpers = _warpers(settings)
    ids = torch.tensor([list(prompt_ids)], dtype=torch.long, device=device)
    draws: Optional[ExponentialDraws] = None
    try:
        logits = decoder.prefill(prompt_ids)
        refuse_non_finite(logits, "prompt enhancer", weights, "logits")
        draws = ExponentialDraws(generator, logits.shape[-1])
        prefilled = time.perf_counter()
        while len(generated) < settings.max_new_tokens:
            if check_cancel is not None:
                check_cancel()
            if len(generated) < settings.min_new_tokens and eos.numel():
                logits[:, eos] = -float("inf")
            scores = logits
            for warp in warpers:
                scores = warp(ids, scores)  # these warpers ignore the ids
            token = draws.sample(torch.softmax(scores, dim=-1).cpu())
            if token in eos_ids and len(generated) >= settings.min_new_tokens:
                stopped_by_eos = True
                break
            generated.append(token)
            if on_token is not None:
                on_token(len(generated))
            if len(generated) >= settings.max_new_tokens:
                break
            logits = decoder.next_logits(token)
        finished = time.perf_counter()
    finally:
        decoder.close()  # a cancel must not leave the cache or the graph's memory behind
        if draws is not None:
            draws.close()
    return SampledTokens(generated, prefilled - started, finished - prefilled, stopped_by_eos)


def _argmax(logits: torch.Tensor) -> torch.Tensor:
    """Greedy decoding's token: a [1] int64 tensor on the logits' device (no host sync)."""
    return torch.argmax(logits, dim=-1).reshape(1)


class _TokenReadback:
    """A token id copied from its device to the host. On a CUDA device the copy is queued (page-locked, with an
    event), so what is queued after it runs while the host waits for the id; on the CPU it is read at once."""

    def __init__(self, device: torch.device) -> None:
        self.overlaps = device.type == "cuda"
        self.host = torch.empty(1, dtype=torch.long, pin_memory=self.overlaps)
        self.ready: Optional["torch.cuda.Event"] = None

    def start(self, token: torch.Tensor) -> None:
        self.host.copy_(token, non_blocking=self.overlaps)
        if self.overlaps:
            self.ready = torch.cuda.Event()
            self.ready.record()

    def value(self) -> int:
        if self.ready is not None:
            self.ready.synchronize()
        return int(self.host[0])


def _decode_on_device(decoder, logits: torch.Tensor, pick: Callable[[torch.Tensor], torch.Tensor],
                      settings: SamplingSettings, eos: torch.Tensor, eos_ids: Sequence[int],
                      check_cancel: Optional[Callable[[], None]], on_token: Optional[Callable[[int], None]]
                      ) -> tuple[list[int], bool]:
    """The decode loop with the token picked on the device (`pick`: logits -> [1] token): each token is the next
    step's input as a device tensor, and on a CUDA device token n+1's step and pick are queued before token n is
    read."""
    readback = _TokenReadback(logits.device)
    eos_set = set(eos_ids)

    def next_token(logits: torch.Tensor, index: int) -> torch.Tensor:
        if index < settings.min_new_tokens and eos.numel():
            logits = logits.index_fill(1, eos, -float("inf"))
        return pick(logits)

    generated: list[int] = []
    token = next_token(logits, 0)
    while True:
        if check_cancel is not None:
            check_cancel()
        index = len(generated)
        more = index + 1 < settings.max_new_tokens
        readback.start(token)
        # Decode the next position while the host waits for this token (a CPU would only compute it in vain).
        ahead = next_token(decoder.next_logits_device(token), index + 1) if more and readback.overlaps else None
        value = readback.value()
        if value in eos_set and index >= settings.min_new_tokens:
            return generated, True
        generated.append(value)
        if on_token is not None:
            on_token(len(generated))
        if not more:
            return generated, False
        token = ahead if ahead is not None else next_token(decoder.next_logits_device(token), index + 1)
