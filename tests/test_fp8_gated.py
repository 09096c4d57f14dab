"""The MLP's down projection in FP8 takes gelu(gate) * up quantised in one pass (runtime/quant/fp8_gated.py), and
what it computes is what the torch form computes: the product, its per-row e4m3 quantisation, the native GEMM.

On the CPU the Triton kernel runs in Triton's interpreter (TRITON_INTERPRET=1), whose erf may round a product to the
neighbouring bf16 value, and so may the compiled kernel's on CUDA (the @gpu tests): a code one apart, rarely.
"""
from __future__ import annotations

import importlib.util

import pytest
import torch
import torch.nn.functional as F

from ernie_image.runtime.model.dit import DiTConfig, FeedForward
from ernie_image.runtime.model.layer_inputs import GeluGated
from ernie_image.runtime.quant import QuantLinear, quantize_weight
from ernie_image.runtime.quant.fp8 import native_fp8_supported, quantize_activation
from ernie_image.runtime.quant.fp8_gated import (_gelu_mul_quantize, default_warps, gelu_mul_quantize,
                                                  gelu_mul_quantize_reference, launch)
from ernie_image.runtime.quant.triton_loader import kernels_for

HAS_TRITON = importlib.util.find_spec("triton") is not None


def relative_error(ours: torch.Tensor, reference: torch.Tensor) -> float:
    return ((ours.float() - reference.float()).norm() / reference.float().norm()).item()
needs_triton = pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed (pip install triton)")
needs_fp8_gpu = pytest.mark.skipif(
    not (HAS_TRITON and torch.cuda.is_available() and native_fp8_supported(torch.device("cuda"))),
    reason="needs a CUDA GPU with FP8 GEMMs (SM >= 8.9) and triton")


def gate_and_up(rows: int, width: int, device: str = "cpu", seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """gate and up as the fused gate/up GEMM leaves them: the two halves of one [rows, 2 * width] bf16 tensor
    (row stride 2 * width), with a zero row, a row of -0 products and a row spanning e4m3's subnormals."""
    generator = torch.Generator(device=device).manual_seed(seed)
    both = torch.randn((rows, 2 * width), generator=generator, device=device).mul_(3).bfloat16()
    both[1] = 0
    both[2, :width] = -30  # gelu(-30) is -0: every product is -0 or +0
    both[3, width:] *= torch.logspace(-6, 0, width, device=device).bfloat16()
    return both.chunk(2, dim=-1)


def codes(quantised: torch.Tensor) -> torch.Tensor:
    return quantised.view(torch.uint8).int()


def kernel(gate: torch.Tensor, up: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The Triton kernel itself, never the op's torch fallback (which would make a kernel test compare torch with
    torch)."""
    kernels = kernels_for("triton_fp8_kernels", gate.device)
    assert kernels is not None, "the kernel module did not load"
    return launch(kernels, gate, up)


def with_non_finite(gate: torch.Tensor, up: torch.Tensor) -> None:
    """NaN in a gate (row 4), inf in an up (row 5), -inf in a gate (row 6): torch's amax and clamp carry NaN."""
    gate[4, 3], up[5, 6], gate[6, 5] = float("nan"), float("inf"), float("-inf")


def assert_same_non_finite(hq: torch.Tensor, scale: torch.Tensor, expected_hq: torch.Tensor,
                           expected_scale: torch.Tensor) -> None:
    rows = [4, 5, 6]
    assert torch.equal(scale[rows].isnan(), expected_scale[rows].isnan())
    assert torch.equal(scale[rows].isinf(), expected_scale[rows].isinf())
    assert torch.equal(hq[rows].float().isnan(), expected_hq[rows].float().isnan())
    assert torch.equal(hq[rows].float().nan_to_num(0.5), expected_hq[rows].float().nan_to_num(0.5))


def test_the_torch_form_is_the_products_per_row_quantisation() -> None:
    gate, up = gate_and_up(8, 96)
    hq, scale = gelu_mul_quantize_reference(gate, up)
    expected_hq, expected_scale = quantize_activation(up * F.gelu(gate), per_row=True)
    assert torch.equal(codes(hq), codes(expected_hq)) and torch.equal(scale, expected_scale)
    assert hq.dtype == torch.float8_e4m3fn and scale.shape == (8, 1) and scale.dtype == torch.float32


@needs_triton
@pytest.mark.parametrize("width", [96, 100, 12288])
def test_the_kernel_computes_the_torch_form_on_strided_halves(monkeypatch: pytest.MonkeyPatch, width: int) -> None:
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    gate, up = gate_and_up(12, width)
    assert gate.stride(0) == 2 * width  # halves of one tensor, as a fused gate/up GEMM leaves them
    with_non_finite(gate, up)
    hq, scale = kernel(gate, up)
    expected_hq, expected_scale = gelu_mul_quantize_reference(gate, up)
    finite = [0, 1, 2, 3, *range(7, 12)]
    assert_the_torch_forms_codes(hq[finite], scale[finite], expected_hq[finite], expected_scale[finite])
    assert torch.equal(codes(hq[1:3]), codes(expected_hq[1:3]))  # zeros and negative zeros, sign for sign
    assert_same_non_finite(hq, scale, expected_hq, expected_scale)


@needs_triton
def test_no_rows_gives_empty_outputs(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    gate = up = torch.zeros((0, 64), dtype=torch.bfloat16)
    hq, scale = kernel(gate, up)
    assert hq.shape == (0, 64) and scale.shape == (0, 1)


@pytest.mark.parametrize("case", ["fp16", "last dim strided", "different shapes", "no interpreter on the CPU"])
def test_inputs_the_kernel_does_not_take_run_the_torch_form(monkeypatch: pytest.MonkeyPatch, case: str) -> None:
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    gate, up = gate_and_up(4, 64)
    if case == "fp16":
        gate, up = gate.half(), up.half()
    elif case == "last dim strided":
        gate, up = gate[:, ::2], up[:, ::2]
    elif case == "different shapes":
        up = up[:, :1].contiguous()
    else:
        monkeypatch.delenv("TRITON_INTERPRET")
    hq, scale = _gelu_mul_quantize(gate, up)
    expected_hq, expected_scale = gelu_mul_quantize_reference(gate, up)
    assert torch.equal(codes(hq), codes(expected_hq)) and torch.equal(scale, expected_scale)


def test_a_compiled_caller_traces_the_op_whole() -> None:
    gate, up = gate_and_up(4, 64)
    compiled = torch.compile(lambda g, u: gelu_mul_quantize(g * 2, u), backend="aot_eager", fullgraph=True)
    hq, scale = compiled(gate, up)
    expected_hq, expected_scale = gelu_mul_quantize_reference(gate * 2, up)
    assert torch.equal(codes(hq), codes(expected_hq)) and torch.equal(scale, expected_scale)


def fp8_layer(out_features: int, in_features: int, device: str = "cpu") -> QuantLinear:
    generator = torch.Generator().manual_seed(5)
    weight = torch.randn((out_features, in_features), generator=generator) / in_features ** 0.5
    return QuantLinear(quantize_weight(weight, "fp8")).to(device)


def test_without_a_native_gemm_the_layer_declines_the_factors_and_is_called_on_the_product() -> None:
    layer = fp8_layer(32, 64)
    gate, up = gate_and_up(6, 64)
    assert layer.from_factors(GeluGated(gate, up)) is None
    assert torch.equal(GeluGated(gate, up).into(layer), layer(up * F.gelu(gate)))


def test_a_lora_on_the_fp8_down_projection_still_gets_the_product_and_adds_its_branch() -> None:
    from ernie_image.runtime.lora.attach import LoraLinear

    config = DiTConfig(hidden_size=64, num_attention_heads=2, num_layers=1, ffn_hidden_size=96, text_in_dim=64,
                       rope_axes_dim=(8, 12, 12))
    mlp = FeedForward(config).bfloat16()
    base = fp8_layer(64, 96)
    wrapped = LoraLinear(base, slices=1, out_features=64, in_features=96)
    wrapped.lora_down = torch.randn((4, 96)).bfloat16()
    wrapped.lora_up = torch.randn((1, 64, 4)).bfloat16()
    mlp.linear_fc2 = wrapped
    x = torch.randn((2, 5, 64)).bfloat16()
    product = mlp.up_proj(x) * F.gelu(mlp.gate_proj(x))
    assert torch.equal(mlp(x), wrapped(product)) and not torch.equal(mlp(x), base(product))


def test_the_mlp_hands_its_fp8_down_projection_the_halves_and_a_plain_one_the_product() -> None:
    config = DiTConfig(hidden_size=64, num_attention_heads=2, num_layers=1, ffn_hidden_size=96, text_in_dim=64,
                       rope_axes_dim=(8, 12, 12))
    mlp = FeedForward(config).bfloat16()
    x = torch.randn((2, 5, 64)).bfloat16()
    gate, up = mlp.gate_proj(x), mlp.up_proj(x)
    assert torch.equal(mlp(x), mlp.linear_fc2(up * F.gelu(gate)))
    seen = []
    mlp.linear_fc2 = fp8_layer(64, 96)
    plain_from_factors = mlp.linear_fc2.from_factors
    mlp.linear_fc2.from_factors = lambda factors: seen.append(factors) or plain_from_factors(factors)
    assert torch.equal(mlp(x), mlp.linear_fc2(up * F.gelu(gate)))
    assert len(seen) == 1 and isinstance(seen[0], GeluGated)
    assert torch.equal(seen[0].gate, gate) and torch.equal(seen[0].up, up)


def assert_the_torch_forms_codes(hq: torch.Tensor, scale: torch.Tensor, expected_hq: torch.Tensor,
                                 expected_scale: torch.Tensor) -> None:
    """The same scales; codes equal or one apart, in at most 0.1% of values (or one), where gelu's erf rounds a
    product to the neighbouring bf16 value (Triton's erf and PyTorch's may differ in the last fp32 bit)."""
    assert torch.equal(scale, expected_scale)
    apart = (codes(hq) - codes(expected_hq)).abs()
    differing = int((apart > 0).sum())
    assert apart.max() <= 1 and differing <= max(1, apart.numel() // 1000), f"{differing} codes differ"


@pytest.mark.gpu
@needs_fp8_gpu
@pytest.mark.parametrize("rows, width", [(33, 96), (4352, 12288)])
def test_on_the_gpu_the_kernel_computes_the_torch_form(rows: int, width: int) -> None:
    gate, up = gate_and_up(rows, width, "cuda")
    assert_the_torch_forms_codes(*kernel(gate, up), *gelu_mul_quantize_reference(gate, up))
    with_non_finite(gate, up)
    assert_same_non_finite(*kernel(gate, up), *gelu_mul_quantize_reference(gate, up))


@pytest.mark.gpu
@needs_fp8_gpu
@torch.inference_mode()
def test_on_the_gpu_the_layer_multiplies_the_quantised_product() -> None:
    layer = fp8_layer(256, 384, "cuda")
    gate, up = (half.reshape(2, 40, 384) for half in gate_and_up(80, 384, "cuda"))
    hq, h_scale = gelu_mul_quantize(gate.reshape(80, 384), up.reshape(80, 384))
    expected = torch._scaled_mm(hq, layer.weight.t(), scale_a=h_scale, scale_b=layer.weight_scale_row,
                                out_dtype=torch.bfloat16, use_fast_accum=True).reshape(2, 40, 256)
    got = GeluGated(gate, up).into(layer)
    assert torch.equal(got, expected)
    exact = (up.float() * F.gelu(gate.float())) @ (layer.dequantized_weight(torch.float32).t())
    assert relative_error(got, exact) <= 0.06  # FP8's error


@pytest.mark.gpu
@needs_fp8_gpu
@torch.inference_mode()
def test_on_the_gpu_a_compiled_fp8_mlp_stays_within_fp8s_error_of_bf16_as_the_uncompiled_one_does() -> None:
    config = DiTConfig(hidden_size=256, num_attention_heads=2, num_layers=1, ffn_hidden_size=768, text_in_dim=256,
                       rope_axes_dim=(32, 48, 48))
    mlp = FeedForward(config).cuda().bfloat16()
    mlp.fuse_projections()
    x = torch.randn((2, 300, 256), device="cuda").bfloat16()
    bf16 = mlp(x)
    mlp.gate_up = QuantLinear(quantize_weight(mlp.gate_up.weight.float(), "fp8")).cuda()
    mlp.linear_fc2 = QuantLinear(quantize_weight(mlp.linear_fc2.weight.float(), "fp8")).cuda()
    eager = mlp(x)
    compiled = torch.compile(mlp, fullgraph=True)(x)
    assert relative_error(eager, bf16) <= 0.08 and relative_error(compiled, bf16) <= 0.08
