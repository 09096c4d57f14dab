"""Every code path that gives the DiT new tensors or modules bumps `ErnieDiT.structure_version`; in-place edits do not.

CUDA-graph replay (runtime/model/dit_graphs.py) trusts this counter instead of re-reading every parameter's address per
call: a path that swaps tensors without bumping it would leave a graph replaying freed memory.
"""
from __future__ import annotations

import pytest
import torch

import lora_files as lf
from ernie_image.runtime.lora.attach import apply_stack
from ernie_image.runtime.lora.keys import dit_linear_shapes
from ernie_image.runtime.lora.parsed import load_lora
from ernie_image.runtime.model.compile import fuse_projections
from ernie_image.runtime.model.dit import ErnieDiT
from ernie_image.runtime.offload.placement import DiTPlacement
from ernie_image.runtime.offload.planner import DiTPlan
from ernie_image.runtime.quant.linear import QuantLinear, load_quantized_into
from ernie_image.runtime.quant.writer import quantize_state_dict
from reference_models import DIT_CONFIG as CONFIG


@pytest.fixture
def dit() -> ErnieDiT:
    torch.manual_seed(0)
    return ErnieDiT(CONFIG).eval().requires_grad_(False)


def test_a_new_dit_starts_at_version_zero(dit):
    assert dit.structure_version == 0


def test_fusing_projections_bumps_it(dit):
    assert fuse_projections(dit) > 0 and dit.structure_version == 1


def test_attaching_and_detaching_a_lora_bump_it(dit, tmp_path):
    path = lf.write_ai_toolkit(tmp_path / "r4.safetensors", lf.random_lora(dit_linear_shapes(CONFIG), 4, seed=1))
    apply_stack(dit, [(load_lora(path, CONFIG), 1.0)])
    attached = dit.structure_version
    assert attached > 0
    apply_stack(dit, [])
    assert dit.structure_version > attached


def test_replacing_linears_by_packed_ones_bumps_it(dit):
    state = quantize_state_dict(dict(dit.state_dict()), "q8_0")
    replaced = load_quantized_into(dit, state, torch.float32)  # the plain rest is copied in: no bump of its own
    assert replaced and isinstance(dit.get_submodule(replaced[0]), QuantLinear)
    assert dit.structure_version == 1


@pytest.mark.parametrize("move", ["to_dtype", "to_device", "half", "to_empty"])
def test_moving_the_whole_model_bumps_it(dit, move):
    {"to_dtype": lambda: dit.to(torch.bfloat16), "to_device": lambda: dit.to("cpu"), "half": dit.half,
     "to_empty": lambda: dit.to_empty(device="meta")}[move]()
    assert dit.structure_version == 1


def test_assigning_a_state_dict_bumps_it_and_copying_one_in_does_not(dit):
    weight = dit.final_linear.weight
    dit.load_state_dict({key: value.clone() for key, value in dit.state_dict().items()})
    assert dit.structure_version == 0 and dit.final_linear.weight.data_ptr() == weight.data_ptr()
    dit.load_state_dict({key: value.clone() for key, value in dit.state_dict().items()}, assign=True)
    assert dit.structure_version == 1 and dit.final_linear.weight.data_ptr() != weight.data_ptr()


def test_placing_and_releasing_bump_it(dit):
    placement = DiTPlacement(dit, DiTPlan(3, (0,), (1, 2), 2, 0, 0, 0), torch.device("cpu"), fake_mode="lazy")
    placed = dit.structure_version
    assert placed > 0
    placement.release()
    assert dit.structure_version > placed


def test_resident_placement_bumps_it_too(dit):
    placement = DiTPlacement(dit, DiTPlan(3, (0, 1, 2), (), 0, 0, 0, 0), torch.device("cpu"))
    assert dit.structure_version == 1
    placement.release()


def test_in_place_edits_leave_it(dit):
    with torch.no_grad():
        dit.layers[0].mlp.linear_fc2.weight.mul_(0.5)
        dit.final_linear.weight.copy_(torch.randn_like(dit.final_linear.weight))
    dit.requires_grad_(False).eval()  # neither gives the DiT a new tensor
    assert dit.structure_version == 0
