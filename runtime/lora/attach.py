"""Put LoRA branches on a built ErnieDiT and take them off: the base weights are never touched.

Each adapted Linear (nn.Linear, a fused q/k/v or gate/up Linear, or a packed QuantLinear) is replaced in its
parent by a `LoraLinear` that keeps it as its child `base` (the same object, so a streamer's entries still point
at its tensors) and adds a branch computed from the input:

    y = base(x) + up @ (down @ x)              low-rank part: every LoRA and LoHa of the layer, ranks concatenated
        + sum_k  vec(w1_k X w2_k^T)             one term per LoKr, X = x seen as [in1, in2]

Strengths and alpha / rank are folded into `up` (and LoKr's w1), so the branch is two GEMMs whatever the stack.
A fused layer carries S slices (q, k, v or gate, up): `down` is [S * R, in] and `up` is [S, out / S, R], each
slice's LoRAs in its own rows, so every LoRA lands on its own output slice. The branch tensors are buffers of the
wrapper, made on the DiT's compute device after placement: streamed blocks keep streaming only their base
weights and the branches stay resident. Removing a LoRA puts the base module back, so the empty stack is the base
model bit for bit. Compiled blocks get one branch shape per layer kind (zero-padded where a LoRA skips a block, ranks
padded to the largest), so they keep one graph for all of them; uncompiled blocks carry only the branches their
LoRAs have, each of its own rank (no zero work per step). A switch to LoRAs of the same shapes only copies new
values into the existing buffers, which a compiled block takes without recompiling.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Collection, Optional

import torch
import torch.nn.functional as F
from torch import nn

from ..model.compile import blocks_compiled
from ..model.dit import ErnieDiT
from .adapters import Kron, LowRank
from .parsed import ParsedLora

_FUSED = {"to_q": ("to_qkv", 0, 3), "to_k": ("to_qkv", 1, 3), "to_v": ("to_qkv", 2, 3),
          "gate_proj": ("gate_up", 0, 2), "up_proj": ("gate_up", 1, 2)}
_BLOCK = re.compile(r"^layers\.(\d+)\.(.+)$")


class LoraLinear(nn.Module):
    def __init__(self, base: nn.Module, slices: int, out_features: int, in_features: int) -> None:
        super().__init__()
        self.base = base
        self.slices = slices
        self.out_features = out_features
        self.in_features = in_features
        self.register_buffer("lora_down", None)
        self.register_buffer("lora_up", None)
        self.kron_slices: list[int] = []

    @property
    def weight(self):  # what code reading `linear.weight` (dtype, device) expects
        return self.base.weight

    @property
    def bias(self):
        return self.base.bias

    def kron_terms(self) -> list[tuple[int, torch.Tensor, torch.Tensor]]:
        return [(s, getattr(self, f"kron_w1_{i}"), getattr(self, f"kron_w2_{i}")) for i, s in enumerate(self.kron_slices)]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.base(x)
        down, up = self.lora_down, self.lora_up
        if down is not None:
            h = F.linear(x.to(down.dtype), down)
            if self.slices == 1:
                y = y + F.linear(h, up[0]).to(y.dtype)
            else:
                delta = torch.einsum("...sr,sor->...so", h.unflatten(-1, (self.slices, up.shape[-1])), up)
                y = (y.unflatten(-1, (self.slices, up.shape[1])) + delta.to(y.dtype)).flatten(-2)
        if self.kron_slices:
            width = self.out_features // self.slices
            for slice_index, w1, w2 in self.kron_terms():
                xs = x.to(w1.dtype).unflatten(-1, (w1.shape[1], w2.shape[1]))
                delta = torch.matmul(torch.matmul(w1, xs), w2.t()).flatten(-2).to(y.dtype)
                if self.slices == 1:
                    y = y + delta
                else:
                    y[..., slice_index * width:(slice_index + 1) * width] += delta
        return y

    def extra_repr(self) -> str:
        rank = 0 if self.lora_down is None else self.lora_up.shape[-1]
        return f"slices={self.slices}, rank={rank}, kron_terms={len(self.kron_slices)}"


@dataclass
class _Branch:
    """What one physical Linear receives: per slice the (down, up) pairs with strength folded in, LoKr terms."""

    slices: int
    out_features: int
    in_features: int
    low: list[list[tuple[torch.Tensor, torch.Tensor]]]
    kron: list[tuple[int, torch.Tensor, torch.Tensor]] = field(default_factory=list)

    def slice_rank(self, index: int) -> int:
        return sum(down.shape[0] for down, _ in self.low[index])


def _physical(dit: ErnieDiT, path: str) -> tuple[str, int, int]:
    """(module path in the built DiT, output slice, slices) of a diffusers Linear path (fused layers differ)."""
    match = _BLOCK.match(path)
    if match is not None:
        parent_path, _, leaf = match.group(2).rpartition(".")
        fused = _FUSED.get(leaf)
        if fused is not None:
            parent = dit.layers[int(match.group(1))].get_submodule(parent_path)
            if getattr(parent, fused[0], None) is not None:
                return f"layers.{match.group(1)}.{parent_path}.{fused[0]}", fused[1], fused[2]
    return path, 0, 1


def plan_branches(dit: ErnieDiT, stack: list[tuple[ParsedLora, float]]) -> dict[str, _Branch]:
    branches: dict[str, _Branch] = {}
    for parsed, strength in stack:
        for path, adapter in parsed.adapters.items():
            physical, slice_index, slices = _physical(dit, path)
            branch = branches.get(physical)
            if branch is None:
                linear = dit.get_submodule(physical)  # nn.Linear, QuantLinear or LoraLinear: all say their shape
                out_features, in_features = linear.out_features, linear.in_features
                branch = _Branch(slices, out_features, in_features, [[] for _ in range(slices)])
                branches[physical] = branch
            if isinstance(adapter, LowRank):
                branch.low[slice_index].append((adapter.down, adapter.up * (adapter.scale * strength)))
            else:
                branch.kron.append((slice_index, adapter.w1 * (adapter.scale * strength), adapter.w2))
    return branches


def _ranks(branches: dict[str, _Branch], uniform: bool) -> dict[str, int]:
    """The rank every physical Linear's branch gets: its own (its largest slice's), or with `uniform` per layer kind
    inside the blocks the largest over blocks (so all blocks share one shape)."""
    own = {physical: max(branch.slice_rank(s) for s in range(branch.slices)) for physical, branch in branches.items()}
    if not uniform:
        return own
    by_kind: dict[str, int] = {}
    for physical, rank in own.items():
        by_kind[_kind(physical)] = max(by_kind.get(_kind(physical), 0), rank)
    return {physical: by_kind[_kind(physical)] for physical in branches}


def _kind(physical: str) -> str:
    match = _BLOCK.match(physical)
    return "block." + match.group(2) if match else physical


def _block_kinds_to_pad(dit: ErnieDiT, branches: dict[str, _Branch],
                        blocks: Optional[Collection[int]] = None) -> None:
    """Give every block (of `blocks`; None: all) a (zero) branch on a layer kind that some block's LoRA adapts."""
    kinds = {_kind(p)[len("block."):] for p in branches if _kind(p).startswith("block.")}
    for index in (range(len(dit.layers)) if blocks is None else sorted(blocks)):
        for kind in kinds:
            physical = f"layers.{index}.{kind}"
            if physical not in branches:
                template = next(b for p, b in branches.items() if _kind(p) == "block." + kind)
                branches[physical] = _Branch(template.slices, template.out_features, template.in_features,
                                             [[] for _ in range(template.slices)])


def _write_low_rank(branch: _Branch, rank: int, down: torch.Tensor, up: torch.Tensor) -> None:
    """Each slice's LoRAs side by side in its `rank` rows of `down` / columns of `up`; the rest zero."""
    down.zero_()
    up.zero_()
    for index, pairs in enumerate(branch.low):
        offset = 0
        for d, u in pairs:
            r = d.shape[0]
            down[index * rank + offset: index * rank + offset + r].copy_(d)
            up[index, :, offset: offset + r].copy_(u)
            offset += r


def estimate_bytes(stack: list[tuple[ParsedLora, float]], dtype: torch.dtype) -> int:
    """Device bytes of the stack's branches, known before the DiT is built (what the planner counts): exact but for
    zero padding, which only a fused layer with unequal q/k/v ranks or, in compiled blocks, a LoRA skipping some
    blocks has."""
    return sum(parsed.branch_params() for parsed, _ in stack) * dtype.itemsize


def _split(dit: nn.Module, path: str) -> tuple[nn.Module, str]:
    parent, _, leaf = path.rpartition(".")
    return (dit.get_submodule(parent) if parent else dit), leaf


def _get_child(parent: nn.Module, leaf: str) -> nn.Module:
    return parent[int(leaf)] if isinstance(parent, (nn.ModuleList, nn.Sequential)) else getattr(parent, leaf)


def _set_child(parent: nn.Module, leaf: str, module: nn.Module) -> None:
    if isinstance(parent, (nn.ModuleList, nn.Sequential)):
        parent[int(leaf)] = module
    else:
        setattr(parent, leaf, module)


def wrapped_layers(dit: nn.Module) -> dict[str, LoraLinear]:
    return {name: module for name, module in dit.named_modules() if isinstance(module, LoraLinear)}


def apply_stack(dit: ErnieDiT, stack: list[tuple[ParsedLora, float]], device: Optional[torch.device] = None,
                dtype: Optional[torch.dtype] = None, pad_blocks: Optional[Collection[int]] = None) -> dict[str, int]:
    """Make `dit` carry exactly `stack` (an empty one: the base model). Existing branches of the same shape get
    the new values in place; others are rebuilt; layers no LoRA adapts any more get their base module back.
    Compiled blocks (blocks_compiled) share one branch shape per layer kind: `pad_blocks` are the blocks that get
    zero branches where the stack skips them (None: all; a merged LoRA's branch on streamed blocks pads only those,
    so the merged blocks carry no branch). Uncompiled blocks get no zero branch and no padded rank.
    Returns counts: {"layers": adapted Linears, "bytes": branch bytes on the device}."""
    device = torch.device(device) if device is not None else dit.x_embedder.proj.weight.device
    dtype = dtype or dit.dtype
    branches = plan_branches(dit, stack)
    one_shape = blocks_compiled(dit)
    if branches and one_shape:
        _block_kinds_to_pad(dit, branches, pad_blocks)
    ranks = _ranks(branches, uniform=one_shape)
    branches = {p: b for p, b in branches.items() if ranks[p] or b.kron}  # e.g. a LoKr-only kind padded with nothing
    current = wrapped_layers(dit)
    for physical, wrapper in current.items():
        if physical not in branches:
            parent, leaf = _split(dit, physical)
            _set_child(parent, leaf, wrapper.base)
    total = 0
    with torch.inference_mode(False), torch.no_grad():  # buffers refilled in place later must not be inference tensors
        for physical, branch in branches.items():
            wrapper = current.get(physical)
            if wrapper is None:
                parent, leaf = _split(dit, physical)
                wrapper = LoraLinear(_get_child(parent, leaf), branch.slices, branch.out_features, branch.in_features)
                _set_child(parent, leaf, wrapper)
            total += _fill(wrapper, branch, ranks[physical], device, dtype)
    if hasattr(dit, "structure_version"):
        dit.structure_version += 1  # captured forwards (dit_graphs) are recaptured once
    return {"layers": len(branches), "bytes": total}


def _fill(wrapper: LoraLinear, branch: _Branch, rank: int, device: torch.device, dtype: torch.dtype) -> int:
    nbytes = 0
    if rank:
        down_shape = (branch.slices * rank, branch.in_features)
        up_shape = (branch.slices, branch.out_features // branch.slices, rank)
        down, up = wrapper.lora_down, wrapper.lora_up
        reusable = down is not None and tuple(down.shape) == down_shape and tuple(up.shape) == up_shape \
            and down.dtype == dtype and down.device == device
        if not reusable:  # same tensors otherwise: a compiled block sees new values, not a new graph input
            down = torch.empty(down_shape, device=device, dtype=dtype)
            up = torch.empty(up_shape, device=device, dtype=dtype)
        _write_low_rank(branch, rank, down, up)
        wrapper.lora_down, wrapper.lora_up = down, up
        nbytes += (down.numel() + up.numel()) * dtype.itemsize
    else:
        wrapper.lora_down = wrapper.lora_up = None
    for index in range(len(wrapper.kron_slices)):
        delattr(wrapper, f"kron_w1_{index}")
        delattr(wrapper, f"kron_w2_{index}")
    wrapper.kron_slices = []
    for index, (slice_index, w1, w2) in enumerate(branch.kron):
        wrapper.register_buffer(f"kron_w1_{index}", w1.to(device=device, dtype=dtype))
        wrapper.register_buffer(f"kron_w2_{index}", w2.to(device=device, dtype=dtype))
        wrapper.kron_slices.append(slice_index)
        nbytes += (w1.numel() + w2.numel()) * dtype.itemsize
    return nbytes


def remove_all(dit: ErnieDiT) -> None:
    """Every wrapped Linear back to its base module."""
    apply_stack(dit, [])
