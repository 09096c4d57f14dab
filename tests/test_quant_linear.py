"""QuantLinear: packed buffers the offloader can stream, outputs equal F.linear on the dequantised weight,
quantisation error within what each format allows, and a whole (tiny) ERNIE DiT within a stated tolerance."""
from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from ernie_image.runtime.cli.quantize import main_quantize
from ernie_image.runtime.core.errors import InvalidInputError
from ernie_image.runtime.formats.quantized_file import load_quantized_state_dict
from ernie_image.runtime.quant import (QuantLinear, linear as linear_module, load_quantized_into, quantize_linears,
                                       quantize_state_dict, quantize_weight, write_quantized_file)
from ernie_image.runtime.quant.fp8_matmul import fp8_linear_native
from ernie_image.runtime.quant.gpu_support import DIT_WEIGHT_BYTES, DeviceInfo, choose_auto, format_reasons
from ernie_image.runtime.quant.linear import native_kernel_accepts
from ernie_image.runtime.quant.nvfp4 import (E2M1_VALUES, from_blocked, quantize_nvfp4, to_blocked,
                                             unpack_pairs_hi_first)

FORMATS = ("fp8", "q8_0", "q4_k", "nvfp4")


@pytest.mark.parametrize("fmt", FORMATS)
def test_quant_linear_equals_linear_on_dequantised_weight(fmt: str) -> None:
    torch.manual_seed(0)
    weight, bias, x = torch.randn(64, 256), torch.randn(64), torch.randn(3, 5, 256)
    qweight = quantize_weight(weight, fmt)
    layer = QuantLinear(qweight, bias, torch.float32, name="layers.0.mlp.up_proj")
    expected = F.linear(x, qweight.dequantize(torch.float32), bias)
    assert torch.equal(layer(x), expected)
    y16 = layer(x.bfloat16())
    assert y16.dtype == torch.bfloat16
    assert torch.equal(y16, F.linear(x.bfloat16(), qweight.dequantize(torch.bfloat16), bias.bfloat16()))


@pytest.mark.parametrize("fmt", FORMATS)
def test_packed_tensors_are_buffers_the_offloader_can_swap(fmt: str) -> None:
    qweight = quantize_weight(torch.randn(32, 256), fmt)
    layer = QuantLinear(qweight, None, torch.float32)
    buffers = dict(layer.named_buffers())
    packed = {name: buffers[name] for name in qweight.tensors()}
    assert set(buffers) - set(packed) == ({"weight_scale_row"} if fmt == "fp8" else set())  # FP8: see below
    assert packed["weight"].dtype in (torch.uint8, torch.float8_e4m3fn)
    assert sum(b.numel() * b.element_size() for b in packed.values()) == qweight.nbytes < 32 * 256 * 2
    x = torch.randn(2, 256)
    before = layer(x)
    # Stream out and back in the way the offloader does: swap .data for other storage of the same bytes.
    for name, tensor in layer.named_buffers():
        tensor.data = tensor.data.clone()
        assert getattr(layer, name).data_ptr() == tensor.data_ptr()
    assert torch.equal(layer(x), before)
    layer.weight.data = torch.zeros_like(layer.weight.data)  # forward reads the buffers at call time
    assert not torch.equal(layer(x), before)


def test_native_gemm_is_chosen_once_from_format_and_shape() -> None:
    # FP8 GEMMs need e4m3 and in/out % 16; FP4 GEMMs in % 32; GGUF never multiplies natively.
    assert QuantLinear(quantize_weight(torch.randn(32, 256), "fp8"), None)._native_format == "fp8"
    assert QuantLinear(quantize_weight(torch.randn(24, 256), "fp8"), None)._native_format is None
    assert QuantLinear(quantize_weight(torch.randn(32, 256), "nvfp4"), None)._native_format == "nvfp4"
    assert QuantLinear(quantize_weight(torch.randn(32, 256), "q8_0"), None)._native_format is None
    layer = QuantLinear(quantize_weight(torch.randn(32, 256), "fp8"), None, torch.float32)
    assert layer._native(torch.randn(2, 256)) is None  # CPU input: always the dequantise path


def test_native_kernels_take_bf16_or_per_tensor_fp16_activations_of_the_layer_width_only() -> None:
    bf16 = torch.randn(3, 5, 256, dtype=torch.bfloat16)
    for fmt in ("fp8", "nvfp4"):
        assert native_kernel_accepts(bf16, fmt, 256)
        for dtype in (torch.float32, torch.float64):  # the caller wants that precision
            assert not native_kernel_accepts(bf16.to(dtype), fmt, 256, per_tensor_fp8=True)
        assert not native_kernel_accepts(bf16.half(), fmt, 256)  # row-wise scaling writes bf16 only
    assert native_kernel_accepts(bf16.half(), "fp8", 256, per_tensor_fp8=True)  # tensor-wise scaling writes fp16
    assert not native_kernel_accepts(bf16.half(), "nvfp4", 256, per_tensor_fp8=True)
    for fmt in ("fp8", "nvfp4"):
        assert not native_kernel_accepts(bf16, fmt, 128)  # F.linear's own error says what is wrong
        assert not native_kernel_accepts(bf16[:0], fmt, 256)
    assert not native_kernel_accepts(bf16, None, 256)  # GGUF and odd FP8 shapes have no native GEMM


@pytest.fixture
def fp8_native_on_cpu(monkeypatch: pytest.MonkeyPatch) -> None:
    """Treat the CPU as an FP8 device: torch's CPU _scaled_mm is the same GEMM, so the path runs for real."""
    monkeypatch.setattr(linear_module, "native_fp8_supported", lambda device: True)
    monkeypatch.setattr(linear_module, "_reported_native_errors", set())


def _fp8_layer(seed: int = 0, name: str = "layers.0.mlp.up_proj") -> QuantLinear:
    torch.manual_seed(seed)
    return QuantLinear(quantize_weight(torch.randn(32, 256), "fp8"), torch.randn(32), torch.bfloat16, name=name)


def test_an_fp32_call_dequantises_without_turning_native_off(fp8_native_on_cpu: None) -> None:
    layer = _fp8_layer()
    x = torch.randn(3, 5, 256)
    native = fp8_linear_native(x.bfloat16(), layer.weight, layer.weight_scale, layer.weight_scale_row, layer.bias)
    dequantised = F.linear(x.bfloat16(), layer.dequantized_weight(torch.bfloat16), layer.bias)
    assert not torch.equal(native, dequantised)  # the two paths are told apart by their bits
    assert torch.equal(layer(x.bfloat16()), native)
    assert torch.equal(layer(x), F.linear(x, layer.dequantized_weight(torch.float32), layer.bias.float()))
    assert not layer._native_failed
    assert torch.equal(layer(x.bfloat16()), native)  # the fp32 call changed nothing for later bf16 calls


def test_a_kernel_error_on_bf16_turns_native_off_for_that_layer_with_one_warning(
        fp8_native_on_cpu: None, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture) -> None:
    calls = []

    def kernel_missing(x, *args):
        calls.append(x.dtype)
        raise RuntimeError("CUBLAS_STATUS_NOT_SUPPORTED")

    monkeypatch.setattr(linear_module, "fp8_linear_native", kernel_missing)
    first, second = _fp8_layer(0, "layers.0.mlp.up_proj"), _fp8_layer(1, "layers.1.mlp.up_proj")
    x = torch.randn(4, 256, dtype=torch.bfloat16)
    with caplog.at_level("WARNING", logger=linear_module.__name__):
        for layer in (first, second, first, second):
            assert torch.equal(layer(x), F.linear(x, layer.dequantized_weight(), layer.bias))
    assert calls == [torch.bfloat16, torch.bfloat16]  # each layer tried once, then dequantised
    assert first._native_failed and second._native_failed
    warnings = [r.getMessage() for r in caplog.records]
    assert len(warnings) == 1 and "layers.0.mlp.up_proj: native fp8 matmul failed" in warnings[0]
    assert "CUBLAS_STATUS_NOT_SUPPORTED" in warnings[0]


def test_out_of_memory_in_the_native_gemm_propagates_and_keeps_native_on(
        fp8_native_on_cpu: None, monkeypatch: pytest.MonkeyPatch) -> None:
    def out_of_memory(*args):
        raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    monkeypatch.setattr(linear_module, "fp8_linear_native", out_of_memory)
    layer = _fp8_layer()
    with pytest.raises(torch.cuda.OutOfMemoryError):
        layer(torch.randn(4, 256, dtype=torch.bfloat16))
    assert not layer._native_failed


per_row_fp8_scales = pytest.mark.parametrize("per_row", (True, False), ids=("per-row scale", "per-tensor scale"))


def _rel_err(output: torch.Tensor, reference: torch.Tensor) -> float:
    return ((output.float() - reference.float()).norm() / reference.float().norm()).item()


@per_row_fp8_scales
def test_fp8_native_gemm_uses_the_scale_row_built_once(per_row: bool) -> None:
    # cuBLASLt's row-wise scaling takes the weight scale as a contiguous fp32 [1, out] row: built with the layer
    # (a buffer that streams with the weight, never saved), not expanded per forward. torch runs the same
    # _scaled_mm on the CPU, so the native path is checked here against the dequantising one: they differ by
    # the e4m3 rounding of the activation (at most 2^-4 relative per value; 2.5% relative L2 measured).
    torch.manual_seed(0)
    qweight = quantize_weight(torch.randn(32, 256), "fp8", per_row_fp8=per_row)
    layer = QuantLinear(qweight, torch.randn(32), torch.bfloat16)
    assert "weight_scale_row" not in layer.state_dict()
    row = layer.weight_scale_row
    assert row.shape == (1, 32) and row.dtype == torch.float32 and row.is_contiguous()
    assert torch.equal(row, qweight.scale.float().expand(32).reshape(1, 32))
    x = torch.randn(3, 5, 256)
    for activation in (torch.bfloat16, torch.float32):  # row-wise, and (per-tensor weights only) tensor-wise
        if activation == torch.float32 and per_row:
            with pytest.raises(RuntimeError, match="need bf16 activations"):
                fp8_linear_native(x, layer.weight, layer.weight_scale, row, layer.bias)
            continue
        native = fp8_linear_native(x.to(activation), layer.weight, layer.weight_scale, row, layer.bias).float()
        dequantised = layer(x.to(activation)).float()
        assert native.shape == (3, 5, 32)
        assert _rel_err(native, dequantised) < 0.04


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9),
                    reason="needs a CUDA GPU with FP8 (SM >= 8.9)")
@per_row_fp8_scales
def test_on_the_gpu_bf16_calls_multiply_natively_and_an_fp32_call_leaves_that_on(per_row: bool) -> None:
    torch.manual_seed(0)
    layer = QuantLinear(quantize_weight(torch.randn(64, 256), "fp8", per_row_fp8=per_row), torch.randn(64),
                        torch.bfloat16, name="layers.0.mlp.up_proj").cuda()
    x = torch.randn(3, 5, 256, device="cuda")
    y32 = layer(x)
    assert y32.dtype == torch.float32 and not layer._native_failed
    assert torch.equal(y32, F.linear(x, layer.dequantized_weight(torch.float32), layer.bias.float()))
    native = fp8_linear_native(x.bfloat16(), layer.weight, layer.weight_scale, layer.weight_scale_row, layer.bias)
    assert torch.equal(layer(x.bfloat16()), native) and not layer._native_failed
    dequantised = F.linear(x.bfloat16(), layer.dequantized_weight(), layer.bias)
    assert not torch.equal(native, dequantised)  # so the bf16 call above did multiply natively
    assert _rel_err(native, dequantised) < 0.04  # the e4m3 rounding of the activation, as on the CPU


def test_fp8_e4m3_error_bound() -> None:
    # e4m3 keeps 3 mantissa bits: round-to-nearest is within 2^-4 relative for normal values; below the
    # smallest normal (2^-6 after scaling) the step is 2^-9, so |err| <= 2^-4 |w| + 2^-10 * row_scale.
    weight = torch.randn(128, 256) * torch.logspace(-3, 0, 128).unsqueeze(1)
    q = quantize_weight(weight, "fp8")
    assert q.scale.shape == (128,)
    err = (q.dequantize(torch.float32) - weight).abs()
    assert (err <= 2**-4 * weight.abs() + 2**-10 * q.scale.unsqueeze(1)).all()


def test_nvfp4_error_bound_and_grid() -> None:
    # Per 16 values the decode scale s = e4m3(amax/6/ts) * ts is within 2^-4 of amax/6 (plus 2^-10 ts where
    # the e4m3 scale is subnormal); E2M1's widest gap (4 -> 6) is 2, so rounding errs <= 1 s, and clamping a
    # value scaled to <= 6.4 onto 6 errs <= 0.4 s. Hence |err| <= (amax/6)(1 + 2^-4) + 2^-10 ts.
    weight = torch.randn(64, 512) * torch.logspace(-2, 0, 64).unsqueeze(1)
    data, blocked, ts = quantize_nvfp4(weight)
    codes = unpack_pairs_hi_first(data)
    assert codes.shape == weight.shape and int(codes.max()) <= 15
    q = quantize_weight(weight, "nvfp4")
    restored = q.dequantize(torch.float32)
    block_amax = weight.reshape(64, -1, 16).abs().amax(-1, keepdim=True)
    err = (restored - weight).reshape(64, -1, 16).abs()
    assert (err <= block_amax / 6 * (1 + 2**-4) + 2**-10 * ts).all()
    scale = from_blocked(q.scale, 64, 32).to(torch.float32).unsqueeze(-1) * ts
    grid = torch.tensor(E2M1_VALUES)
    distance_to_grid = ((restored.reshape(64, -1, 16) / scale).unsqueeze(-1) - grid).abs().amin(-1)
    assert (distance_to_grid <= 1e-5).all()


def test_nvfp4_swizzle_round_trip() -> None:
    scales = torch.randint(0, 255, (300, 37), dtype=torch.uint8)
    blocked = to_blocked(scales)
    assert blocked.shape == (384, 40)  # padded to 128 rows x 4 columns
    assert torch.equal(from_blocked(blocked, 300, 37), scales)
    # Element (r, c) of a 128x4 tile sits at flat offset (r % 32) * 16 + (r // 32) * 4 + c within the tile.
    tile = blocked.reshape(-1)[:512]  # tiles are contiguous 512-byte runs, the first is rows 0-127, cols 0-3
    assert tile[(77 % 32) * 16 + (77 // 32) * 4 + 3] == scales[77, 3]


def test_quantize_linears_replaces_only_quantised_linears() -> None:
    model = nn.Sequential(nn.Linear(256, 48), nn.GELU(), nn.Linear(48, 16))  # 48 inputs: not whole Q8_0 blocks
    state = quantize_state_dict(dict(model.state_dict()), "q8_0")
    assert isinstance(state["0.weight"], torch.Tensor) is False and isinstance(state["2.weight"], torch.Tensor)
    replaced = load_quantized_into(model, state, torch.float32)
    assert replaced == ["0"] and isinstance(model[0], QuantLinear) and isinstance(model[2], nn.Linear)
    bad = {"0.weight": quantize_weight(torch.randn(32, 256), "q8_0")}  # Linear(256, 64) needs [64, 256]
    with pytest.raises(ValueError, match="does not fit"):
        quantize_linears(nn.Sequential(nn.Linear(256, 64)), bad)


def test_quantize_weight_rejects_bad_shapes_and_formats() -> None:
    with pytest.raises(InvalidInputError, match="in_features divisible by 256"):
        quantize_weight(torch.randn(8, 100), "q4_k")
    with pytest.raises(InvalidInputError, match="unknown quantisation format 'int3'"):
        quantize_weight(torch.randn(8, 256), "int3")


# ---- whole tiny DiT ------------------------------------------------------------------------------

def _tiny_dit():
    from diffusers import ErnieImageTransformer2DModel
    torch.manual_seed(0)
    # head_dim 128 (the real one) so rope axes (32, 48, 48) sum to it; hidden 256 fits Q4_K's 256 blocks.
    model = ErnieImageTransformer2DModel(hidden_size=256, num_attention_heads=2, num_layers=2, ffn_hidden_size=512,
                                         in_channels=16, out_channels=16, text_in_dim=256,
                                         rope_axes_dim=(32, 48, 48)).eval()
    with torch.no_grad():  # no zero-init layers: every Linear must matter for the comparison
        for name, p in model.named_parameters():
            if p.dim() >= 2:
                p.normal_(0, p[0].numel() ** -0.5)
            else:
                p.normal_(1.0 if "norm" in name or "_ln" in name else 0.0, 0.1)
    inputs = (torch.randn(1, 16, 8, 8), torch.tensor([500.0]), torch.randn(1, 6, 256), torch.tensor([5]))
    return model, inputs


# Relative L2 error of the DiT output. Expected ~ the per-weight relative RMS rounding noise (step/sqrt(12)
# over the weights' RMS): Q8_0 step amax/127 -> ~0.5%; e4m3 relative step 2^-3 -> ~2.5%; Q4_K step range/15
# and NVFP4 grid gaps of 0.5-2 x amax/6 -> ~8%. Bounds are ~2.5x those, residual paths keep it from growing.
WHOLE_MODEL_TOLERANCE = {"q8_0": 0.015, "fp8": 0.06, "q4_k": 0.2, "nvfp4": 0.2}


@pytest.mark.parametrize("fmt", FORMATS)
def test_tiny_dit_quantised_output_within_tolerance(fmt: str) -> None:
    model, inputs = _tiny_dit()
    with torch.no_grad():
        reference = model(*inputs, return_dict=False)[0]
    assert torch.isfinite(reference).all()
    quantised = copy.deepcopy(model)
    state = quantize_state_dict({k: v.clone() for k, v in model.state_dict().items()}, fmt)
    replaced = load_quantized_into(quantised, state, torch.float32)
    assert "layers.0.mlp.linear_fc2" in replaced and "final_linear" not in replaced
    with torch.no_grad():
        output = quantised(*inputs, return_dict=False)[0]
    rel = _rel_err(output, reference)
    assert 0 < rel <= WHOLE_MODEL_TOLERANCE[fmt]


# ---- files written by this pack ------------------------------------------------------------------

@pytest.mark.parametrize("fmt", FORMATS)
def test_write_and_reload_quantised_dit(tmp_path: Path, fmt: str) -> None:
    model, inputs = _tiny_dit()
    state = {k: v.bfloat16() for k, v in model.state_dict().items()}
    path = write_quantized_file(state, fmt, tmp_path / f"ernie.{fmt}")
    assert sorted(p.name for p in tmp_path.iterdir()) == [f"ernie.{fmt}"]  # no .partial left behind
    loaded = load_quantized_state_dict(path)
    assert set(loaded) == set(state)
    expected = quantize_weight(state["layers.1.mlp.up_proj.weight"], fmt, per_row_fp8=False)
    assert torch.equal(loaded["layers.1.mlp.up_proj.weight"].dequantize(torch.float32), expected.dequantize(torch.float32))
    target = copy.deepcopy(model).to(torch.bfloat16)
    load_quantized_into(target, loaded, torch.bfloat16)
    with torch.no_grad():
        out = target(*(t.bfloat16() if t.is_floating_point() else t for t in inputs), return_dict=False)[0]
    assert torch.isfinite(out).all()
    with pytest.raises(InvalidInputError, match="already exists"):
        write_quantized_file(state, fmt, path, overwrite=False)


def test_cli_quantize_writes_a_loadable_file(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    from safetensors.torch import save_file
    model, _ = _tiny_dit()
    source = tmp_path / "ernie-image.safetensors"
    save_file({f"model.diffusion_model.{k}": v.bfloat16().contiguous() for k, v in model.state_dict().items()},
              str(source))
    out = tmp_path / "ernie-image-q8_0.gguf"
    assert main_quantize(["--dit", str(source), "--format", "q8_0", "--out", str(out)]) == 0
    assert "wrote" in capsys.readouterr().out
    assert load_quantized_state_dict(out)["layers.0.self_attention.to_k.weight"].qtype == "Q8_0"
    assert main_quantize(["--dit", str(tmp_path / "missing.safetensors"), "--format", "fp8", "--out",
                          str(tmp_path / "x.safetensors")]) == 2
    assert "does not exist" in capsys.readouterr().err


# ---- format choice per GPU -----------------------------------------------------------------------

H200 = DeviceInfo("cuda", "NVIDIA H200", (9, 0), 141 * 10**9)
RTX3060 = DeviceInfo("cuda", "RTX 3060", (8, 6), 12 * 10**9)
RTX5090 = DeviceInfo("cuda", "RTX 5090", (12, 0), 32 * 10**9)
CPU = DeviceInfo("cpu", "CPU", None, 0)


def test_reasons_say_what_runs_natively() -> None:
    assert format_reasons(H200)["nvfp4"].startswith(
        "NVFP4 stays packed on this GPU (SM 9.0) and runs at about bf16 speed; natively faster only on SM >= 10")
    assert "runs natively" in format_reasons(H200)["fp8"]
    assert "natively faster only on SM >= 8.9" in format_reasons(RTX3060)["fp8"]
    assert "runs natively" in format_reasons(RTX5090)["nvfp4"]
    assert all("CPU" in text or "no CUDA" in text for text in format_reasons(CPU).values())


@pytest.mark.parametrize("device", [H200, RTX3060, RTX5090, CPU], ids=lambda device: device.name)
def test_each_reasons_size_says_it_is_the_released_8b_dits(device: DeviceInfo) -> None:
    """The Quant Config node is chosen before any model is: its sizes are not the loaded model's (a demo model's)."""
    for fmt, text in format_reasons(device).items():
        assert f"{DIT_WEIGHT_BYTES[fmt] / 1e9:.1f} GB for the 8B DiT" in text, text


def test_auto_choice_by_gpu_and_budget() -> None:
    assert choose_auto(H200)[0] == "fp8"
    assert choose_auto(RTX3060)[0] == "q4_k"  # 12 GB card: 8 GB of weights leaves too little for activations
    assert choose_auto(RTX3060, vram_budget=9 * 10**9)[0] == "q8_0"
    assert choose_auto(RTX5090, vram_budget=6 * 10**9)[0] == "nvfp4"
    assert choose_auto(DeviceInfo("cuda", "A100", (8, 0), 80 * 10**9))[0] == "bf16"
    assert choose_auto(CPU)[0] == "bf16"
    fmt, reason = choose_auto(RTX3060, vram_budget=2 * 10**9)
    assert fmt == "q4_k" and "stream" in reason
    assert DIT_WEIGHT_BYTES["q8_0"] <= 8.6e9 and DIT_WEIGHT_BYTES["q4_k"] <= 4.8e9 and DIT_WEIGHT_BYTES["nvfp4"] <= 4.8e9
