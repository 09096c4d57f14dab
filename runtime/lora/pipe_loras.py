"""The LoRA side of a LocalPipe: which stack the running job wants, checked before any weights are read, and
putting it on the DiT whenever the DiT is (re)built or the wanted stack differs from the one it carries."""
from __future__ import annotations

import time
from typing import Any, Optional

import torch

from ..dit import DiTConfig
from .attach import apply_stack, estimate_bytes
from .parsed import ParsedLora, load_lora
from .stack import LoraStack

Resolved = list[tuple[ParsedLora, float]]


class PipeLoras:
    def __init__(self, default: LoraStack) -> None:
        self.default = default  # the stack the pipe itself runs (LocalPipe.load(..., loras=...)); views bring theirs
        self.wanted: Resolved = []
        self.wanted_stack = LoraStack()
        self.last_apply_s: Optional[float] = None
        self._config: Optional[DiTConfig] = None

    def dit_config(self, sources: Any) -> DiTConfig:
        if self._config is None:
            from ..formats import open_component
            from ..model_files import dit_config_for

            self._config = dit_config_for(open_component(sources.component("transformer"), "dit"))
        return self._config

    def resolve(self, stack: LoraStack, sources: Any) -> Resolved:
        """Every file of `stack` parsed for this DiT (cached): raises a one-line ModelFileError before anything."""
        config = self.dit_config(sources) if stack else None
        return [(load_lora(entry.path, config), entry.strength) for entry in stack.entries]

    def prepare(self, stack: Optional[LoraStack], sources: Any, host: Any, memory: Any) -> None:
        """The job's stack (None: the pipe's own): parsed and checked, notices logged, its memory told to the planner."""
        stack = self.default if stack is None else stack
        resolved = self.resolve(stack, sources)
        for parsed, _ in resolved:
            for notice in parsed.notices:
                host.log(notice)
        self.wanted, self.wanted_stack = resolved, stack
        memory.lora_bytes = estimate_bytes(resolved, memory.dtype)

    def sync(self, dit: torch.nn.Module) -> None:
        """Make `dit` carry the wanted stack: nothing to do when it already does."""
        signature = tuple((parsed.stamp, strength) for parsed, strength in self.wanted)
        if getattr(dit, "lora_signature", ()) == signature:
            return
        started = time.perf_counter()
        try:
            apply_stack(dit, self.wanted)
        except BaseException:
            apply_stack(dit, [])  # never half a stack: back to the base model
            dit.lora_signature = ()
            raise
        if dit.x_embedder.proj.weight.is_cuda:
            torch.cuda.synchronize(dit.x_embedder.proj.weight.device)
        self.last_apply_s = time.perf_counter() - started
        dit.lora_signature = signature

    def info(self) -> dict[str, Any]:
        if not self.wanted_stack:
            return {}
        return {"loras": [dict(item, style=parsed.style) for item, (parsed, _) in
                          zip(self.wanted_stack.metadata(), self.wanted)]}
