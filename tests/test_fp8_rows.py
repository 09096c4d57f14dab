"""A bf16 activation reaches an FP8 GEMM quantised per row by one kernel (runtime/quant/fp8_rows.py) that computes
fp8.quantize_activation bit for bit: the row maxima and the scales are exact, so nothing can differ."""
from __future__ import annotations

import importlib.util

import pytest
import torch

from ernie_image.runtime.quant.fp8 import native_fp8_supported, quantize_activation
from ernie_image.runtime.quant.fp8_rows import launch
from ernie_image.runtime.quant.triton_loader import kernels_for

HAS_TRITON = importlib.util.find_spec("triton") is not None
needs_triton = pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed (pip install triton)")
needs_fp8_gpu = pytest.mark.skipif(
    not (HAS_TRITON and torch.cuda.is_available() and native_fp8_supported(torch.device("cuda"))),
    reason="needs a CUDA GPU with FP8 GEMMs (SM >= 8.9) and triton")


def activation(rows: int, width: int, device: str = "cpu") -> torch.Tensor:
    """bf16 rows in a wider tensor (row stride 2 * width), with a zero row, a row of -0, a row spanning e4m3's
    subnormals and non-finite values in rows 4 to 6."""
    generator = torch.Generator(device=device).manual_seed(0)
    x = torch.randn((rows, 2 * width), generator=generator, device=device).mul_(5).bfloat16()[:, :width]
    x[1], x[2] = 0.0, -0.0
    x[3] *= torch.logspace(-6, 0, width, device=device).bfloat16()
    x[4, 3], x[5, 6], x[6, 5] = float("nan"), float("inf"), float("-inf")
    return x


def assert_bit_for_bit(got: tuple[torch.Tensor, torch.Tensor], expected: tuple[torch.Tensor, torch.Tensor]) -> None:
    """Finite rows code for code; in the non-finite rows (4 to 6) the same NaNs (whose sign bit e4m3's casts
    differ on) and the same other values."""
    finite = [0, 1, 2, 3, *range(7, got[0].shape[0])]
    assert torch.equal(got[0][finite].view(torch.uint8), expected[0][finite].contiguous().view(torch.uint8))
    assert torch.equal(got[1].nan_to_num(-1.0), expected[1].nan_to_num(-1.0))
    values, expected_values = got[0][4:7].float(), expected[0][4:7].float()
    assert torch.equal(values.isnan(), expected_values.isnan())
    assert torch.equal(values.nan_to_num(0.5), expected_values.nan_to_num(0.5))


@needs_triton
@pytest.mark.parametrize("width", [64, 100, 4096])
def test_the_kernel_computes_the_torch_form_bit_for_bit(monkeypatch: pytest.MonkeyPatch, width: int) -> None:
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    x = activation(9, width)
    assert_bit_for_bit(launch(kernels_for("triton_fp8_kernels", x.device), x), quantize_activation(x, per_row=True))


@pytest.mark.gpu
@needs_fp8_gpu
@pytest.mark.parametrize("rows, width", [(33, 96), (4352, 4096)])
def test_on_the_gpu_the_kernel_computes_the_torch_form_bit_for_bit(rows: int, width: int) -> None:
    x = activation(rows, width, "cuda")
    assert_bit_for_bit(launch(kernels_for("triton_fp8_kernels", x.device), x), quantize_activation(x, per_row=True))
