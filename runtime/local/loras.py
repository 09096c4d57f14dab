"""The LoRA side of a LocalPipe: which stack the running job wants, checked before any weights are read, and
putting it on the DiT (merged or as branches, apply.py) whenever the DiT is (re)built or the wanted stack differs
from the one it carries."""
from __future__ import annotations

import time
import weakref
from typing import Any, Collection, Optional

import torch

from ..lora.apply import Applied, apply_loras
from ..lora.attach import estimate_bytes
from ..lora.host_memory import available_host_bytes, merge_backup_bytes
from ..lora.merge import merge_state
from ..lora.parsed import ParsedLora, load_lora
from ..lora.stack import LoraStack
from ..model.compile import blocks_compiled
from ..model.dit import DiTConfig

Resolved = list[tuple[ParsedLora, float]]
HOST_RESERVE = 2 * 1024**3  # host RAM left free after a merge's backup: the OS, ComfyUI and the next file's pages


class PipeLoras:
    def __init__(self, default: LoraStack, default_mode: str = "merge") -> None:
        self.default = default  # the stack the pipe itself runs (LocalPipe.load(..., loras=...)); views bring theirs
        self.default_mode = default_mode  # LoadOptions.lora_mode: for entries that name no mode
        self.wanted: Resolved = []
        self.wanted_stack = LoraStack()
        self.modes: list[str] = []
        self.last_apply_s: Optional[float] = None
        self.last_applied: Optional[Applied] = None
        self._config: Optional[DiTConfig] = None
        self._ram_notice: Optional[int] = None  # the backup size the RAM notice was given for
        self._synced: Optional[weakref.ref] = None  # the DiT last synced: its host copy is reused, not added

    def dit_config(self, sources: Any) -> DiTConfig:
        if self._config is None:
            from ..formats import open_component
            from ..model.builders import dit_config_for

            self._config = dit_config_for(open_component(sources.component("transformer"), "dit"))
        return self._config

    def resolve(self, stack: LoraStack, sources: Any) -> Resolved:
        """Every file of `stack` parsed for this DiT (cached): raises a one-line ModelFileError before anything."""
        config = self.dit_config(sources) if stack else None
        return [(load_lora(entry.path, config), entry.strength) for entry in stack.entries]

    def prepare(self, stack: Optional[LoraStack], sources: Any, host: Any, memory: Any) -> None:
        """The job's stack (None: the pipe's own): parsed and checked, notices logged, its memory told to the planner.

        The planner keeps room on the device for every LoRA as a branch, whatever its mode (a merge-mode LoRA takes
        the branch on blocks the plan streams; merged layers allocate none of it). A merge that would not leave
        HOST_RESERVE of host RAM free after its backup runs as a branch instead, with one notice."""
        stack = self.default if stack is None else stack
        resolved = self.resolve(stack, sources)
        for parsed, _ in resolved:
            for notice in parsed.notices:
                host.log(notice)
        modes = [entry.mode or self.default_mode for entry in stack.entries]
        modes = self._fit_host_memory(resolved, modes, memory, host)
        self.wanted, self.wanted_stack, self.modes = resolved, stack, modes
        memory.lora_bytes = estimate_bytes(resolved, memory.dtype)

    def _fit_host_memory(self, resolved: Resolved, modes: list[str], memory: Any, host: Any) -> list[str]:
        merging = [parsed for (parsed, _), mode in zip(resolved, modes) if mode == "merge"]
        if not merging:
            return modes
        fused = memory.device.type == "cuda"  # LocalPipe fuses q/k/v and gate/up on CUDA
        item = 1 if memory.quant == "fp8" else memory.dtype.itemsize
        needed = merge_backup_bytes(merging, self._config, item, fused)
        available = available_host_bytes()
        if available is None or needed + HOST_RESERVE <= available + self._held_backup_bytes():
            return modes
        notice = (f"LoRA merge needs up to {needed / 1e9:.1f} GB of host RAM for the original weights and "
                  f"{available / 1e9:.1f} GB is available: the LoRA runs as a branch instead (no host copy; a few % "
                  f"slower per step); free RAM, or choose mode branch to silence this")
        if needed != self._ram_notice:  # once per stack size, whatever RAM the next job finds
            host.log(notice)
            self._ram_notice = needed
        return ["branch"] * len(modes)

    def _held_backup_bytes(self) -> int:
        dit = self._synced() if self._synced is not None else None
        state = merge_state(dit) if dit is not None else None
        return state.host_bytes if state is not None else 0

    def sync(self, dit: torch.nn.Module, streamed: Collection[int] = (), host: Any = None) -> None:
        """Make `dit` carry the wanted stack: nothing to do when it already does. `streamed`: the blocks that stream
        (merge-mode LoRAs take the branch there). The merge's one notice goes to `host`. The stack is put on again
        when the blocks' layout for it changed: other streamed blocks, or blocks compiled since (compiled blocks
        share one branch structure, uncompiled ones carry only their own: lora/attach.py)."""
        stack_key = tuple((parsed.stamp, strength, mode) for (parsed, strength), mode in zip(self.wanted, self.modes))
        signature = (stack_key, tuple(sorted(streamed)), blocks_compiled(dit)) if stack_key else ()
        if getattr(dit, "lora_signature", ()) == signature:
            return
        started = time.perf_counter()
        stack = [(parsed, strength, mode) for (parsed, strength), mode in zip(self.wanted, self.modes)]
        try:
            applied = apply_loras(dit, stack, streamed)
        except BaseException:
            apply_loras(dit, [])  # never half a stack: back to the base model
            dit.lora_signature = ()
            raise
        if dit.x_embedder.proj.weight.is_cuda:
            torch.cuda.synchronize(dit.x_embedder.proj.weight.device)
        self.last_apply_s = time.perf_counter() - started
        self.last_applied = applied
        self._synced = weakref.ref(dit)
        dit.lora_signature = signature
        notice = applied.notice()
        if notice and host is not None:
            host.log(notice)

    def host_tensors(self, dit: Optional[torch.nn.Module]) -> list[torch.Tensor]:
        """The merged Linears' original tensors kept in host memory (backup.py)."""
        state = merge_state(dit) if dit is not None else None
        return state.host_tensors() if state is not None else []

    def pinned_bytes(self, dit: Optional[torch.nn.Module]) -> int:
        state = merge_state(dit) if dit is not None else None
        return state.pinned_bytes if state is not None else 0

    def describe(self, dit: Optional[torch.nn.Module]) -> str:
        """A line for the pipe's description while LoRAs are merged: what the host copy holds."""
        state = merge_state(dit) if dit is not None else None
        if state is None or not state.merged:
            return ""
        return (f"LoRA merge: {len(state.merged)} layer(s) merged; host copy of their original weights "
                f"{state.host_bytes / 1024**3:.2f} GiB (page-locked {state.pinned_bytes / 1024**3:.2f} GiB)")

    def info(self) -> dict[str, Any]:
        """Per LoRA of the job: name, strength, style and the mode it ran in ("merge and branch": merge-mode
        layers that could not merge, streamed or packed, took the branch)."""
        if not self.wanted_stack:
            return {}
        applied = self.last_applied
        ran = applied.ran if applied is not None and len(applied.ran) == len(self.modes) else self.modes
        return {"loras": [dict(item, style=parsed.style, mode=mode) for item, (parsed, _), mode in
                          zip(self.wanted_stack.metadata(), self.wanted, ran)]}
