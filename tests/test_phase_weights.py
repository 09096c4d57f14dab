"""PhaseWeights: a phase-placed model's weights live in one host slab made once; a phase puts them on the device in
one copy and leaving it copies nothing back (runtime/offload/phase_weights.py). The CPU plays the device here; the
GPU test checks the device memory and the page-locked slab."""
from __future__ import annotations

import pytest
import torch

from ernie_image.runtime.demo.tiny import lively_prompt_enhancer
from ernie_image.runtime.offload.phase_weights import PhaseWeights
from ernie_image.runtime.offload.placement import PePlacement
from ernie_image.runtime.offload.planner import LayeredPlan
from ernie_image.runtime.text.static_decoder import _stacked_weight, stack_weights_

PROMPT = torch.tensor([[1] + list(range(20, 40))])


def logits(model) -> torch.Tensor:
    device = model.get_input_embeddings().weight.device
    with torch.inference_mode():
        return model(PROMPT.to(device)).logits.float().cpu()


def storage_of(tensor: torch.Tensor) -> int:
    return tensor.untyped_storage().data_ptr()


def tensors_of(model: torch.nn.Module) -> list[torch.Tensor]:
    return list(model.parameters()) + list(model.buffers())


def zero_every_tensor(model: torch.nn.Module) -> None:
    """In a function of its own: a loop variable left in the test would hold a view of the device copy, and with it
    the whole buffer, after the phase is left."""
    with torch.no_grad():
        for tensor in tensors_of(model):
            tensor.zero_()


@pytest.fixture
def model():
    return lively_prompt_enhancer(seed=3).eval().requires_grad_(False)


def test_the_host_copy_computes_what_the_model_did_with_the_same_parameters_and_buffers(model):
    expected = logits(model)
    names = [name for name, _ in model.named_parameters()] + [name for name, _ in model.named_buffers()]
    weights = PhaseWeights(model, torch.device("cpu"))
    assert torch.equal(logits(model), expected)
    assert [name for name, _ in model.named_parameters()] + [name for name, _ in model.named_buffers()] == names
    assert all(isinstance(p, torch.nn.Parameter) and not p.requires_grad for p in model.parameters())
    slab = storage_of(weights.slab.data)
    assert all(storage_of(t) == slab for t in list(model.parameters()) + list(model.buffers()))
    assert model.lm_head.weight is model.model.embed_tokens.weight  # the tie holds


def test_a_phase_moves_every_tensor_into_one_buffer_and_leaving_points_back_at_the_slab(model):
    expected = logits(model)
    weights = PhaseWeights(model, torch.device("cpu"))
    slab = storage_of(weights.slab.data)
    for _ in range(2):
        weights.enter()
        assert weights.on_device
        placed = {storage_of(t) for t in list(model.parameters()) + list(model.buffers())}
        assert len(placed) == 1 and placed != {slab}
        assert torch.equal(logits(model), expected)
        weights.leave()
        assert not weights.on_device
        assert {storage_of(t) for t in list(model.parameters()) + list(model.buffers())} == {slab}
        assert torch.equal(logits(model), expected)


def test_stacked_projections_are_views_already_and_leaving_restores_the_host_linears(model):
    attention, mlp = model.model.layers[0].self_attn, model.model.layers[0].mlp
    weights = PhaseWeights(model, torch.device("cpu"))
    host_q = attention.q_proj.weight
    weights.enter()
    placed_q = attention.q_proj.weight
    projections = [attention.q_proj, attention.k_proj, attention.v_proj]
    assert _stacked_weight(projections) is not None and _stacked_weight([mlp.gate_proj, mlp.up_proj]) is not None
    assert stack_weights_(projections) and attention.q_proj.weight is placed_q  # nothing to copy: kept as is
    with torch.inference_mode():  # a decoder's own stacked copy, made under inference mode
        attention.q_proj.weight = torch.nn.Parameter(placed_q.detach().clone(), requires_grad=False)
    weights.leave()
    assert attention.q_proj.weight is host_q and storage_of(host_q) == storage_of(weights.slab.data)
    weights.enter()
    assert storage_of(attention.q_proj.weight) != storage_of(weights.slab.data)
    assert not attention.q_proj.weight.is_inference()


def test_weights_a_decoder_stacked_under_inference_mode_before_the_first_phase_still_move(model):
    expected = logits(model)
    layer = model.model.layers[0]
    with torch.inference_mode():
        stack_weights_([layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj])
    assert layer.self_attn.q_proj.weight.is_inference()
    weights = PhaseWeights(model, torch.device("cpu"))
    weights.enter()
    assert torch.equal(logits(model), expected)
    assert not any(p.is_inference() for p in model.parameters())
    with torch.no_grad():
        model(PROMPT)  # outside inference mode too
    weights.leave()
    assert torch.equal(logits(model), expected)


def test_the_host_copy_keeps_no_reference_to_the_tensors_it_was_made_from(model):
    import gc
    import weakref

    sources = [weakref.ref(t) for t in list(model.parameters()) + list(model.buffers())]
    weights = PhaseWeights(model, torch.device("cpu"))
    gc.collect()
    assert all(source() is None for source in sources)
    assert weights.nbytes > 0


def test_release_frees_the_slab(model):
    weights = PhaseWeights(model, torch.device("cpu"))
    nbytes = weights.nbytes
    assert nbytes >= sum(t.numel() * t.element_size() for t in model.state_dict().values()) - \
        model.lm_head.weight.numel() * model.lm_head.weight.element_size()
    model.to_empty(device="meta")
    weights.release()
    assert weights.slab.data.numel() == 0


def test_a_phase_placed_pe_gives_the_same_logits_after_each_leave_and_enter(model):
    expected = logits(model)
    placed = PePlacement(model, LayeredPlan("phase", 0, 0, 0, 0, len(model.model.layers)), torch.device("cpu"))
    assert placed.phase_weights is not None and placed.phase_weights.on_device
    for _ in range(3):
        placed.leave()
        placed.enter()
        assert torch.equal(logits(model), expected)
    placed.release()
    assert all(t.is_meta for t in model.parameters())


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_on_the_gpu_leaving_a_phase_frees_the_device_copy_at_once_from_a_page_locked_slab(model):
    model = model.to(torch.bfloat16)
    expected = logits(model.cuda())
    model.cpu()
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    weights = PhaseWeights(model, torch.device("cuda"))
    assert weights.slab.data.is_pinned() and weights.pinned_bytes >= weights.nbytes
    weights.enter()
    assert torch.cuda.memory_allocated() - before >= weights.nbytes
    assert torch.equal(logits(model), expected)
    zero_every_tensor(model)  # a change on the device: a leave that copied the device copy back would keep it
    weights.leave()
    assert {storage_of(t) for t in tensors_of(model)} == {storage_of(weights.slab.data)}, "the slab's tensors again"
    assert torch.cuda.memory_allocated() == before
    assert all(not t.is_cuda for t in model.parameters())
    weights.enter()
    assert torch.equal(logits(model), expected), "leaving copies nothing back: the slab is as it was made"
    weights.leave()
