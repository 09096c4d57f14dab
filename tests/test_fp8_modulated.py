"""A block's FP8 projections fed by an adaLN (q/k/v, gate/up) take its factors and make their e4m3 input in one
kernel (runtime/quant/fp8_modulated.py), and what that computes is the torch form: RMSNorm, the modulation and the
per-row quantisation, as model/adaln.py and fp8.quantize_activation compute them. Every other layer gets the bf16
adaLN output, made once (model/adaln.py's NormModulated).

The kernel sums the mean of squares in another order than torch does, which can move a normalised value to the
neighbouring bf16 value, and so a code one apart, rarely; compiled for a GPU it also fuses the modulation's multiply
and add, which where they nearly cancel can land two codes apart near zero. On the CPU it runs in Triton's
interpreter (TRITON_INTERPRET=1)."""
from __future__ import annotations

import importlib.util

import pytest
import torch
from torch import nn

from ernie_image.runtime.model.adaln import NormModulated, Residual, RMSNorm, gated_residual, modulate, norm_modulate
from ernie_image.runtime.model.arithmetic import Arithmetic
from ernie_image.runtime.quant import QuantLinear, quantize_weight
from ernie_image.runtime.quant.fp8 import native_fp8_supported, quantize_activation
from ernie_image.runtime.quant.fp8_modulated import (launch, norm_modulate_quantize, norm_modulate_quantize_reference,
                                                     residual_norm_modulate_quantize,
                                                     residual_norm_modulate_quantize_reference)
from ernie_image.runtime.quant.triton_loader import kernels_for

HAS_TRITON = importlib.util.find_spec("triton") is not None
needs_triton = pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed (pip install triton)")
needs_fp8_gpu = pytest.mark.skipif(
    not (HAS_TRITON and torch.cuda.is_available() and native_fp8_supported(torch.device("cuda"))),
    reason="needs a CUDA GPU with FP8 GEMMs (SM >= 8.9) and triton")
PLAIN = Arithmetic.of("plain")


def adaln_inputs(batch: int, length: int, width: int, device: str = "cpu", seed: int = 0
                 ) -> tuple[torch.Tensor, RMSNorm, torch.Tensor, torch.Tensor]:
    """x [batch, length, width] bf16 with a zero row and a row whose values span 12 orders of magnitude, a norm
    with a weight around 1, and fp32 [batch, 1, width] factors."""
    generator = torch.Generator(device=device).manual_seed(seed)
    x = torch.randn((batch, length, width), generator=generator, device=device).mul_(4).bfloat16()
    x[0, 1] = 0
    x[0, 2] *= torch.logspace(-6, 6, width, device=device).bfloat16()
    norm = RMSNorm(width, 1e-6).to(device).requires_grad_(False)
    norm.weight.data = torch.rand((width,), generator=generator, device=device).add_(0.5).bfloat16()
    one_plus_scale = torch.rand((batch, 1, width), generator=generator, device=device).add_(0.5)
    shift = torch.randn((batch, 1, width), generator=generator, device=device).mul_(0.3)
    return x, norm, one_plus_scale, shift


def codes(quantised: torch.Tensor) -> torch.Tensor:
    return quantised.view(torch.uint8).int()


def kernel(x: torch.Tensor, norm: RMSNorm, one_plus_scale: torch.Tensor, shift: torch.Tensor
           ) -> tuple[torch.Tensor, torch.Tensor]:
    """The Triton kernel itself, never the op's torch form."""
    kernels = kernels_for("triton_fp8_kernels", x.device)
    assert kernels is not None, "the kernel module did not load"
    return launch(kernels, x, norm.weight, one_plus_scale, shift, norm.eps)


def assert_near_the_torch_form(got: tuple[torch.Tensor, torch.Tensor],
                               expected: tuple[torch.Tensor, torch.Tensor],
                               products: torch.Tensor | None = None) -> None:
    """Scales equal or one bf16 step apart; values differing in at most 0.1% of places (or one), each by at most one
    e4m3 step of its size or, near zero, 2^-6 of the row's scale; and, where `products` (|normed * (1 + scale)| in
    fp32, [rows, D]) are given, by what the torch form's bf16 roundings of normed and of the sum add: where
    normed * (1 + scale) + shift nearly cancels, those roundings are the product's size, not the small result's, and
    the kernel, which keeps fp32 throughout and fuses the multiply-add, lands codes apart."""
    scale, expected_scale = got[1], expected[1]
    assert torch.equal(scale.isnan(), expected_scale.isnan())
    finite = ~expected_scale.isnan().flatten()
    ratio = (scale[finite] / expected_scale[finite]).flatten()
    assert bool(((ratio - 1).abs() <= 2 ** -7).all()), "a scale more than one bf16 step from the torch form's"
    values, expected_values = got[0][finite].float(), expected[0][finite].float()  # in units of the row's scale
    apart = (values - expected_values).abs()
    allowed = torch.maximum(expected_values.abs() / 8, torch.full_like(expected_values, 2 ** -6)) * 1.01
    if products is not None:  # in code units: divided by the row's scale; 2^-7 is twice two bf16 half-steps
        allowed = allowed + products[finite] / expected_scale[finite].reshape(-1, 1) * 2 ** -7
    differing = int((apart > 0).sum())
    assert bool((apart <= allowed).all()), f"a value {float((apart - allowed).max()):g} beyond its bound"
    assert differing <= max(1, apart.numel() // 1000), f"{differing} values differ"


def test_the_torch_form_is_the_blocks_adaln_then_the_per_row_quantisation() -> None:
    x, norm, one_plus_scale, shift = adaln_inputs(2, 5, 64)
    for arithmetic in (PLAIN, Arithmetic.of("exact")):
        made = modulate(norm(x, arithmetic), one_plus_scale, shift, arithmetic)
        expected = quantize_activation(made.reshape(-1, 64), per_row=True)
        got = norm_modulate_quantize_reference(x, norm.weight, one_plus_scale, shift, norm.eps)
        assert torch.equal(codes(got[0]), codes(expected[0])) and torch.equal(got[1], expected[1])
    assert got[0].shape == (10, 64) and got[1].shape == (10, 1)


@needs_triton
@pytest.mark.parametrize("width", [64, 100, 4096])
def test_the_kernel_computes_the_torch_form(monkeypatch: pytest.MonkeyPatch, width: int) -> None:
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    inputs = adaln_inputs(2, 6, width)
    expected = norm_modulate_quantize_reference(inputs[0], inputs[1].weight, *inputs[2:], inputs[1].eps)
    got = kernel(*inputs)
    assert_near_the_torch_form(got, expected)
    assert torch.equal(codes(got[0][1]), codes(expected[0][1]))  # the zero row: the shift alone


@needs_triton
@pytest.mark.parametrize("rows_per_program", [1, 4])
def test_the_kernel_adds_a_gated_residual_first_and_writes_the_new_stream(monkeypatch: pytest.MonkeyPatch,
                                                                          rows_per_program: int) -> None:
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    x, norm, one_plus_scale, shift = adaln_inputs(2, 5, 100)
    update = torch.randn(x.shape, generator=torch.Generator().manual_seed(9)).bfloat16()
    gate = torch.rand((2, 1, 100), generator=torch.Generator().manual_seed(10))
    expected = residual_norm_modulate_quantize_reference(x, update, gate, norm.weight, one_plus_scale, shift,
                                                         norm.eps)
    assert torch.equal(expected[0], gated_residual(x, gate, update, arithmetic=PLAIN))
    got = launch(kernels_for("triton_fp8_kernels", x.device), x, norm.weight, one_plus_scale, shift, norm.eps,
                 (update, gate), rows_per_program=rows_per_program)
    assert torch.equal(got[0], expected[0])
    assert_near_the_torch_form(got[1:], expected[1:])


@needs_triton
def test_a_non_finite_value_makes_its_rows_scale_nan_as_the_torch_form_does(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    x, norm, one_plus_scale, shift = adaln_inputs(1, 4, 64)
    x[0, 0, 3], x[0, 3, 5] = float("nan"), float("inf")
    expected = norm_modulate_quantize_reference(x, norm.weight, one_plus_scale, shift, norm.eps)
    got = kernel(x, norm, one_plus_scale, shift)
    assert bool(got[1][[0, 3]].isnan().all()) and bool(expected[1][[0, 3]].isnan().all())
    assert_near_the_torch_form(got, expected)


@needs_triton
def test_no_rows_gives_empty_outputs(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    x, norm, one_plus_scale, shift = adaln_inputs(1, 3, 64)
    got = kernel(x[:, :0], norm, one_plus_scale, shift)
    assert got[0].shape == (0, 64) and got[1].shape == (0, 1)


@pytest.mark.parametrize("case", ["fp16", "strided rows", "factors per row", "no interpreter on the CPU"])
def test_inputs_the_kernel_does_not_take_run_the_torch_form(monkeypatch: pytest.MonkeyPatch, case: str) -> None:
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    x, norm, one_plus_scale, shift = adaln_inputs(2, 4, 64)
    if case == "fp16":
        x = x.half()
        norm.weight.data = norm.weight.half()
    elif case == "strided rows":
        x = torch.cat((x, x), dim=-1)[..., :64]
    elif case == "factors per row":
        one_plus_scale, shift = one_plus_scale.expand(2, 4, 64).contiguous(), shift.expand(2, 4, 64).contiguous()
    else:
        monkeypatch.delenv("TRITON_INTERPRET")
    got = norm_modulate_quantize(x, norm.weight, one_plus_scale, shift, norm.eps)
    expected = norm_modulate_quantize_reference(x, norm.weight, one_plus_scale, shift, norm.eps)
    assert torch.equal(codes(got[0]), codes(expected[0]))
    assert torch.equal(got[1].nan_to_num(-1.0), expected[1].nan_to_num(-1.0))  # fp16 overflows in row 2


class Recording(nn.Linear):
    """A bf16 layer that says what it was called on."""

    def __init__(self, width: int) -> None:
        super().__init__(width, 8, bias=False, dtype=torch.bfloat16)
        self.requires_grad_(False)
        self.inputs: list[torch.Tensor] = []

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        self.inputs.append(x)
        return super().forward(x)


class TakesFactors(Recording):
    """A layer offering `from_factors`, as an FP8 QuantLinear does: it asks the factors for their e4m3 rows, and
    answers 7s from them; None where there are none or it declines (`answer` False)."""

    def __init__(self, width: int, answer: bool = True) -> None:
        super().__init__(width)
        self.answer = answer
        self.rows: list = []

    def from_factors(self, factors):
        if not self.answer:
            return None
        rows = factors.e4m3_rows()
        self.rows.append(rows)
        return None if rows is None else torch.full((*factors.lead, 8), 7.0, dtype=factors.given.dtype)


def adaln_output(arithmetic: Arithmetic = Arithmetic(), with_residual: bool = False
                 ) -> tuple[NormModulated, torch.Tensor]:
    """The adaLN output to hand to layers, and the tensor it is (after a gated residual: `with_residual`)."""
    x, norm, one_plus_scale, shift = adaln_inputs(1, 3, 64)
    raw_scale, raw_shift = (one_plus_scale - 1).bfloat16(), shift.bfloat16()
    residual = None
    if with_residual:
        update, gate = torch.randn((1, 3, 64)).bfloat16(), torch.rand((1, 1, 64))
        residual = Residual(update, gate, gate.bfloat16())
        after = gated_residual(x, gate, update, gate.bfloat16(), arithmetic)
    made = norm_modulate(norm, after if with_residual else x, one_plus_scale, shift, raw_scale, raw_shift, arithmetic)
    return NormModulated(norm, x, one_plus_scale, shift, raw_scale, raw_shift, arithmetic, residual), made


@pytest.mark.parametrize("with_residual", [False, True])
def test_layers_without_the_factors_method_get_the_adaln_output_made_once(with_residual: bool) -> None:
    given, made = adaln_output(with_residual=with_residual)
    layers = [Recording(64) for _ in range(3)]
    for layer in layers:
        assert torch.equal(given.into(layer), layer(made))
    assert all(layer.inputs[0] is layers[0].inputs[0] for layer in layers)  # one tensor for all three


def test_a_layer_taking_factors_gets_the_adaln_outputs_quantised_rows() -> None:
    given, _ = adaln_output()
    layer = TakesFactors(64)
    assert bool((given.into(layer) == 7).all()) and not layer.inputs
    quantised, scales = layer.rows[0]
    expected = norm_modulate_quantize(given.source, given.norm.weight, given.one_plus_scale, given.shift,
                                      given.norm.eps)
    assert torch.equal(quantised.view(torch.uint8), expected[0].view(torch.uint8)) and torch.equal(scales, expected[1])


def test_a_layer_taking_the_factors_adds_a_pending_residual_and_its_result_is_the_residual_stream() -> None:
    given, _ = adaln_output(with_residual=True)
    before, residual = given._before_residual, given._residual
    first, second = TakesFactors(64), TakesFactors(64)
    given.into(first)
    after = given.source
    assert torch.equal(after, before + (residual.gate * residual.update.float()).to(before.dtype))
    given.into(second)  # the residual is added once: the next layer's rows are the stream's after it
    expected = norm_modulate_quantize(after, given.norm.weight, given.one_plus_scale, given.shift, given.norm.eps)
    assert given.source is after and torch.equal(second.rows[0][1], expected[1])


@pytest.mark.parametrize("arithmetic", ["exact", "plain"])
def test_under_the_exact_arithmetics_the_factors_make_no_rows_and_the_layer_gets_the_tensor(arithmetic: str) -> None:
    """The kernel's sum order is not the reference's: "exact" and "plain" keep the reference's numbers."""
    given, made = adaln_output(Arithmetic.of(arithmetic))
    layer = TakesFactors(64)
    assert torch.equal(given.into(layer), layer(made)) and layer.rows == [None]


def test_a_layer_declining_the_factors_gets_the_adaln_output() -> None:
    given, made = adaln_output()
    layer = TakesFactors(64, answer=False)
    assert torch.equal(given.into(layer), layer(made)) and not layer.rows


def test_an_fp8_layer_without_a_native_gemm_declines_and_gets_the_adaln_output() -> None:
    given, made = adaln_output()
    weight = torch.randn((32, 64), generator=torch.Generator().manual_seed(4)) / 8
    layer = QuantLinear(quantize_weight(weight, "fp8"))
    assert layer.from_factors(given) is None
    assert torch.equal(given.into(layer), layer(made))


def test_a_tensor_given_as_the_input_goes_to_every_layer_as_it_is() -> None:
    x = torch.randn((1, 3, 64)).bfloat16()
    layer = TakesFactors(64)
    given = NormModulated.of(x)
    assert torch.equal(given.into(layer), layer(x)) and layer.rows == [None] and given.shape == x.shape


@pytest.mark.gpu
@needs_fp8_gpu
@pytest.mark.parametrize("batch, length, width", [(2, 33, 256), (1, 4352, 4096)])
def test_on_the_gpu_the_kernel_computes_the_torch_form(batch: int, length: int, width: int) -> None:
    inputs = adaln_inputs(batch, length, width, "cuda")
    expected = norm_modulate_quantize_reference(inputs[0], inputs[1].weight, *inputs[2:], inputs[1].eps)
    assert_near_the_torch_form(kernel(*inputs), expected)


@pytest.mark.gpu
@needs_fp8_gpu
@torch.inference_mode()
def test_on_the_gpu_the_layer_multiplies_the_quantised_adaln_output() -> None:
    x, norm, one_plus_scale, shift = adaln_inputs(2, 40, 256, "cuda")
    weight = torch.randn((384, 256), device="cuda") / 16
    layer = QuantLinear(quantize_weight(weight, "fp8")).cuda()
    xq, x_scale = norm_modulate_quantize(x, norm.weight, one_plus_scale, shift, norm.eps)
    expected = torch._scaled_mm(xq, layer.weight.t(), scale_a=x_scale, scale_b=layer.weight_scale_row,
                                out_dtype=torch.bfloat16, use_fast_accum=True).reshape(2, 40, 384)
    given = NormModulated(norm, x, one_plus_scale, shift, arithmetic=Arithmetic())
    got = given.into(layer)
    assert torch.equal(got, expected) and given.source is x
    exact = modulate(norm(x, PLAIN), one_plus_scale, shift, PLAIN).float() @ layer.dequantized_weight(torch.float32).t()
    assert float((got.float() - exact).norm() / exact.norm()) <= 0.06  # FP8's error


@pytest.mark.gpu
@needs_fp8_gpu
def test_on_the_gpu_the_residual_kernel_computes_the_torch_form() -> None:
    x, norm, one_plus_scale, shift = adaln_inputs(1, 4352, 4096, "cuda")
    update = torch.randn(x.shape, device="cuda").bfloat16()
    gate = torch.rand((1, 1, 4096), device="cuda")
    expected = residual_norm_modulate_quantize_reference(x, update, gate, norm.weight, one_plus_scale, shift,
                                                         norm.eps)
    got = residual_norm_modulate_quantize(x, update, gate, norm.weight, one_plus_scale, shift, norm.eps)
    assert torch.equal(got[0], expected[0])
    stream = got[0].float()
    normed = stream * torch.rsqrt(stream.pow(2).mean(-1, keepdim=True) + norm.eps) * norm.weight.float()
    assert_near_the_torch_form(got[1:], expected[1:], (normed * one_plus_scale).abs().reshape(-1, x.shape[-1]))


@pytest.mark.gpu
@needs_fp8_gpu
@torch.inference_mode()
def test_on_the_gpu_an_fp8_dit_takes_every_adaln_input_through_the_kernels_compiled_or_not(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Stacked FP8 projections (as a pipe loads them) get both adaLN inputs of every block from the kernels, the
    MLP's with the attention's residual added there; the output stays within FP8's error of the bf16 DiT's, as
    with the torch forms, uncompiled and compiled."""
    from ernie_image.runtime.model.compile import compile_blocks, fuse_projections
    from ernie_image.runtime.quant import fp8_modulated
    from reference_models import random_dit, relative_error
    from test_dit_graphs import step_inputs
    from test_fp8_stacked import fp8_dit

    inputs = step_inputs("cuda", torch.bfloat16)
    bf16 = random_dit("cuda", torch.bfloat16)(*inputs)
    dit = fp8_dit("cuda")
    fuse_projections(dit)
    launched = []
    real_launch = fp8_modulated.launch
    monkeypatch.setattr(fp8_modulated, "launch",
                        lambda *args, **kwargs: launched.append(args[6] if len(args) > 6 else None)
                        or real_launch(*args, **kwargs))
    eager = dit(*inputs)
    assert len(launched) == 2 * len(dit.layers) and sum(r is not None for r in launched) == len(dit.layers)
    for block in dit.layers:  # the torch forms: the layers' factors methods hidden
        block.self_attention.to_qkv.from_factors = block.mlp.gate_up.from_factors = None
    torch_forms = dit(*inputs)
    for block in dit.layers:
        del block.self_attention.to_qkv.from_factors, block.mlp.gate_up.from_factors
    compile_blocks(dit)
    dit(*inputs)  # the compile's own calls
    launched.clear()
    compiled = dit(*inputs)
    assert len(launched) == 2 * len(dit.layers) and sum(r is not None for r in launched) == len(dit.layers)
    error = relative_error(torch_forms, bf16)
    for output in (eager, compiled):
        assert relative_error(output, bf16) <= max(1.2 * error, error + 0.005), (relative_error(output, bf16), error)


@torch.inference_mode()
def test_a_compiled_block_traces_its_adaln_inputs_whole_and_computes_what_it_does_uncompiled() -> None:
    """NormModulated and the pending residual are plain Python objects to dynamo: one graph, the same bits."""
    from ernie_image.runtime.model.compile import fuse_projections
    from test_dit_graphs import step_inputs
    from test_fp8_stacked import fp8_dit

    dit = fp8_dit()
    fuse_projections(dit)
    x, ctx, _ = dit.prepare(*step_inputs("cpu", torch.bfloat16))
    block = dit.layers[0]
    compiled = torch.compile(block, fullgraph=True, backend="aot_eager")
    assert torch.equal(compiled(x, ctx), block(x, ctx))
