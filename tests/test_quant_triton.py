"""Triton dequant kernels give exactly the torch dequantisation, type by type and dtype by dtype.

On the CPU the kernels run in Triton's interpreter (TRITON_INTERPRET=1); the kernel code is the same code
the GPU compiles. Skipped when triton is not installed. The @gpu tests run the compiled kernels on CUDA.
"""
from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from ernie_image.runtime.quant import QuantLinear, linear as linear_module, quantize_weight
from ernie_image.runtime.quant.gguf_blocks import BLOCK_GEOMETRY, FP16_SCALE_OFFSETS
from ernie_image.runtime.quant.nvfp4 import quantize_nvfp4
from ernie_image.runtime.quant.qweight import dequantize_packed
from ernie_image.runtime.quant.triton_dequant import GGUF_KERNELS, dequantize_triton

HAS_TRITON = importlib.util.find_spec("triton") is not None

needs_triton = pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed (pip install triton)")
needs_cuda = pytest.mark.skipif(not (HAS_TRITON and torch.cuda.is_available()), reason="needs CUDA and triton")
DTYPES = (torch.float32, torch.bfloat16, torch.float16)
NVFP4_NAN_CODES = (0x7F, 0xFF)


@pytest.fixture
def interpret(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TRITON_INTERPRET", "1")


def random_blocks(qtype: str, rows: int, cols: int, rng: np.random.Generator) -> torch.Tensor:
    """Every bit pattern of the quants; scales of both signs, including fp16 subnormals and zero."""
    block_size, type_size = BLOCK_GEOMETRY[qtype]
    raw = rng.integers(0, 256, size=(rows * cols // block_size, type_size), dtype=np.uint8)
    for offset in FP16_SCALE_OFFSETS[qtype]:
        scales = rng.uniform(-0.1, 0.1, size=raw.shape[0]).astype(np.float16)
        scales[::7] = np.float16(3e-7)  # subnormal in fp16
        scales[::11] = 0
        raw[:, offset:offset + 2] = scales.view(np.uint8).reshape(-1, 2)
    return torch.from_numpy(raw.reshape(rows, -1))


def assert_same_bits(ours: torch.Tensor | None, reference: torch.Tensor) -> None:
    assert ours is not None, "no Triton kernel ran"
    assert ours.shape == reference.shape and ours.dtype == reference.dtype
    as_int = {torch.float32: torch.int32, torch.bfloat16: torch.int16, torch.float16: torch.int16}[ours.dtype]
    mismatched = (ours.view(as_int) != reference.view(as_int)).sum().item()
    assert mismatched == 0, f"{mismatched} of {ours.numel()} values differ"


@needs_triton
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("qtype", sorted(GGUF_KERNELS))
def test_gguf_kernel_is_bit_exact_against_torch(interpret: None, qtype: str, dtype: torch.dtype) -> None:
    # 9 rows of 512: the block count is no multiple of any tile, so the masked tail is exercised too.
    rows, cols = 9, 512
    data = random_blocks(qtype, rows, cols, np.random.default_rng(sum(qtype.encode())))
    reference = dequantize_packed("gguf", qtype, (rows, cols), data, None, None, dtype)
    assert torch.isfinite(reference).all()
    assert_same_bits(dequantize_triton("gguf", qtype, (rows, cols), data, None, None, dtype), reference)


@needs_triton
@pytest.mark.parametrize("fmt", ("q8_0", "q4_k"))
def test_quantised_real_weights_and_small_tiles(interpret: None, fmt: str) -> None:
    weight = torch.randn(24, 1024) * 0.02
    q = quantize_weight(weight, fmt)
    reference = q.dequantize(torch.bfloat16)
    for tile in (256, 4096):
        assert_same_bits(dequantize_triton("gguf", q.qtype, q.shape, q.data, None, None, torch.bfloat16, tile),
                         reference)


@needs_triton
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", ((200, 80), (16, 512)))
def test_nvfp4_kernel_is_bit_exact_against_torch(interpret: None, shape: tuple[int, int], dtype: torch.dtype) -> None:
    # (200, 80): rows pad to 256 and the 5 scale columns pad to 8 in the blocked layout.
    torch.manual_seed(0)
    data, blocked, tensor_scale = quantize_nvfp4(torch.randn(shape))
    reference = dequantize_packed("nvfp4", "nvfp4", shape, data, blocked, tensor_scale, dtype)
    assert_same_bits(dequantize_triton("nvfp4", "nvfp4", shape, data, blocked, tensor_scale, dtype), reference)

    # Random bytes: every E2M1 code, and E4M3 scales of both signs including subnormals (NaN codes left out).
    rng = np.random.default_rng(1)
    data = torch.from_numpy(rng.integers(0, 256, size=(shape[0], shape[1] // 2), dtype=np.uint8))
    scale_bytes = rng.integers(0, 256, size=blocked.shape, dtype=np.uint8)
    scale_bytes[np.isin(scale_bytes, NVFP4_NAN_CODES)] = 0x38  # 1.0
    scale_bytes.flat[:3] = (0x80, 0x01, 0x87)  # -0.0, the smallest subnormal, a negative subnormal
    scales = torch.from_numpy(scale_bytes).view(torch.float8_e4m3fn)
    tensor_scale = torch.tensor(3.7e-3)
    reference = dequantize_packed("nvfp4", "nvfp4", shape, data, scales, tensor_scale, dtype)
    assert_same_bits(dequantize_triton("nvfp4", "nvfp4", shape, data, scales, tensor_scale, dtype), reference)


@needs_triton
def test_no_kernel_means_none_so_the_torch_path_runs(interpret: None, monkeypatch: pytest.MonkeyPatch) -> None:
    q8 = quantize_weight(torch.randn(4, 64), "q8_0")
    fp8 = quantize_weight(torch.randn(4, 64), "fp8")
    assert dequantize_triton("fp8", "e4m3", fp8.shape, fp8.data, fp8.scale, None, torch.bfloat16) is None
    assert dequantize_triton("gguf", "IQ2_XXS", (1, 256), torch.zeros(66, dtype=torch.uint8), None, None,
                             torch.bfloat16) is None
    assert dequantize_triton("gguf", "Q8_0", q8.shape, q8.data, None, None, torch.float64) is None
    assert dequantize_triton("gguf", "Q8_0", (4, 96), q8.data, None, None, torch.bfloat16) is None  # wrong size
    monkeypatch.delenv("TRITON_INTERPRET")
    assert dequantize_triton("gguf", "Q8_0", q8.shape, q8.data, None, None, torch.bfloat16) is None  # CPU


def test_pack_imports_and_dequantises_without_triton() -> None:
    root = Path(__file__).resolve().parent.parent
    code = (
        "import sys, os, importlib.util\n"
        "sys.modules['triton'] = None\n"  # makes `import triton` raise ImportError
        "os.environ['TRITON_INTERPRET'] = '1'\n"
        f"spec = importlib.util.spec_from_file_location('ernie_image', {str(root / '__init__.py')!r}, "
        f"submodule_search_locations=[{str(root)!r}])\n"
        "sys.modules['ernie_image'] = module = importlib.util.module_from_spec(spec)\n"
        "spec.loader.exec_module(module)\n"
        "import torch\n"
        "from ernie_image.runtime.quant import QuantLinear, quantize_weight\n"
        "from ernie_image.runtime.quant.triton_dequant import dequantize_triton\n"
        "q = quantize_weight(torch.randn(8, 64), 'q8_0')\n"
        "assert dequantize_triton('gguf', 'Q8_0', q.shape, q.data, None, None, torch.bfloat16) is None\n"
        "print(QuantLinear(q, None)(torch.randn(2, 64)).shape)\n")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "torch.Size([2, 8])" in result.stdout


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("qtype", sorted(GGUF_KERNELS))
def test_gguf_kernel_on_cuda_is_bit_exact(qtype: str) -> None:
    rows, cols = 300, 4096
    data = random_blocks(qtype, rows, cols, np.random.default_rng(7)).cuda()
    for dtype in DTYPES:
        reference = dequantize_packed("gguf", qtype, (rows, cols), data, None, None, dtype)
        assert_same_bits(dequantize_triton("gguf", qtype, (rows, cols), data, None, None, dtype), reference)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("fmt", ("q8_0", "q4_k", "nvfp4"))
def test_quant_linear_on_cuda_uses_triton_with_the_same_result(fmt: str, monkeypatch: pytest.MonkeyPatch) -> None:
    torch.manual_seed(0)
    q = quantize_weight(torch.randn(384, 1024, device="cuda") * 0.02, fmt)
    layer = QuantLinear(q, None, torch.bfloat16)
    x = torch.randn(7, 1024, device="cuda", dtype=torch.bfloat16)
    calls = []
    monkeypatch.setattr(linear_module, "dequantize_triton",
                        lambda *a: calls.append(a[0]) or dequantize_triton(*a))
    y = layer(x)
    if fmt == "nvfp4" and layer._native(x) is not None:
        pytest.skip("this GPU multiplies NVFP4 natively")
    assert calls, "the Triton kernel was not tried"
    assert torch.equal(y, F.linear(x, q.dequantize(torch.bfloat16)))
