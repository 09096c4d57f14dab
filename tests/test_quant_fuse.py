"""Packed FP8 Linears sharing an input are stacked into one (runtime/quant/fuse.py), as plain Linears are: q/k/v and
gate/up of an FP8 DiT become one layer each, holding the same rows with the same scales, so the DiT computes what
it computed before; LoRAs land on their own slices of the stacked layer. Stacked only where the layers multiply
natively (a GPU with FP8 GEMMs); the CPU plays that GPU here, its layers dequantising."""
from __future__ import annotations

import copy

import pytest
import torch
from reference_models import random_dit

import lora_files as lf
from ernie_image.runtime.lora.attach import LoraLinear, apply_stack
from ernie_image.runtime.lora.keys import dit_linear_shapes
from ernie_image.runtime.lora.parsed import load_lora
from ernie_image.runtime.model.compile import fuse_projections
from ernie_image.runtime.quant import QuantLinear, fuse as fuse_module, quantize_weight
from ernie_image.runtime.quant.fuse import fuse_packed
from ernie_image.runtime.quant.linear import quantize_linears
from ernie_image.runtime.quant.qweight import QuantizedWeight


@pytest.fixture
def native_here(monkeypatch: pytest.MonkeyPatch) -> None:
    """The CPU stands for a GPU with FP8 GEMMs: the stacking rule asks where the weights live."""
    monkeypatch.setattr(fuse_module, "native_fp8_supported", lambda device: True)


def fp8_layer(out_features: int, in_features: int, seed: int, per_row: bool = True, name: str = "") -> QuantLinear:
    generator = torch.Generator().manual_seed(seed)
    weight = torch.randn((out_features, in_features), generator=generator) * (seed + 1)
    return QuantLinear(quantize_weight(weight, "fp8") if per_row else _per_tensor(weight), name=name)


def _per_tensor(weight: torch.Tensor) -> QuantizedWeight:
    from ernie_image.runtime.quant.fp8 import quantize_fp8

    data, scale = quantize_fp8(weight, per_row=False)
    return QuantizedWeight("fp8", "e4m3fn", data, tuple(weight.shape), scale=scale)


@pytest.mark.parametrize("per_row", [(True, True, True), (False, False, False), (True, False, True)],
                         ids=["per-row scales", "per-tensor scales", "both"])
def test_the_stack_holds_each_layers_rows_with_its_scales(native_here, per_row):
    layers = [fp8_layer(32, 64, seed, rows, f"layers.2.self_attention.to_{part}")
              for seed, rows, part in zip(range(3), per_row, "qkv")]
    stacked = fuse_packed(layers, "to_qkv")
    assert isinstance(stacked, QuantLinear) and stacked.layer_name == "layers.2.self_attention.to_qkv"
    assert stacked.shape == (96, 64) and stacked.weight_scale.shape == (96,)
    expected = torch.cat([layer.dequantized_weight(torch.float32) for layer in layers])
    assert torch.equal(stacked.dequantized_weight(torch.float32), expected)
    x = torch.randn((5, 64))
    for got, layer in zip(stacked(x).chunk(3, dim=-1), layers):
        assert torch.allclose(got, layer(x), rtol=1e-6, atol=1e-6)


def test_layers_that_do_not_stack_stay_apart(native_here):
    fp8 = [fp8_layer(32, 64, 0), fp8_layer(32, 64, 1)]
    gguf = QuantLinear(quantize_weight(torch.randn(32, 64), "q8_0"))
    with_bias = QuantLinear(quantize_weight(torch.randn(32, 64), "fp8"), bias=torch.zeros(32))
    wider = fp8_layer(32, 96, 2)
    plain = torch.nn.Linear(64, 32, bias=False)
    for mix in ([fp8[0], gguf], [fp8[0], with_bias], [fp8[0], wider], [fp8[0], plain], []):
        assert fuse_packed(mix, "to_qkv") is None


def test_without_native_fp8_gemms_nothing_is_stacked():
    """A layer that dequantises per call would hold the stack's whole bf16 copy, which the VRAM plan does not
    count (it counts the largest single layer)."""
    assert fuse_packed([fp8_layer(32, 64, 0), fp8_layer(32, 64, 1)], "gate_up") is None


def fp8_dit() -> torch.nn.Module:
    dit = random_dit("cpu", torch.float32)
    state = {key: quantize_weight(value, "fp8") for key, value in dit.state_dict().items()
             if key.startswith("layers.") and key.endswith(".weight") and value.dim() == 2}
    quantize_linears(dit, state)
    return dit.eval()


def step(dit: torch.nn.Module) -> torch.Tensor:
    generator = torch.Generator().manual_seed(0)
    latents = torch.randn((1, 128, 4, 4), generator=generator)
    text = torch.randn((1, 5, dit.config.text_in_dim), generator=generator)
    with torch.inference_mode():
        return dit(latents, torch.tensor([500.0]), text, [5])


def test_an_fp8_dits_projections_are_stacked_and_it_computes_what_it_did(native_here):
    separate = fp8_dit()
    stacked = copy.deepcopy(separate)
    version = stacked.structure_version
    assert fuse_projections(stacked) == 2 * len(stacked.layers)
    assert stacked.structure_version > version  # captured forwards of the separate layers are stale
    block = stacked.layers[0]
    assert isinstance(block.self_attention.to_qkv, QuantLinear) and isinstance(block.mlp.gate_up, QuantLinear)
    assert not hasattr(block.self_attention, "to_q") and not hasattr(block.mlp, "gate_proj")
    expected = step(separate)
    assert (step(stacked) - expected).abs().max().item() <= 1e-5 * expected.abs().max().item()


def test_loras_land_on_their_own_slices_of_a_stacked_fp8_layer(native_here, tmp_path):
    separate = fp8_dit()
    stacked = copy.deepcopy(separate)
    fuse_projections(stacked)
    config = separate.config
    shapes = dit_linear_shapes(config)
    stack = [(load_lora(lf.write_ai_toolkit(tmp_path / "all.safetensors", lf.random_lora(shapes, 4, seed=3)),
                        config), 0.8)]
    base = step(separate)
    for dit in (separate, stacked):
        apply_stack(dit, stack)
    assert isinstance(stacked.layers[0].self_attention.to_qkv, LoraLinear)
    assert stacked.layers[0].self_attention.to_qkv.slices == 3 and stacked.layers[0].mlp.gate_up.slices == 2
    expected = step(separate)
    assert (step(stacked) - expected).abs().max().item() <= 1e-5 * expected.abs().max().item()
    assert (expected - base).abs().max().item() > 1e-3  # the LoRA changed the output
