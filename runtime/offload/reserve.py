"""How much free device memory a local pipe needs before a job: what it asks its host (ComfyUI) to make room for.

Phases (prompt enhancer, text encoder, DiT, VAE decode) run one after another; each needs its own weights plus
its activation workspace (workspace.py) on the device at once. The ask is the largest phase's need, counting as
already there the weights of that phase this pipe still holds on the device (keep_loaded): asking for them again
would make ComfyUI unload its own models for nothing. A VRAM budget is the user's word on how much the pipe may
use in all, so the ask is then the budget less everything the pipe holds. Pure arithmetic except
`device_bytes_held`, which reads tensors' devices.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Collection, Mapping, Optional

import torch
from torch import nn

from ..quant.qweight import block_format
from .sizes import FORMAT_BYTES, LayeredSize, ModelSizes
from .workspace import Job, dit_workspace, pe_workspace, text_workspace, vae_encode_workspace, vae_workspace

PHASES = ("encode", "pe", "text", "dit", "vae")


@dataclass(frozen=True)
class PhaseNeed:
    weights: int  # bytes of the phase's weights on the device while it runs
    workspace: int  # its activation peak for the job (depends on width, height, batch, CFG)


def phase_needs(sizes: ModelSizes, job: Job, device_type: str = "cuda",
                phases: Optional[Collection[str]] = None) -> dict[str, PhaseNeed]:
    """Weights and activation peak of each phase of `job` (the PE only when the job uses it), whole-image decode.

    `phases`: only these (e.g. ("pe",) for a prompt-enhancer run on its own); None: every phase of the job.
    """
    needs = {
        "text": PhaseNeed(sizes.text.total_bytes, text_workspace(sizes, device_type)),
        "dit": PhaseNeed(sizes.dit.total_bytes, dit_workspace(sizes, job, device_type)),
        "vae": PhaseNeed(sizes.vae_bytes, vae_workspace(sizes, job, None, device_type)),
    }
    if job.use_pe and sizes.pe is not None:
        needs["pe"] = PhaseNeed(sizes.pe.total_bytes, pe_workspace(sizes, device_type))
    if job.encode:
        needs["encode"] = PhaseNeed(sizes.vae_encoder_bytes, vae_encode_workspace(sizes, job, None, device_type))
    if phases is not None:
        needs = {name: need for name, need in needs.items() if name in phases}
    return needs


def device_bytes_needed(device_type: str, budget: Optional[int], needs: Mapping[str, PhaseNeed],
                        held: Mapping[str, int]) -> Optional[int]:
    """Free device bytes to ask for before a job. None off the GPU (nothing to ask of anyone).

    budget: bytes the pipe may use in all (None: no budget set) -> the budget less all `held`.
    Otherwise the largest of (phase weights not yet held + phase workspace). `held`: bytes this pipe holds on the
    device, by phase name.
    """
    if device_type != "cuda":
        return None
    if budget is not None:
        return max(budget - sum(held.values()), 0)
    if not needs:
        return 0
    return max(max(need.weights - held.get(name, 0), 0) + need.workspace for name, need in needs.items())


def file_dit_size(component, dtype_bytes: int, largest_linear_params: int) -> tuple[LayeredSize, Optional[str]]:
    """A quantised DiT file's packed sizes (GGUF, FP8/NVFP4 safetensors), before it is built: its block Linears
    as stored, its other tensors in the compute dtype; and the packed format most of its weights use (None when it
    is not one the planner knows). The config-derived estimate would count a Q4 file's blocks as bf16."""
    blocks: dict[str, int] = {}
    stem = 0
    formats: dict[str, int] = {}
    for key in component.keys:
        value = component.tensor(key)
        if isinstance(value, torch.Tensor):
            size = value.numel() * dtype_bytes
        else:  # quant.qweight.QuantizedWeight: its packed tensors as they will sit in the QuantLinear
            size = value.nbytes
            name = block_format(value.format, value.qtype)
            formats[name] = formats.get(name, 0) + size
        parts = key.split(".")
        if parts[0] == "layers" and len(parts) > 2:
            blocks[parts[1]] = blocks.get(parts[1], 0) + size
        else:
            stem += size
    dominant = max(formats, key=formats.__getitem__) if formats else None
    size = LayeredSize(len(blocks), max(blocks.values(), default=0), stem, largest_linear_params)
    return size, dominant if dominant in FORMAT_BYTES else None


def _same_device(tensor_device: torch.device, device: torch.device) -> bool:
    return tensor_device.type == device.type and (device.index is None or tensor_device.index == device.index)


def device_bytes_held(module: Optional[nn.Module], device: "torch.device | str") -> int:
    """Bytes of `module`'s parameters and buffers that live on `device`, each storage once: a streamed layer's
    tensors are views of a shared ring buffer, which is counted once and whole."""
    if module is None:
        return 0
    device = torch.device(device)
    storages: dict[tuple[str, int], int] = {}
    for tensor in (*module.parameters(), *module.buffers()):
        if tensor.is_meta or not _same_device(tensor.device, device):
            continue
        storage = tensor.untyped_storage()
        storages[(str(tensor.device), storage.data_ptr())] = storage.nbytes()
    return sum(storages.values())
