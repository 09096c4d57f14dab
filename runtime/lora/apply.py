"""Put a stack of LoRAs on a DiT, each in its mode: merged into the resident weights (merge.py) or as a branch beside
them (attach.py). A LoRA in merge mode takes the branch on the Linears that cannot merge (streamed blocks, GGUF and
NVFP4 weights); the report says how many and why, for the one notice the pipe gives."""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field, replace
from typing import Collection

from torch import nn

from .attach import _physical, apply_stack, wrapped_layers
from .merge import Contribution, merge_layers, merge_refusal
from .parsed import ParsedLora

Stack = list[tuple[ParsedLora, float, str]]  # (parsed file, strength, "merge" or "branch")

FALLBACK_WHY = {
    "streamed": "its blocks stream from host memory every step",
    "gguf": "its weights are GGUF blocks",
    "nvfp4": "its weights are NVFP4",
}


@dataclass
class Applied:
    merged_layers: int = 0
    branch_layers: int = 0
    branch_bytes: int = 0  # device bytes of the branches
    backup_bytes: int = 0  # host bytes of the merged Linears' originals
    backup_pinned_bytes: int = 0
    fallback: Counter = field(default_factory=Counter)  # why merge-mode adapters run as a branch -> how many
    ran: list[str] = field(default_factory=list)  # per stack entry: "merge", "branch" or "merge and branch"

    def notice(self) -> str:
        """One line on what a merge did (empty when nothing was asked to merge)."""
        if not self.merged_layers and not self.fallback:
            return ""
        parts = []
        if self.merged_layers:
            pinned = ", page-locked" if self.backup_pinned_bytes else ""
            parts.append(f"{self.merged_layers} layer(s) merged into the weights (their originals kept in host "
                         f"memory, {self.backup_bytes / 1e9:.2f} GB{pinned}, to remove the LoRA exactly)")
        if self.fallback:
            why = "; ".join(f"{count} where {FALLBACK_WHY.get(reason, f'the layer is {reason}')}"
                            for reason, count in sorted(self.fallback.items()))
            parts.append(f"{sum(self.fallback.values())} adapter(s) run as a branch instead ({why})")
        return "LoRA merge: " + "; ".join(parts)


def apply_loras(dit: nn.Module, stack: Stack, streamed: Collection[int] = ()) -> Applied:
    """Make `dit` carry exactly `stack` (empty: the base model, bit for bit). `streamed`: indices of the blocks whose
    weights stream (they cannot merge)."""
    merged: dict[str, list[Contribution]] = {}
    branches: list[tuple[ParsedLora, float]] = []
    applied = Applied()
    for parsed, strength, mode in stack:
        kept = {}
        for path, adapter in parsed.adapters.items():
            physical, slice_index, slices = _physical(dit, path)
            if mode == "merge":
                reason = merge_refusal(dit, physical, streamed)
                if reason is None:
                    merged.setdefault(physical, []).append(
                        Contribution((parsed.stamp, path), slice_index, slices, adapter, strength))
                    continue
                applied.fallback[reason] += 1
            kept[path] = adapter
        if kept:
            branches.append((replace(parsed, adapters=kept), strength))
        applied.ran.append("branch" if len(kept) == len(parsed.adapters) else "merge" if not kept
                           else "merge and branch")
    if branches or wrapped_layers(dit):  # a pure merge touches no module: captured graphs stay valid
        # Compiled blocks: zero branches keep them of one shape, only where branches run anyway (attach.py).
        pad = None if any(mode == "branch" for _, _, mode in stack) else set(streamed)
        counts = apply_stack(dit, branches, pad_blocks=pad)
        applied.branch_layers, applied.branch_bytes = counts["layers"], counts["bytes"]
    state = merge_layers(dit, merged)
    applied.merged_layers = len(state.merged)
    applied.backup_bytes, applied.backup_pinned_bytes = state.host_bytes, state.pinned_bytes
    return applied
