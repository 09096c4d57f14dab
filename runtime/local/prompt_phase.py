"""A LocalPipe job's prompt-enhancer phase, before text encoding: the prompts as written, revised on a PE chat
endpoint, or revised by the local prompt enhancer.

The local PE is loaded (or brought back from host RAM), run, then moved to host RAM (keep_loaded) or dropped, so
the device is free for the text encoder. With a VRAM plan it is built on the host and placed by the plan's PE mode
(loaded for the phase, or its layers streamed); see PipeMemory.place_pe. A PE endpoint loads nothing locally.
"""
from __future__ import annotations

from typing import Optional

from ..core.host import Host
from ..core.request import GenerationRequest
from ..formats.sources import ModelSources
from ..text.enhancer import RevisedPrompts, revise_prompts, validate_sampling
from .memory import PipeMemory
from .options import LoadOptions
from .parts import PipeParts


def revised_without_local_pe(request: GenerationRequest, host: Host, options: LoadOptions,
                             sources: ModelSources) -> Optional[RevisedPrompts]:
    """The prompts when the local PE does not run: not asked for, revised on the PE endpoint, or as written (the
    model has no PE, with a notice); None when the local PE is to revise them."""
    prompts = request.prompt_list()
    if not request.use_pe:
        return RevisedPrompts(prompts)
    validate_sampling(request.pe_temperature, request.pe_top_p, request.pe_max_new_tokens)
    if options.pe_endpoint is not None:
        from ..text.remote_enhancer import revise_prompts_remote

        return revise_prompts_remote(options.pe_endpoint, prompts, request.width, request.height, request.seed,
                                     request.pe_temperature, request.pe_top_p, request.pe_max_new_tokens, host)
    if not sources.has_pe():
        host.log("prompt enhancer is on but this model has none (no pe/ folder, PE file or PE server): "
                 "the prompt is used as written")
        return RevisedPrompts(prompts)
    return None


def revised_by_local_pe(request: GenerationRequest, host: Host, options: LoadOptions, parts: PipeParts,
                        memory: PipeMemory) -> RevisedPrompts:
    """The prompts revised by the local PE, which then leaves the device (parked in host RAM or dropped)."""
    placed = memory.places_pe()
    enhancer = parts.load_enhancer(host, placed)
    try:
        if placed:
            memory.place_pe(enhancer.model)
            enhancer.placed = True
        settings = enhancer.settings(request.pe_temperature, request.pe_top_p, request.pe_max_new_tokens)
        return revise_prompts(enhancer, request.prompt_list(), request.width, request.height, request.seed, settings,
                              host)
    finally:
        if placed:
            memory.after_pe(options.keep_loaded)
        if options.keep_loaded:
            enhancer.offload()
        else:
            enhancer.release()
            parts.enhancer = None
