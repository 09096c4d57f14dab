"""Merged LoRAs on a CUDA GPU: the compiled DiT (bf16, and FP8 block Linears) takes a merge, a switch, a strength
change and the removal of every LoRA without compiling anything again (the weights are edited in place, same
addresses); captured CUDA graphs replay the merged weights without a recapture; the host copy is page-locked; the
base comes back bit for bit. Skipped without CUDA."""
from __future__ import annotations

import pytest
import torch

import lora_files as lf
from ernie_image.runtime.lora.apply import apply_loras
from ernie_image.runtime.lora.keys import dit_linear_shapes
from ernie_image.runtime.lora.merge import merge_state
from ernie_image.runtime.lora.parsed import load_lora
from ernie_image.runtime.model.compile import compile_blocks, fuse_projections
from ernie_image.runtime.model.dit import DiTConfig, ErnieDiT
from ernie_image.runtime.model.dit_graphs import DiTGraphs
from ernie_image.runtime.quant.linear import QuantLinear, quantize_linears
from ernie_image.runtime.quant.writer import quantize_weight
from small_dits import compiled_graphs, scaled_random_dit, step_inputs

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

# Head dim 128 as released; gate_up is 4 MB in bf16, so the host copy of the large weights is page-locked.
CONFIG = DiTConfig(hidden_size=512, num_attention_heads=4, num_layers=3, ffn_hidden_size=2048, text_in_dim=192,
                   rope_axes_dim=(32, 48, 48))


@pytest.fixture(scope="module")
def loras(tmp_path_factory):
    folder = tmp_path_factory.mktemp("gpu-merge-loras")
    return lf.two_dit_loras(folder, dit_linear_shapes(CONFIG), kohya_rank=16)


def stack(loras, name: str, strength: float = 1.0):
    return [(load_lora(loras[name], CONFIG), strength, "merge")]


def addresses(dit) -> dict[str, int]:
    return {name: tensor.data_ptr() for name, tensor in dit.state_dict(keep_vars=True).items()}


def fp8_blocks(dit: ErnieDiT) -> ErnieDiT:
    state = {key: quantize_weight(value, "fp8") for key, value in dit.state_dict().items()
             if key.startswith("layers.") and key.endswith(".weight") and value.dim() == 2}
    quantize_linears(dit, state)
    return dit


@pytest.mark.parametrize("fmt", ["bf16", "fp8"])
@torch.inference_mode()
def test_compiled_dit_merges_switches_and_unmerges_without_recompiling(loras, fmt):
    torch._dynamo.reset()
    dit = scaled_random_dit(CONFIG, "cuda", torch.bfloat16)
    fuse_projections(dit)
    if fmt == "fp8":
        fp8_blocks(dit)
        assert isinstance(dit.layers[0].mlp.gate_up, QuantLinear)
    assert compile_blocks(dit)
    args = step_inputs(CONFIG, "cuda", torch.bfloat16)
    base = dit(*args).clone()
    pointers = addresses(dit)
    before = compiled_graphs()
    outputs = []
    for name, strength in (("a", 1.0), ("b", 1.0), ("a", 0.4)):
        applied = apply_loras(dit, stack(loras, name, strength))
        assert applied.merged_layers and not applied.branch_layers and not applied.fallback
        outputs.append(dit(*args).clone())
    assert compiled_graphs() == before, "a merge, a switch or a strength change recompiled"
    assert addresses(dit) == pointers  # edited in place
    assert not torch.equal(outputs[0], outputs[1]) and not torch.equal(outputs[0], outputs[2])
    assert not torch.equal(outputs[0], base)
    apply_loras(dit, [])
    assert torch.equal(dit(*args), base)
    assert compiled_graphs() == before


@torch.inference_mode()
def test_captured_cuda_graphs_replay_the_merged_weights_without_a_recapture(loras):
    dit = scaled_random_dit(CONFIG, "cuda", torch.bfloat16)
    fuse_projections(dit)
    graphed = DiTGraphs(dit)
    args = step_inputs(CONFIG, "cuda", torch.bfloat16)
    base = graphed(*args).clone()
    graphed(*args)  # warm-up, then capture
    captures = graphed.captures
    apply_loras(dit, stack(loras, "a"))
    eager_merged = dit(*args).clone()
    replayed = graphed(*args)
    assert graphed.captures == captures and graphed.replays >= 1
    assert torch.equal(replayed, eager_merged) and not torch.equal(replayed, base)
    apply_loras(dit, [])
    assert torch.equal(graphed(*args), base) and graphed.captures == captures


def test_the_host_copy_is_page_locked_and_counted(loras):
    dit = scaled_random_dit(CONFIG, "cuda", torch.bfloat16)
    fuse_projections(dit)
    applied = apply_loras(dit, stack(loras, "a"))
    state = merge_state(dit)
    large = sum(t.nbytes for t in state.host_tensors() if t.nbytes >= 1 << 20)
    assert large and state.pinned_bytes == large and applied.backup_pinned_bytes == large
    assert all(t.is_pinned() for t in state.host_tensors() if t.nbytes >= 1 << 20)
    touched = sum(dit.get_submodule(p).weight.nbytes for p in state.merged)
    assert state.host_bytes == touched == applied.backup_bytes
    allocated = torch.cuda.memory_allocated()
    apply_loras(dit, stack(loras, "b"))
    assert torch.cuda.memory_allocated() <= allocated  # a merge holds no device memory of its own
    apply_loras(dit, [])
    assert state.host_bytes == 0 and state.pinned_bytes == 0
