"""`QuantizedWeight`: one Linear weight kept in its packed file format, and its dequantisation.

Formats (`QuantizedWeight.format`):
  "gguf"   data = uint8 [out, in/block*type_size] GGUF blocks, `qtype` = the GGML type name ("Q4_K"...).
  "fp8"    data = float8_e4m3fn / float8_e5m2 [out, in], scale = fp32 scalar (per tensor) or [out] (per row).
  "nvfp4"  data = uint8 [out, in/2] E2M1 pairs, ComfyUI order (even element in the HIGH nibble);
           scale = float8_e4m3fn block scales (one per 16 values) in cuBLAS's blocked ("swizzled") layout,
           shape [roundup(out,128), roundup(in/16,4)]; scale_2 = fp32 per-tensor scale.
           This is ComfyUI's comfy_quant nvfp4 layout; ModelOpt files are converted to it on load.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..core.errors import ModelFileError
from .gguf_blocks import BLOCK_GEOMETRY, FLOAT_TYPES, KERNELS

FORMATS = ("gguf", "fp8", "nvfp4")



def block_format(fmt: str, qtype: str) -> str:
    """A packed weight's format as the user picks it: the GGUF block type ("q8_0", "q4_k") or "fp8" / "nvfp4"."""
    return (qtype if fmt == "gguf" else fmt).lower()


def format_label(fmt: str, qtype: str) -> str:
    """The same as shown to the user: "GGUF Q8_0", "FP8", "NVFP4"."""
    return f"GGUF {qtype.upper()}" if fmt == "gguf" else fmt.upper()

@dataclass
class QuantizedWeight:
    format: str
    qtype: str
    data: torch.Tensor
    shape: tuple[int, ...]
    scale: torch.Tensor | None = None
    scale_2: torch.Tensor | None = None
    input_scale: torch.Tensor | None = None
    dtype: torch.dtype = torch.bfloat16

    def __post_init__(self) -> None:
        if self.format not in FORMATS:
            raise ModelFileError(f"unknown quantised format {self.format!r}: expected one of {FORMATS}")
        self.shape = tuple(int(s) for s in self.shape)

    def tensors(self) -> dict[str, torch.Tensor]:
        """The packed tensors under the buffer names QuantLinear (and ComfyUI's files) use."""
        named = {"weight": self.data, "weight_scale": self.scale, "weight_scale_2": self.scale_2,
                 "input_scale": self.input_scale}
        return {k: v for k, v in named.items() if v is not None}

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors().values())

    def dequantize(self, dtype: torch.dtype | None = None, name: str = "weight") -> torch.Tensor:
        return dequantize_packed(self.format, self.qtype, self.shape, self.data, self.scale, self.scale_2,
                                 dtype or self.dtype, name)


def dequantize_gguf(data: torch.Tensor, qtype: str, shape: tuple[int, ...], dtype: torch.dtype,
                    name: str = "weight") -> torch.Tensor:
    """GGUF bytes (any leading shape, rows of whole blocks) -> `dtype` tensor of logical `shape`."""
    if qtype in FLOAT_TYPES:
        return data.reshape(shape).to(dtype)
    kernel = KERNELS.get(qtype)
    if kernel is None:
        raise ModelFileError(
            f"GGUF tensor {name!r} uses block type {qtype}, which this pack cannot dequantise; "
            f"supported: {', '.join(sorted(KERNELS))}, F32/F16/BF16 (re-quantise the file to one of them)")
    _, type_size = BLOCK_GEOMETRY[qtype]
    return kernel(data.reshape(-1, type_size)).reshape(shape).to(dtype)


def dequantize_packed(fmt: str, qtype: str, shape: tuple[int, ...], data: torch.Tensor,
                      scale: torch.Tensor | None, scale_2: torch.Tensor | None, dtype: torch.dtype,
                      name: str = "weight") -> torch.Tensor:
    if fmt == "gguf":
        return dequantize_gguf(data, qtype, shape, dtype, name)
    if fmt == "fp8":
        from .fp8 import dequantize_fp8
        return dequantize_fp8(data, scale, dtype)
    from .nvfp4 import dequantize_nvfp4
    return dequantize_nvfp4(data, scale, scale_2, shape, dtype)
