"""The candidate kernels bench/fp8_kernels.py --candidates times compute, bit for bit, what the kernels they would
replace compute (or, for q/k RMSNorm + RoPE, what the block's eager expressions compute): a faster one can replace
its kernel without changing a picture. They run in Triton's interpreter (TRITON_INTERPRET=1) on the CPU here."""
from __future__ import annotations

import importlib
import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest
import torch

from ernie_image.runtime.quant import fp8_gated, fp8_modulated
from ernie_image.runtime.quant.triton_loader import kernels_for

BENCH = Path(__file__).resolve().parent.parent / "bench"
pytestmark = pytest.mark.skipif(importlib.util.find_spec("triton") is None,
                                reason="triton is not installed (pip install triton)")


@pytest.fixture
def candidates(monkeypatch: pytest.MonkeyPatch) -> ModuleType:
    """The candidates module loaded for CPU tensors (its kernels are interpreted: the variable is read when a kernel
    is defined)."""
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    monkeypatch.syspath_prepend(str(BENCH))
    sys.modules.pop("fp8_kernel_candidates", None)
    yield importlib.import_module("fp8_kernel_candidates")
    sys.modules.pop("fp8_kernel_candidates", None)


def codes(outputs: tuple[torch.Tensor, ...]) -> list[torch.Tensor]:
    return [tensor.view(torch.uint8) if tensor.dtype == torch.float8_e4m3fn else tensor for tensor in outputs]


def assert_same(got: tuple[torch.Tensor, ...], expected: tuple[torch.Tensor, ...]) -> None:
    assert all(torch.equal(a, b) for a, b in zip(codes(got), codes(expected), strict=True))


@pytest.mark.parametrize("residual", [False, True], ids=["alone", "after the gated residual"])
@pytest.mark.parametrize("rows_per_program", [2, 4, 8])
def test_the_adaln_kernel_reading_factors_once_a_program_computes_the_shipped_kernels_codes(candidates, residual,
                                                                                          rows_per_program):
    """Two batches of 13 rows: programs whose rows reach from one batch into the next, and a last one cut short."""
    kernels = kernels_for("triton_fp8_kernels", torch.device("cpu"))
    generator = torch.Generator().manual_seed(0)
    x, update = (torch.randn((2, 13, 96), generator=generator).mul_(4).bfloat16() for _ in range(2))
    weight = (torch.rand(96, generator=generator) + 0.5).bfloat16()
    one_plus_scale, shift, gate = (torch.rand((2, 1, 96), generator=generator) + 0.5 for _ in range(3))
    extra = (update, gate) if residual else None
    assert_same(candidates.launch_adaln(x, weight, one_plus_scale, shift, 1e-6, extra, 4, rows_per_program),
                fp8_modulated.launch(kernels, x, weight, one_plus_scale, shift, 1e-6, extra))


@pytest.mark.parametrize("width", [300, 12, 4096])
def test_the_gelu_candidates_compute_the_shipped_kernels_codes(candidates, width):
    kernels = kernels_for("triton_fp8_kernels", torch.device("cpu"))
    gate, up = torch.randn((7, 2 * width), generator=torch.Generator().manual_seed(1)).mul_(3).bfloat16().chunk(2, -1)
    expected = fp8_gated.launch(kernels, gate, up)
    assert_same(candidates.launch_gelu_one_block(gate, up, 4), expected)
    for programs in (1, 3, 16):
        assert_same(candidates.launch_gelu_persistent(gate, up, programs, 2, 4), expected)


def test_the_q_k_norm_rope_candidate_computes_the_eager_expressions(candidates):
    generator = torch.Generator().manual_seed(2)
    heads, head_dim = 4, 16
    qkv = torch.randn((2, 9, 3 * heads * head_dim), generator=generator).mul_(3).bfloat16()
    angles = torch.rand((2, 9, 1, head_dim), generator=generator) * 6
    weights = [(torch.rand(head_dim, generator=generator) + 0.5).bfloat16() for _ in range(2)]
    tables = (angles.cos().bfloat16(), angles.sin().bfloat16(), *weights)
    assert_same(candidates.launch_qk_norm_rope(qkv, *tables, heads, 1e-6),
                candidates.qk_norm_rope_reference(qkv, *tables, heads, 1e-6))


def test_a_program_of_more_rows_than_a_batch_is_refused(candidates):
    x = torch.zeros((2, 3, 8), dtype=torch.bfloat16)
    factors = torch.ones((2, 1, 8))
    with pytest.raises(ValueError, match="4 rows a program reach past a batch of 3"):
        candidates.launch_adaln(x, torch.ones(8, dtype=torch.bfloat16), factors, factors, 1e-6, None, 4, 4)
