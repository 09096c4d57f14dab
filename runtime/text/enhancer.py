"""The prompt enhancer (PE): a short prompt in, the revised prompt the DiT is given out. Local or remote, seeded.

A revision is a function of (prompt, width, height, seed, sampling settings, weights): each distinct prompt gets
its own private generator seeded with `seed`, so a prompt's revision does not depend on the global RNG, on what
ran before, or on its position in a batch. Only the positive prompt is revised (as diffusers and Baidu do).
"""
from __future__ import annotations

import gc
from dataclasses import dataclass, field
from typing import Any, Optional, Sequence

import torch

from ..core.errors import InvalidInputError
from ..core.host import Host, NullHost, show_progress_phase
from ..core.number_text import not_allowed
from ..core.request import MAX_NEW_TOKENS_RANGE, TEMPERATURE_RANGE, TOP_P_RULE
from ..core.variant import Variant
from ..formats.sources import ModelSources
from ..formats.tokenizer_fit import refuse_ids_beyond, refuse_unfit
from .encoder import embedding_rows
from .pe_model import PeWeights, build_pe_model, default_top_k, load_pe_tokenizer, locate_pe, open_pe_component
from .pe_prompt import prompt_token_ids, render_chat
from .token_sampler import SamplingSettings, sample_tokens


@dataclass
class Revision:
    original: str
    revised: str
    tokens: int
    seconds: float
    source: str  # "local", "remote", or "original" (the PE failed or returned nothing; the prompt was kept)
    truncated: bool = False  # hit the max-new-tokens cap before the model finished


@dataclass
class RevisedPrompts:
    """One revised prompt per input prompt, plus what the user is shown about the PE's work."""

    prompts: list[str]
    revisions: list[Revision] = field(default_factory=list)

    @property
    def enhanced(self) -> bool:
        """Whether the enhancer revised any prompt (not only kept the originals after a failure)."""
        return any(revision.source != "original" for revision in self.revisions)

    def info(self) -> dict[str, Any]:
        if not self.revisions:
            return {}
        seconds = sum(r.seconds for r in self.revisions)
        tokens = sum(r.tokens for r in self.revisions)
        return {
            "pe": "+".join(sorted({r.source for r in self.revisions})),
            "pe_s": round(seconds, 3),
            "pe_tokens": tokens,
            "pe_tokens_per_s": round(tokens / seconds, 1) if seconds > 0 else 0.0,
        }


# Where the revision stopped at its token cap. Not worded as a setting: generate and the Sampler's use_pe take the
# default cap, which only the enhance command and the Prompt Enhancer node set (max_new_tokens in both).
CAPPED = "the revised prompt may end mid-sentence (a higher max_new_tokens lets it finish)"


def validate_sampling(temperature: float, top_p: float, max_new_tokens: int) -> None:
    """The PE's sampling settings, refused under GenerationRequest's names for them (which front ends re-word)."""
    if not TEMPERATURE_RANGE[0] <= temperature <= TEMPERATURE_RANGE[1]:
        raise not_allowed("pe_temperature", f"{temperature:g}", TEMPERATURE_RANGE,
                          " (0.6 is Baidu's; 0 is greedy)").naming("pe_temperature")
    if not 0.0 < top_p <= 1.0:
        raise InvalidInputError(f"pe_top_p {top_p:g} is not allowed: use {TOP_P_RULE} (0.95 is Baidu's)"
                                ).naming("pe_top_p")
    if not MAX_NEW_TOKENS_RANGE[0] <= max_new_tokens <= MAX_NEW_TOKENS_RANGE[1]:
        raise not_allowed("pe_max_new_tokens", str(max_new_tokens), MAX_NEW_TOKENS_RANGE,
                          " (default 512)").naming("pe_max_new_tokens")


class LocalEnhancer:
    """A loaded PE: weights on a device, its tokenizer and chat template. One memory phase of a generation."""

    def __init__(self, model, tokenizer, located: PeWeights, device: torch.device, dtype: torch.dtype) -> None:
        self.model = model
        self.tokenizer = tokenizer
        self.located = located
        self.device = device
        self.dtype = dtype
        # True when an offloader (local.memory.PipeMemory.place_pe) moves the weights: to_device and offload
        # then leave them where the plan put them (a streamed PE's layers live in a host slab, not in the model).
        self.placed = False
        # The decode step through torch.compile (Triton): set by the pipe from its compile option.
        self.compiled_decode = False
        self.top_k = default_top_k(located)
        self.embedding_rows = embedding_rows(model.model)  # what input_ids must stay below
        eos = getattr(tokenizer, "eos_token_id", None)
        config_eos = getattr(model.config, "eos_token_id", None)
        ids = {eos} if eos is not None else set()
        ids |= set(config_eos if isinstance(config_eos, (list, tuple)) else [config_eos]) - {None}
        self.eos_ids = sorted(ids)

    @classmethod
    def load(cls, sources: ModelSources, device: torch.device, dtype: torch.dtype, variant: Variant = "base",
             host: Optional[Host] = None, build_device: Optional[torch.device] = None,
             quant: str = "none") -> "LocalEnhancer":
        """`build_device`: where the weights are materialised when not on `device` (the host, for an offloader
        that places them itself). `quant` "fp8": the decoder layers' Linears are packed there once built
        (pe_quant.py); a memory plan made for bf16 weights then only over-provisions."""
        from .pe_model import pe_config_for, pe_embedding_rows, pe_weight_bytes

        located = locate_pe(sources)
        component = open_pe_component(located)  # another part's file is named before a tokenizer is sought
        tokenizer = load_pe_tokenizer(located, sources)
        refuse_unfit(tokenizer, pe_embedding_rows(component), "prompt enhancer", located.weights)
        render_chat(tokenizer, "a cat", 1024, 1024)  # a chat template that does not render, before the build
        build_device = torch.device(build_device) if build_device is not None else device
        if host is not None and build_device.type == "cuda":
            host.make_room(pe_weight_bytes(pe_config_for(component, variant), dtype), build_device)
        model = build_pe_model(component, build_device, dtype, variant)
        if quant != "none":
            from .pe_quant import quantize_pe_layers_

            quantize_pe_layers_(model, quant)
        return cls(model, tokenizer, located, device, dtype)

    def settings(self, temperature: float, top_p: float, max_new_tokens: int,
                 min_new_tokens: int = 0) -> SamplingSettings:
        validate_sampling(temperature, top_p, max_new_tokens)
        return SamplingSettings(temperature=temperature, top_p=top_p, top_k=self.top_k,
                                max_new_tokens=max_new_tokens, min_new_tokens=min_new_tokens)

    def input_ids(self, prompt: str, width: int, height: int) -> list[int]:
        ids = prompt_token_ids(self.tokenizer, render_chat(self.tokenizer, prompt, width, height))
        if self.embedding_rows is not None:
            refuse_ids_beyond(self.tokenizer, ids, prompt, self.embedding_rows, "prompt enhancer", self.located.weights)
        return ids

    def revise(self, prompt: str, width: int, height: int, seed: int, settings: SamplingSettings,
               host: Optional[Host] = None) -> Revision:
        host = host or NullHost()
        self.to_device()
        ids = self.input_ids(prompt, width, height)
        total = settings.max_new_tokens

        def on_token(count: int) -> None:
            if count % 16 == 0:
                host.progress(count, total)

        show_progress_phase(host, "prompt enhancer", "token")
        sampled = sample_tokens(self.model, ids, settings, seed, self.eos_ids, host.check_cancel, on_token,
                                compiled=self.compiled_decode, weights=self.located.weights)
        revised = self.tokenizer.decode(sampled.token_ids, skip_special_tokens=True).strip()
        truncated = not sampled.stopped_by_eos and len(sampled.token_ids) >= settings.max_new_tokens
        if not revised:
            host.log("prompt enhancer returned an empty prompt: the original prompt is used")
            return Revision(prompt, prompt, len(sampled.token_ids), sampled.seconds, "original")
        if truncated:
            host.log(f"prompt enhancer stopped at the {settings.max_new_tokens}-token cap: {CAPPED}")
        return Revision(prompt, revised, len(sampled.token_ids), sampled.seconds, "local", truncated)

    def to_device(self) -> None:
        if self.placed:
            return
        if self.model.get_input_embeddings().weight.device != self.device:
            self.model.to(self.device)

    def offload(self) -> None:
        """End of the PE phase with weights kept: move them to host RAM so the device is free for the next phase."""
        if self.device.type != "cpu" and not self.placed:
            self.model.to("cpu")
            _empty_device_cache(self.device)

    def release(self) -> None:
        self.model = None
        gc.collect()
        _empty_device_cache(self.device)


def _empty_device_cache(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.empty_cache()


def revise_prompts(enhancer: LocalEnhancer, prompts: Sequence[str], width: int, height: int, seed: int,
                   settings: SamplingSettings, host: Optional[Host] = None) -> RevisedPrompts:
    """Each distinct prompt revised once (same seed for each), mapped back to every position it occupies."""
    done: dict[str, Revision] = {}
    for prompt in dict.fromkeys(prompts):
        done[prompt] = enhancer.revise(prompt, width, height, seed, settings, host)
    return RevisedPrompts([done[p].revised for p in prompts], list(done.values()))
