"""Dequantise a whole packed weight with one Triton kernel (GGUF block types and NVFP4).

`dequantize_triton` returns the same tensor as `qweight.dequantize_packed`, bit for bit after rounding to
the output dtype (see triton_kernels.py for why), or None when there is no kernel for the type, the shapes
do not fit one, or Triton cannot run here; the caller then takes the torch path, which also reports bad
inputs. Triton is imported on first use only (triton_loader.py, which also says where the kernels run), so
the pack imports without it.
"""
from __future__ import annotations

import contextlib
import math
from types import ModuleType

import torch

from .gguf_blocks import BLOCK_GEOMETRY
from .nvfp4 import BLOCK as NVFP4_BLOCK, _roundup
from .triton_loader import cdiv, kernels_for

# GGML type -> kernel name in triton_kernels.py.
GGUF_KERNELS = {"Q8_0": "q8_0_kernel", "Q4_0": "q4_0_kernel", "Q4_1": "q4_1_kernel", "Q5_0": "q5_0_kernel",
                "Q5_1": "q5_1_kernel", "IQ4_NL": "iq4_nl_kernel", "Q2_K": "q2_k_kernel", "Q3_K": "q3_k_kernel",
                "Q4_K": "q4_k_kernel", "Q5_K": "q5_k_kernel", "Q6_K": "q6_k_kernel", "IQ4_XS": "iq4_xs_kernel"}
OUTPUT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)
# Output values per program: 4096 with 8 warps = 16 values (32 bytes of bf16) per thread, ~12k programs
# for a 12288x4096 weight, i.e. ~90 waves over an H100/H200's 132 SMs: enough to hide memory latency.
DEFAULT_TILE = 4096
NVFP4_TILE_COLS = 256  # tile = [DEFAULT_TILE / 256 rows, 256 columns]: 128 packed bytes per row, 512 B out


def has_triton_kernel(fmt: str, qtype: str) -> bool:
    """Whether a kernel covers this packed type (shapes, dtypes and the device are checked per call)."""
    return (fmt == "gguf" and qtype in GGUF_KERNELS) or fmt == "nvfp4"


def triton_available(device: torch.device) -> bool:
    """True when Triton kernels can run on tensors on `device` (see the module docstring)."""
    return _kernels_for(device) is not None


def _kernels_for(device: torch.device) -> ModuleType | None:
    return kernels_for("triton_kernels", device)


def _num_warps(tile: int) -> int:
    return max(1, min(8, tile // 512))


def dequantize_triton(fmt: str, qtype: str, shape: tuple[int, ...], data: torch.Tensor,
                      scale: torch.Tensor | None, scale_2: torch.Tensor | None, dtype: torch.dtype,
                      tile: int = DEFAULT_TILE) -> torch.Tensor | None:
    """Packed weight -> `dtype` tensor of `shape` in one kernel, or None (then use the torch path).

    Arguments as `qweight.dequantize_packed`; `tile` (output values per program, a power of two >= 256)
    is for benchmarking tile sizes.
    """
    if dtype not in OUTPUT_DTYPES or data.dtype != torch.uint8 or not has_triton_kernel(fmt, qtype):
        return None
    if fmt == "nvfp4" and (scale is None or scale_2 is None or len(shape) != 2):
        return None
    kernels = _kernels_for(data.device)
    if kernels is None:
        return None
    shape = tuple(int(s) for s in shape)
    with torch.cuda.device(data.device) if data.device.type == "cuda" else contextlib.nullcontext():
        if fmt == "gguf":
            return _launch_gguf(kernels, qtype, shape, data, dtype, tile)
        return _launch_nvfp4(kernels, shape, data, scale, scale_2, dtype, tile)


def _launch_gguf(kernels: ModuleType, qtype: str, shape: tuple[int, ...], data: torch.Tensor, dtype: torch.dtype,
                 tile: int) -> torch.Tensor | None:
    block_size, type_size = BLOCK_GEOMETRY[qtype]
    numel = math.prod(shape)
    n_blocks = numel // block_size
    if numel % block_size or data.numel() != n_blocks * type_size:
        return None
    out = torch.empty(shape, dtype=dtype, device=data.device)
    if n_blocks == 0:
        return out
    blocks_per_program = max(1, tile // block_size)
    grid = (cdiv(n_blocks, blocks_per_program),)
    getattr(kernels, GGUF_KERNELS[qtype])[grid](data.contiguous(), out, n_blocks, BLOCKS=blocks_per_program,
                                                num_warps=_num_warps(tile))
    return out


def _launch_nvfp4(kernels: ModuleType, shape: tuple[int, ...], data: torch.Tensor, scale: torch.Tensor,
                  scale_2: torch.Tensor, dtype: torch.dtype, tile: int) -> torch.Tensor | None:
    rows, cols = shape
    scale_rows, scale_cols = _roundup(rows, 128), _roundup(cols // NVFP4_BLOCK, 4)
    if cols % NVFP4_BLOCK or tuple(data.shape) != (rows, cols // 2) or scale.numel() != scale_rows * scale_cols \
            or scale.element_size() != 1 or scale_2.numel() != 1:
        return None
    out = torch.empty(shape, dtype=dtype, device=data.device)
    if out.numel() == 0:
        return out
    tile_cols = min(NVFP4_TILE_COLS, tile)
    tile_rows = max(1, tile // tile_cols)
    grid = (cdiv(rows, tile_rows), cdiv(cols, tile_cols))
    scale_bytes = scale.contiguous().view(torch.uint8)
    tensor_scale = scale_2.to(device=data.device, dtype=torch.float32).reshape(1)
    kernels.nvfp4_kernel[grid](data.contiguous(), scale_bytes, tensor_scale, out, rows, cols, scale_cols,
                               ROWS=tile_rows, COLS=tile_cols, num_warps=_num_warps(tile))
    return out
