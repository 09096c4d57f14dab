"""FP8 projections sharing an input are stacked into one layer on load (QuantLinear.stacked_with, through the DiT's
fuse_projections): q/k/v and gate/up as one GEMM each, each row keeping its own layer's scale, so every output is
the product the separate layers compute. A merged LoRA on one of them leaves the other layers' rows as they were.

On the CPU the layers dequantise; the GPU test multiplies natively (torch._scaled_mm, row-wise scales).
"""
from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

from ernie_image.runtime.model.compile import fuse_projections
from ernie_image.runtime.quant import QuantLinear
from ernie_image.runtime.quant.writer import quantize_weight
from reference_models import random_dit
from test_dit_graphs import step_inputs

BLOCK_LINEARS = ("self_attention.to_q", "self_attention.to_k", "self_attention.to_v", "self_attention.to_out.0",
                 "mlp.gate_proj", "mlp.up_proj", "mlp.linear_fc2")


def fp8_layers(widths: tuple[int, ...] = (64, 32, 48), in_features: int = 96, per_row: bool = False,
               names: str = "qkv") -> list[QuantLinear]:
    """FP8 layers of one input, with weights of different magnitudes (so their scales differ)."""
    torch.manual_seed(0)
    return [QuantLinear(quantize_weight(torch.randn(width, in_features) * magnitude, "fp8", per_row_fp8=per_row),
                        None, torch.bfloat16, f"layers.0.self_attention.to_{name}")
            for width, magnitude, name in zip(widths, (1.0, 3.0, 0.2), names)]


def fp8_dit(device: str = "cpu") -> nn.Module:
    """The reference DiT in bf16 with every block Linear packed to FP8, as a pipe quantising on load has it."""
    dit = random_dit(device, torch.bfloat16)
    for index, block in enumerate(dit.layers):
        for path in BLOCK_LINEARS:
            parent_path, _, leaf = path.rpartition(".")
            parent = block.get_submodule(parent_path)
            linear = getattr(parent, leaf) if not leaf.isdigit() else parent[int(leaf)]
            packed = QuantLinear(quantize_weight(linear.weight.float(), "fp8"), linear.bias, torch.bfloat16,
                                 f"layers.{index}.{path}")
            if leaf.isdigit():
                parent[int(leaf)] = packed.to(device)
            else:
                setattr(parent, leaf, packed.to(device))
    return dit


@pytest.mark.parametrize("per_row", [False, True], ids=["per-tensor scales", "per-row scales"])
def test_stacked_fp8_layers_hold_the_same_weights_and_give_the_same_outputs(per_row):
    layers = fp8_layers(per_row=per_row)
    stacked = layers[0].stacked_with(layers[1:])
    assert stacked is not None and stacked.layer_name == "layers.0.self_attention.to_q+to_k+to_v"
    assert (stacked.out_features, stacked.in_features) == (144, 96) and stacked.weight.dtype == torch.float8_e4m3fn
    assert torch.equal(stacked.dequantized_weight(), torch.cat([layer.dequantized_weight() for layer in layers]))
    x = torch.randn(2, 5, 96).bfloat16()
    assert torch.equal(stacked(x), torch.cat([layer(x) for layer in layers], dim=-1))


def _with_bias(layers):
    layers[1].bias = nn.Parameter(torch.zeros(32, dtype=torch.bfloat16), requires_grad=False)
    return layers


def _fp16(layers):
    layers[2].compute_dtype = torch.float16
    return layers


def _other_width(layers):
    return [*layers[:2], fp8_layers(in_features=112)[2]]


def _plain_linear(layers):
    return [*layers[:2], nn.Linear(96, 48, bias=False)]


def _gguf(layers):
    return [*layers[:2], QuantLinear(quantize_weight(torch.randn(48, 96), "q8_0"), None, torch.bfloat16)]


@pytest.mark.parametrize("unlike", [_with_bias, _fp16, _other_width, _plain_linear, _gguf],
                         ids=["a bias", "fp16 activations", "another input width", "a plain Linear", "GGUF"])
def test_layers_that_cannot_share_one_fp8_gemm_are_not_stacked(unlike):
    layers = unlike(fp8_layers())
    assert layers[0].stacked_with(layers[1:]) is None


@torch.inference_mode()
def test_a_dit_whose_projections_are_fp8_stacks_them_and_computes_the_same_bits():
    separate = fp8_dit()
    stacked = copy.deepcopy(separate)
    version = stacked.structure_version
    assert fuse_projections(stacked) == 2 * len(stacked.layers)
    assert stacked.structure_version == version + 1
    for block in stacked.layers:
        assert isinstance(block.self_attention.to_qkv, QuantLinear) and isinstance(block.mlp.gate_up, QuantLinear)
        assert not hasattr(block.self_attention, "to_q") and not hasattr(block.mlp, "gate_proj")
    inputs = step_inputs("cpu", torch.bfloat16)
    assert torch.equal(stacked(*inputs), separate(*inputs))


def test_where_the_device_does_not_multiply_fp8_natively_the_projections_stay_apart():
    """Dequantised per call, a stacked layer would only need more memory at once (a pipe passes
    stack_packed=native_fp8_supported(device) and a bf16 dtype)."""
    dit = fp8_dit()
    version = dit.structure_version
    assert fuse_projections(dit, stack_packed=False) == 0 and dit.structure_version == version
    assert dit.layers[0].self_attention.to_qkv is None and isinstance(dit.layers[0].mlp.up_proj, QuantLinear)


def test_a_merged_lora_on_one_stacked_layer_leaves_the_others_rows_as_they_were():
    """Layers of one scale each (as FP8 files hold them), stacked: a scale per row. The rows of k and v keep their
    codes and scales when a LoRA adapts q alone; q's rows take the merge."""
    from ernie_image.runtime.lora.adapters import LowRank
    from ernie_image.runtime.lora.merge import Contribution, _merge_fp8

    layers = fp8_layers(widths=(48, 48, 48), per_row=False)
    stacked = layers[0].stacked_with(layers[1:])
    before = (stacked.weight.clone(), stacked.weight_scale.clone(), stacked.weight_scale_row.clone())
    torch.manual_seed(1)
    adapter = LowRank(down=torch.randn(4, 96), up=torch.randn(48, 4), scale=0.5)
    _merge_fp8(stacked, [Contribution(key=("q",), adapter=adapter, strength=1.0, slice_index=0, slices=3)], seed=7)
    q_rows, other_rows = slice(0, 48), slice(48, 144)
    weight = stacked.weight.view(torch.uint8)
    assert torch.equal(weight[other_rows], before[0].view(torch.uint8)[other_rows])
    assert torch.equal(stacked.weight_scale[other_rows], before[1][other_rows])
    assert not torch.equal(weight[q_rows], before[0].view(torch.uint8)[q_rows])
    assert torch.equal(stacked.weight_scale_row.reshape(-1), stacked.weight_scale.float())


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.get_device_capability() < (8, 9),
                    reason="needs a CUDA GPU with FP8 (SM >= 8.9)")
@pytest.mark.parametrize("per_row", [False, True], ids=["per-tensor scales", "per-row scales"])
@torch.inference_mode()
def test_on_the_gpu_a_stacked_fp8_layer_multiplies_natively_to_the_separate_layers_outputs(per_row):
    layers = [layer.cuda() for layer in fp8_layers(widths=(256, 256, 256), in_features=256, per_row=per_row)]
    stacked = layers[0].stacked_with(layers[1:])
    x = torch.randn(3, 77, 256, device="cuda").bfloat16()
    ours, theirs = stacked(x), torch.cat([layer(x) for layer in layers], dim=-1)
    assert not stacked._native_failed and not any(layer._native_failed for layer in layers)
    assert ((ours.float() - theirs.float()).abs().max() <= 1e-2 * theirs.float().abs().max()).item()
    dit = fp8_dit("cuda")
    separate = copy.deepcopy(dit)
    fuse_projections(dit)
    inputs = step_inputs("cuda", torch.bfloat16)
    fused_out, separate_out = dit(*inputs), separate(*inputs)
    assert ((fused_out.float() - separate_out.float()).norm() / separate_out.float().norm()).item() < 1e-2
