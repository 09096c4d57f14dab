"""Regional compilation of the DiT: one compiled graph serves all 36 identical blocks.

Compiling the block (not the whole model) keeps the first call short, lets the offloader keep its block loop,
and fuses everything between the GEMMs (RMSNorm, modulation, RoPE, gated GELU, gated residuals) into a few
kernels. Sequence length changes (prompt lengths) make the compiler switch to a dynamic-shape graph once.
"""
from __future__ import annotations

import torch
from torch import nn

from .dit import ErnieDiT


def compile_available(device: torch.device) -> bool:
    if device.type != "cuda":
        return False
    import importlib.util

    return importlib.util.find_spec("triton") is not None


def fuse_projections(dit: ErnieDiT, stack_packed: bool = True) -> int:
    """q/k/v into one GEMM and gate/up into one: larger GEMMs run closer to peak. Packed layers stack where their
    format can (QuantLinear.stacked_with) and `stack_packed` says the device multiplies them natively (dequantised
    per call, a stacked layer only needs more memory at once). Returns how many were fused."""
    fused = 0
    for block in dit.layers:
        fused += int(block.self_attention.fuse_projections(stack_packed))
        fused += int(block.mlp.fuse_projections(stack_packed))
    if fused:
        dit.structure_version += 1  # new modules and tensors: captured forwards (dit_graphs) are stale
    return fused


CACHE_SIZE_LIMIT = 64  # graphs dynamo keeps per compiled code: shapes and LoRA structures, for all 36 blocks


def allow_cache_size() -> None:
    """Let dynamo keep CACHE_SIZE_LIMIT graphs per code object (its default is too few for the blocks' variants)."""
    torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, CACHE_SIZE_LIMIT)


def compile_blocks(dit: ErnieDiT) -> bool:
    """Compile each block in place; returns False (and leaves the model eager) when the compiler is missing."""
    device = dit.final_linear.weight.device
    if not compile_available(device):
        return False
    allow_cache_size()
    for block in dit.layers:
        block.compile()
    return True


def blocks_compiled(dit: nn.Module) -> bool:
    """Whether the DiT's blocks run compiled (compile_blocks): code that changes them (LoRA branches) keeps one
    structure for all of them, and CUDA-graph replay (dit_graphs.py) leaves them to inductor."""
    layers = getattr(dit, "layers", None)
    return layers is not None and len(layers) > 0 and getattr(layers[0], "_compiled_call_impl", None) is not None
