"""Merged LoRAs: the stack's deltas added into the weights of the resident DiT Linears, in place, and taken out again.

Per Linear: W' = W + sum_k strength_k * delta_k, with delta_k = (alpha / rank) up @ down (LoRA, LoHa) or
scale * kron(w1, w2) (LoKr), rebuilt dense in fp32 from the original W and rounded once to the weight's dtype
(fp32: exact sum; bf16/fp16: round to nearest, within half a bf16/fp16 step of the exact merge). A fused q/k/v or
gate/up Linear takes each LoRA on its own row slice. FP8 Linears (QuantLinear "fp8") are dequantised, the delta is
added in fp32 and the sum is quantised again with a scale of the layer's own layout (one per tensor or one per
row, recomputed from the merged weight) by stochastic rounding (requant.py). Work goes row chunk by row chunk, so
the device needs a few fp32 chunks (32 MB each) beside the weights, never a whole dense delta.

The tensors are edited in place: the same tensor objects at the same addresses, so a compiled block keeps its graph
(torch.compile guards on tensor metadata, not values) and a captured CUDA graph replays the merged weights; a
LoRA change recompiles and recaptures nothing. Before a Linear's first edit its original tensors are copied to
host memory (backup.py). A change of the stack restores the Linears whose contributions changed from that copy, bit
for bit, then merges them again; Linears no LoRA adapts any more are restored and their copy freed. So the host
memory held is the size of the merged weights, and removing every LoRA gives the base model exactly.

Mergeable: nn.Linear in fp32/bf16/fp16 and FP8 QuantLinear whose weights stay resident. Not: Linears of streamed
blocks (re-uploaded from the host slab every step), GGUF and NVFP4 layers (a merge would need requantising to their
block formats): those keep the branch (attach.py); see `merge_refusal`.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Collection, Optional

import torch
from torch import nn

from ..quant.fp8 import dequantize_fp8
from ..quant.linear import QuantLinear
from .adapters import Adapter, Kron, LowRank
from .attach import LoraLinear
from .backup import LayerBackup
from .requant import fp8_scale_for, layer_seed, stochastic_round_fp8

CHUNK_ELEMENTS = 1 << 23  # weight values worked on at once: 32 MB in fp32, a few such temporaries at the peak
FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
_BLOCK = re.compile(r"^layers\.(\d+)\.")


@dataclass(frozen=True)
class Contribution:
    """One LoRA's adapter on one output slice of a physical Linear, with its strength; `key` identifies it."""

    key: tuple
    slice_index: int
    slices: int
    adapter: Adapter
    strength: float


class MergeState:
    """What is merged into one DiT now: per physical Linear its backup and the contributions it carries."""

    def __init__(self) -> None:
        self.backups: dict[str, LayerBackup] = {}
        self.merged: dict[str, tuple] = {}

    @property
    def host_bytes(self) -> int:
        return sum(backup.nbytes for backup in self.backups.values())

    @property
    def pinned_bytes(self) -> int:
        return sum(backup.pinned_bytes for backup in self.backups.values())

    def host_tensors(self) -> list[torch.Tensor]:
        return [tensor for backup in self.backups.values() for tensor in backup.copies.values()]


def merge_state(dit: nn.Module) -> Optional[MergeState]:
    return getattr(dit, "lora_merge", None)


def base_linear(dit: nn.Module, physical: str) -> nn.Module:
    module = dit.get_submodule(physical)
    return module.base if isinstance(module, LoraLinear) else module


def merge_refusal(dit: nn.Module, physical: str, streamed: Collection[int]) -> Optional[str]:
    """Why the Linear at `physical` takes a branch instead of a merge; None when it merges."""
    block = _BLOCK.match(physical)
    if block is not None and int(block.group(1)) in streamed:
        return "streamed"
    module = base_linear(dit, physical)
    if isinstance(module, QuantLinear):
        return None if module.format == "fp8" and module.weight.dtype.itemsize == 1 else module.format
    if isinstance(module, nn.Linear) and module.weight.dtype in FLOAT_DTYPES and not module.weight.is_meta:
        return None
    return type(module).__name__


def _edited(module: nn.Module) -> dict[str, torch.Tensor]:
    """The live tensors a merge overwrites: the weight, and an FP8 layer's scales."""
    if isinstance(module, QuantLinear):
        names = [n for n in ("weight", "weight_scale", "weight_scale_row") if getattr(module, n, None) is not None]
        return {name: getattr(module, name) for name in names}
    return {"weight": module.weight.data}


def _editing(module: nn.Module) -> torch.inference_mode:
    """The mode a layer's tensors may be edited in place in: inference mode for tensors made in it (a DiT built or
    fused under `torch.inference_mode()`, as a caller's code may do), outside it for normal tensors (whose in-place
    edits outside inference mode must stay possible)."""
    return torch.inference_mode(any(t.is_inference() for t in _edited(module).values()))


def merge_layers(dit: nn.Module, wanted: dict[str, list[Contribution]]) -> MergeState:
    """Make the DiT's merged Linears carry exactly `wanted` (physical path -> contributions; {}: none merged)."""
    state = merge_state(dit)
    if state is None:
        state = MergeState()
        dit.lora_merge = state
    signatures = {physical: tuple((c.key, c.slice_index, c.strength) for c in contributions)
                  for physical, contributions in wanted.items()}
    freed: list[LayerBackup] = []
    device = None
    with torch.no_grad():
        for physical in [p for p, signature in state.merged.items() if signatures.get(p) != signature]:
            module = base_linear(dit, physical)
            with _editing(module):
                state.backups[physical].restore(_edited(module))
            del state.merged[physical]
            device = module.weight.device
            if physical not in wanted:
                freed.append(state.backups.pop(physical))
        for physical, contributions in wanted.items():
            if state.merged.get(physical) == signatures[physical]:
                continue
            module = base_linear(dit, physical)
            with _editing(module):
                if physical not in state.backups:
                    state.backups[physical] = LayerBackup(_edited(module))
                if isinstance(module, QuantLinear):
                    _merge_fp8(module, contributions, layer_seed(physical))
                else:
                    _merge_float(module.weight.data, contributions)
            state.merged[physical] = signatures[physical]
    if freed:
        if device is not None and device.type == "cuda":
            torch.cuda.synchronize(device)  # the restoring copies read the host memory about to be freed
        for backup in freed:
            backup.free()
    return state


def _rows_per_chunk(in_features: int) -> int:
    return max(1, CHUNK_ELEMENTS // max(in_features, 1))


class _DeltaRows:
    """The summed delta of a Linear's contributions, row range by row range, on the weight's device in fp32."""

    def __init__(self, contributions: list[Contribution], out_features: int, device: torch.device) -> None:
        self.width = out_features // (contributions[0].slices if contributions else 1)
        self.parts = []
        for c in contributions:
            adapter = c.adapter
            if isinstance(adapter, LowRank):
                tensors = (adapter.up.to(device) * (adapter.scale * c.strength), adapter.down.to(device))
            else:
                tensors = (adapter.w1.to(device) * (adapter.scale * c.strength), adapter.w2.to(device))
            self.parts.append((c.slice_index * self.width, adapter, tensors))

    def covered(self) -> list[tuple[int, int]]:
        """The row ranges some contribution reaches, in order, overlapping ones joined."""
        ranges: list[tuple[int, int]] = []
        for low, high in sorted((offset, offset + self.width) for offset, _, _ in self.parts):
            if ranges and low <= ranges[-1][1]:
                ranges[-1] = (ranges[-1][0], max(ranges[-1][1], high))
            else:
                ranges.append((low, high))
        return ranges

    def add_to(self, acc: torch.Tensor, start: int) -> None:
        """acc (rows start.. of the weight, fp32) += the delta of those rows."""
        stop = start + acc.shape[0]
        for offset, adapter, tensors in self.parts:
            low, high = max(start, offset), min(stop, offset + self.width)
            if low >= high:
                continue
            a, b = low - offset, high - offset  # rows within the slice
            if isinstance(adapter, LowRank):
                up, down = tensors
                delta = up[a:b] @ down
            else:
                w1, w2 = tensors
                rows2 = w2.shape[0]
                first, last = a // rows2, (b - 1) // rows2
                delta = torch.kron(w1[first:last + 1], w2)[a - first * rows2: b - first * rows2]
            acc[low - start: high - start] += delta


def _merge_float(weight: torch.Tensor, contributions: list[Contribution]) -> None:
    out_features, in_features = weight.shape
    deltas = _DeltaRows(contributions, out_features, weight.device)
    step = _rows_per_chunk(in_features)
    for start in range(0, out_features, step):
        rows = weight[start: start + step]
        acc = rows.to(torch.float32, copy=True)
        deltas.add_to(acc, start)
        rows.copy_(acc)


def _merge_fp8(layer: QuantLinear, contributions: list[Contribution], seed: int) -> None:
    data = layer.weight
    out_features, in_features = data.shape
    scale = getattr(layer, "weight_scale", None)
    per_row = scale is not None and scale.numel() > 1
    old_scale = (scale.to(torch.float32).reshape(-1) if scale is not None
                 else torch.ones(1, device=data.device))
    deltas = _DeltaRows(contributions, out_features, data.device)
    step = _rows_per_chunk(in_features)

    def merged(start: int, stop: int) -> torch.Tensor:
        acc = dequantize_fp8(data[start:stop], old_scale[start:stop] if per_row else old_scale.reshape(()),
                             torch.float32)
        deltas.add_to(acc, start)
        return acc

    # With a scale per row, a row no contribution reaches keeps its codes and scale (a stacked q/k/v whose LoRA
    # adapts q alone leaves k and v as they were); one scale for the tensor changes every row.
    ranges = deltas.covered() if per_row else [(0, out_features)]
    chunks = [(start, min(start + step, high)) for low, high in ranges for start in range(low, high, step)]
    if scale is None:
        new_scale = old_scale
    elif per_row:
        new_scale = old_scale.clone()
    else:
        amax = max(float(merged(start, stop).abs().amax()) for start, stop in chunks)
        new_scale = fp8_scale_for(torch.tensor([amax], device=data.device), data.dtype)
    generator = torch.Generator(device=data.device)
    generator.manual_seed(seed)
    for start, stop in chunks:
        acc = merged(start, stop)
        if per_row:
            new_scale[start:stop] = fp8_scale_for(acc.abs().amax(dim=1), data.dtype)
            divisor = new_scale[start:stop].unsqueeze(1)
        else:
            divisor = new_scale.reshape(())
        data[start:stop].copy_(stochastic_round_fp8(acc / divisor, data.dtype, generator))
    if scale is not None:
        scale.copy_(new_scale.reshape(scale.shape).to(scale.dtype))
    row = getattr(layer, "weight_scale_row", None)
    if row is not None:
        row.copy_(new_scale.reshape(1, -1).expand(row.shape).to(row.dtype))
