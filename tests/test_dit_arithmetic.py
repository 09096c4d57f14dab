"""The DiT's arithmetic is chosen once per model and recorded on it (model/arithmetic.py): the constructor and
LoadOptions take it, a bad choice is refused in one line, and a second model on the same weights computes another
arithmetic without touching the first. No process-wide switch exists to flip."""
from __future__ import annotations

import pytest
import torch

from ernie_image.runtime.core.errors import InvalidInputError
from ernie_image.runtime.model import dit as dit_module, fused_kernels
from ernie_image.runtime.model.arithmetic import Arithmetic
from ernie_image.runtime.model.dit import ErnieDiT
from reference_models import DIT_CONFIG, random_dit
from test_dit_graphs import step_inputs


def test_the_arithmetic_names_and_their_forms():
    assert Arithmetic.of("fast") == Arithmetic()
    assert Arithmetic.of("exact") == Arithmetic(fast=False)
    assert Arithmetic.of("plain") == Arithmetic(fast=False, folded_casts=False)
    assert [Arithmetic.of(name).name for name in ("fast", "exact", "plain")] == ["fast", "exact", "plain"]
    assert Arithmetic(kitchen_rope=False).name == "custom"
    with pytest.raises(ValueError, match="arithmetic 'quick' is not one of fast, exact, plain"):
        Arithmetic.of("quick")


def test_the_folded_forms_step_aside_only_where_dynamo_traces_the_call(monkeypatch):
    """Inside a traced call the plain expressions are used; a compile on another thread (which raises the
    process-wide `is_compiling` flag) leaves the calls running beside it on the folded forms."""
    arithmetic = Arithmetic()
    monkeypatch.setattr(torch.compiler, "_is_compiling_flag", True)
    assert torch.compiler.is_compiling() and arithmetic.folds_casts()
    monkeypatch.setattr(torch.compiler, "_is_compiling_flag", False)

    @torch.compile(backend="eager", fullgraph=True)
    def traced(x: torch.Tensor) -> torch.Tensor:
        return x + 1 if arithmetic.folds_casts() else x - 1

    assert traced(torch.zeros(2)).tolist() == [-1.0, -1.0]


def test_no_module_global_chooses_the_arithmetic():
    for name in ("FAST_EAGER_ON_CUDA", "_eager_kernels", "_fast_eager"):
        assert not hasattr(dit_module, name)
    for name in ("ENABLED", "ROPE_ENABLED", "ADALN_ENABLED"):
        assert not hasattr(fused_kernels, name)


def test_the_model_records_its_arithmetic_and_a_twin_shares_its_weights():
    assert ErnieDiT(DIT_CONFIG).arithmetic == Arithmetic()
    model = random_dit("cpu", torch.float32)
    exact = model.with_arithmetic("exact")
    assert exact.arithmetic.name == "exact" and model.arithmetic.name == "fast"
    assert exact.layers is model.layers
    assert all(a is b for a, b in zip(exact.parameters(), model.parameters()))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@torch.inference_mode()
def test_off_cuda_fast_exact_and_plain_give_the_same_bits(dtype):
    """The fewer-pass forms run on CUDA only; the CPU computes the exact forms whatever the choice."""
    model = random_dit("cpu", dtype)
    args = step_inputs("cpu", dtype)
    fast = model(*args)
    assert torch.equal(fast, model.with_arithmetic("exact")(*args))
    assert torch.equal(fast, model.with_arithmetic("plain")(*args))


def test_load_options_take_the_arithmetic_and_the_pipe_builds_its_dit_with_it(tiny_turbo_folder):
    from ernie_image import LoadOptions, LocalPipe

    with pytest.raises(InvalidInputError, match="arithmetic 'plain' is not supported: use fast or exact"):
        LoadOptions(arithmetic="plain").validate()
    pipe = LocalPipe.load(tiny_turbo_folder, LoadOptions(device="cpu", arithmetic="exact"))
    assert pipe.parts.load_dit().arithmetic.name == "exact"
    assert "eager, exact arithmetic" in pipe.describe()
    assert LocalPipe.load(tiny_turbo_folder, LoadOptions(device="cpu")).parts.load_dit().arithmetic.name == "fast"


def weighted_tables_per_block(rope, normed: torch.Tensor, q_weight: torch.Tensor, k_weight: torch.Tensor):
    """The fast form's q/k RoPE with the norm weights folded into the tables, each table built on its own (the
    four passes a block made before its two tables became one product): the numbers the fast form must keep."""
    half = normed.shape[-1] // 2
    weights = torch.stack((q_weight, k_weight)).to(normed.dtype)[:, None, :]
    cos = rope.cos.unsqueeze(2) * weights
    sin = rope.signed_sin.unsqueeze(2) * torch.cat((weights[..., half:], weights[..., :half]), dim=-1)
    out = normed * cos
    out[..., :half].addcmul_(normed[..., half:], sin[..., :half])
    out[..., half:].addcmul_(normed[..., :half], sin[..., half:])
    return out


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("grid, text_lens", [((4, 6), [7]), ((3, 5), [2, 9]), ((8, 8), [5, 5])],
                         ids=["one row", "two text lengths", "batch of two"])
@torch.inference_mode()
def test_the_weighted_rope_tables_of_a_block_are_one_product_with_the_same_bits(dtype, grid, text_lens):
    fast_on_cpu = Arithmetic(fast_devices=("cpu",), kitchen_rope=False, kitchen_adaln=False)
    model = ErnieDiT(DIT_CONFIG, arithmetic=fast_on_cpu).to(dtype)
    rope = model.rope_tables(grid, text_lens, max(text_lens), "cpu", dtype)
    generator = torch.Generator().manual_seed(len(text_lens))
    sequence, heads, head_dim = grid[0] * grid[1] + max(text_lens), DIT_CONFIG.num_attention_heads, DIT_CONFIG.head_dim
    normed = torch.randn(len(text_lens), sequence, 2, heads, head_dim, generator=generator).to(dtype)
    q_weight, k_weight = (1 + 0.1 * torch.randn(2, head_dim, generator=generator)).to(dtype)
    got = rope.apply_weighted(normed, dit_module.qk_norm_weights(q_weight, k_weight, dtype))
    assert torch.equal(got, weighted_tables_per_block(rope, normed, q_weight, k_weight))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
def test_each_blocks_qk_norm_weights_are_laid_out_once_until_edited_with_the_same_bits(dtype, monkeypatch):
    """The fast form lays each block's q/k norm weights side by side at the first step and keeps them: later steps
    lay out none and give the bits of a model that kept nothing (a twin on the same weights, made afresh). A norm
    weight edited in place, moved or replaced is laid out again (that block's alone; every block's when the whole
    model goes to another dtype and back, which rounds the weights), and the new bits are the twin's; a
    structure_version bump with the weights unchanged lays out nothing. The model is built outside inference mode,
    as pipes build theirs."""
    fast_on_cpu = Arithmetic(fast_devices=("cpu",), kitchen_rope=False, kitchen_adaln=False)
    model = random_dit("cpu", dtype).with_arithmetic(fast_on_cpu)
    laid_out = []
    lay_out = dit_module.qk_norm_weights
    monkeypatch.setattr(dit_module, "qk_norm_weights", lambda *weights: laid_out.append(1) or lay_out(*weights))
    latents, _, text, text_lens = step_inputs("cpu", dtype)

    @torch.inference_mode()
    def step(sigma: float) -> tuple[torch.Tensor, int]:
        """The model's step at `sigma` and how many blocks' weights it laid out."""
        before = len(laid_out)
        timestep = torch.full((latents.shape[0],), sigma * 1000).to(dtype)
        out = model(latents, timestep, text, text_lens)
        made = len(laid_out) - before
        assert torch.equal(out, model.with_arithmetic(fast_on_cpu)(latents, timestep, text, text_lens))
        return out, made

    first, made = step(0.73)
    assert made == DIT_CONFIG.num_layers
    assert [step(sigma)[1] for sigma in (0.73, 0.5, 0.12)] == [0, 0, 0]
    with torch.no_grad():
        model.layers[1].self_attention.norm_k.weight.mul_(1.5)  # an in-place edit, no bump (load_state_dict's copy)
    edited, made = step(0.73)
    assert made == 1 and not torch.equal(edited, first)
    assert step(0.73)[1] == 0
    norm = model.layers[2].self_attention.norm_q  # the same values at another address (a streamed block's slot)
    norm.weight = torch.nn.Parameter(norm.weight.detach().clone())
    moved, made = step(0.73)
    assert made == 1 and torch.equal(moved, edited)
    norm = model.layers[0].self_attention.norm_q  # other values, a new Parameter (load_state_dict(assign=True))
    norm.weight = torch.nn.Parameter(norm.weight.detach() * 0.5)
    replaced, made = step(0.73)
    assert made == 1 and not torch.equal(replaced, moved)
    model.structure_version += 1  # what fusing or LoRA does to other tensors: these weights are the same
    assert step(0.73)[1] == 0
    model.to(torch.float16).to(dtype)  # every tensor a new one, through float16's rounding; edit counters kept
    rounded, made = step(0.73)
    assert made == DIT_CONFIG.num_layers and (dtype == torch.bfloat16 or not torch.equal(rounded, replaced))


def test_a_norm_weight_replaced_at_the_address_and_edit_count_of_the_old_one_is_laid_out_again(monkeypatch):
    """An allocator hands freed memory out again, and a Parameter keeps its edit counter when `.to()` gives it a new
    tensor: a new tensor at the old one's address with the old count (made here on purpose, from one buffer) is
    still a new tensor, laid out again with the bits of a model that kept nothing."""
    fast_on_cpu = Arithmetic(fast_devices=("cpu",), kitchen_rope=False, kitchen_adaln=False)
    model = random_dit("cpu", torch.float32).with_arithmetic(fast_on_cpu)
    latents, timestep, text, text_lens = step_inputs("cpu", torch.float32)
    weight = model.layers[1].self_attention.norm_k.weight
    memory = weight.detach().numpy().copy()
    weight.data = torch.from_numpy(memory)
    with torch.inference_mode():
        first = model(latents, timestep, text, text_lens)
    version, address = weight._version, weight.data_ptr()
    weight.data = torch.zeros_like(weight)  # the first tensor freed (its memory stays: `memory` holds it)
    memory *= 1.5  # another tensor's values in that memory, then that tensor given to the Parameter
    weight.data = torch.from_numpy(memory)
    assert (weight._version, weight.data_ptr()) == (version, address)
    with torch.inference_mode():
        again = model(latents, timestep, text, text_lens)
        fresh = model.with_arithmetic(fast_on_cpu)(latents, timestep, text, text_lens)
    assert torch.equal(again, fresh) and not torch.equal(again, first)


@torch.inference_mode()
def test_the_fast_forms_run_wherever_they_are_asked_for_within_their_bound():
    """The fast forms on the CPU (asked for by `fast_devices`): the whole forward, within the documented 2e-3."""
    model = random_dit("cpu", torch.bfloat16)
    args = step_inputs("cpu", torch.bfloat16)
    fast = model.with_arithmetic(Arithmetic(fast_devices=("cpu",), kitchen_rope=False, kitchen_adaln=False))(*args)
    exact = model.with_arithmetic("exact")(*args)
    assert not torch.equal(fast, exact)  # the fast forms did run
    assert ((fast.float() - exact.float()).norm() / exact.float().norm()).item() <= 2e-3


REPLACING_EVERY_TENSOR = {
    "to another dtype": lambda model: model.to(torch.float16),
    "to the same dtype and device through _apply": lambda model: model.float(),
    "to_empty": lambda model: model.to_empty(device="cpu"),
    "load_state_dict(assign=True)": lambda model: model.load_state_dict(
        {key: value.clone() for key, value in model.state_dict().items()}, assign=True),
}


@pytest.mark.parametrize("replace", REPLACING_EVERY_TENSOR.values(), ids=REPLACING_EVERY_TENSOR.keys())
def test_the_laid_out_qk_norm_weights_are_dropped_when_every_tensor_is_replaced(replace):
    """Moving or replacing the whole model drops what was laid out from its old weights (kept, they would hold
    memory on the old device until the next step), in the dict a StepContext shares; an in-place load keeps them."""
    fast_on_cpu = Arithmetic(fast_devices=("cpu",), kitchen_rope=False, kitchen_adaln=False)
    model = random_dit("cpu", torch.float32).with_arithmetic(fast_on_cpu)
    latents, _, text, text_lens = step_inputs("cpu", torch.float32)
    cache = model._qk_norm_weights
    with torch.inference_mode():
        model(latents, torch.full((latents.shape[0],), 730.0), text, text_lens)
    assert len(cache) == DIT_CONFIG.num_layers
    model.load_state_dict(model.state_dict())  # copied into the same tensors: the stamps tell what changed
    assert len(cache) == DIT_CONFIG.num_layers
    replace(model)
    assert model._qk_norm_weights is cache and cache == {}
