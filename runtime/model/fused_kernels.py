"""comfy-kitchen's fused CUDA kernels for the uncompiled DiT, where the package is installed.

comfy-kitchen (`pip install comfy-kitchen`) is the kernel library ComfyUI's own ERNIE-Image DiT uses; its CUDA
backend ships compiled, so it needs no Triton. Two of its kernels each replace several PyTorch passes of the eager
forward:
- `rms_rope_split_half`: q's and k's per-head RMSNorm (with their weights) and ERNIE's split-half RoPE, one pass
  over each;
- `rms_adaln`: an adaLN RMSNorm and its modulation (the norm's weight folded into the scale), one pass.
They serve only the eager forward's fast arithmetic (arithmetic.py) on CUDA with bf16/fp16 activations
(torch.compile fuses the same work itself) and only through the package's CUDA backend, never its Python
fallbacks. A model's Arithmetic(kitchen_rope=False, kitchen_adaln=False), or the environment variable
ERNIE_IMAGE_FUSED_KERNELS=0 for the whole process, turns them off; without the package the PyTorch forms run.
"""
from __future__ import annotations

import functools
import os
from types import ModuleType
from typing import Optional

import torch

HALF_DTYPES = (torch.bfloat16, torch.float16)


@functools.lru_cache(maxsize=None)
def cuda_backend() -> Optional[ModuleType]:
    """comfy-kitchen's CUDA backend module when it is installed, loads and has both kernels; else None."""
    if os.environ.get("ERNIE_IMAGE_FUSED_KERNELS", "1") == "0" or not torch.cuda.is_available():
        return None
    try:
        import comfy_kitchen  # noqa: F401  (registers its backends)
        from comfy_kitchen.backends import cuda as backend
        from comfy_kitchen.registry import registry
    except Exception:  # not installed, or built for another PyTorch/CUDA: the PyTorch forms serve
        return None
    compiled = getattr(backend, "_C", None)
    if not registry.is_available("cuda") or compiled is None:
        return None
    if not all(hasattr(compiled, op) for op in ("rms_rope", "rms_adaln")):
        return None
    return backend


def serves(x: torch.Tensor) -> bool:
    """Whether the kernels can take `x`: a bf16/fp16 CUDA tensor, with comfy-kitchen's CUDA backend present."""
    return x.is_cuda and x.dtype in HALF_DTYPES and cuda_backend() is not None


def rope_serves(x: torch.Tensor, head_dim: Optional[int] = None) -> bool:
    """For q/k rows of `head_dim` values (None: already checked): the kernel takes multiples of 32."""
    fits = head_dim is None or (head_dim >= 32 and head_dim % 32 == 0)
    return fits and serves(x)


def adaln_serves(x: torch.Tensor) -> bool:
    return serves(x)


def rope_matrices(angles: torch.Tensor) -> torch.Tensor:
    """The kernel's rotation for per-element RoPE angles [B, S, 1, hd] (element i pairs with i + hd/2, each with its
    own angle, as ERNIE's tables have it): fp32 [B, S, 1, hd/2, 2, 2] = [[cos a_i, -sin a_i], [sin b_i, cos b_i]]
    with a = the first half's angles, b = the second's."""
    first, second = angles.float().chunk(2, dim=-1)
    rotation = torch.stack((first.cos(), -first.sin(), second.sin(), second.cos()), dim=-1)
    return rotation.unflatten(-1, (2, 2)).contiguous()


def rms_rope(q: torch.Tensor, k: torch.Tensor, rotation: torch.Tensor, q_weight: torch.Tensor,
             k_weight: torch.Tensor, eps: float) -> tuple[torch.Tensor, torch.Tensor]:
    """rope(rms_norm(q) * q_weight), rope(rms_norm(k) * k_weight) for q, k [B, S, H, hd]."""
    return cuda_backend().rms_rope_split_half(q, k, rotation, q_weight.to(q.dtype), k_weight.to(k.dtype), eps)


def rms_adaln(x: torch.Tensor, scale: torch.Tensor, shift: torch.Tensor, eps: float) -> torch.Tensor:
    """rms_norm(x) * (1 + scale) + shift for x [B, S, D] and scale, shift [B, 1, D] in x's dtype."""
    return cuda_backend().rms_adaln(x, scale, shift, eps)
