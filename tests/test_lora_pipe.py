"""LoRAs as branches (lora_mode "branch"; merged ones: test_lora_merge.py) on every placement and weight format of
the DiT, switched without reloading it (fp32 CPU, tiny models):
removing them gives the base image bit for bit, switching never reads the base weights again, streamed blocks
and packed (Q8_0) weights keep their form, the fused q/k/v and gate/up projections get the right slices, and the
planner counts the branches."""
from __future__ import annotations

import pytest
import torch

import lora_files as lf
from ernie_image.runtime.core.host import NullHost
from ernie_image.runtime.core.request import GenerationRequest
from ernie_image.runtime.demo.tiny import TinySizes, build_tiny_model
from ernie_image.runtime.formats.sources import ModelSources
from ernie_image.runtime.local import parts as local_parts_module
from ernie_image.runtime.local.options import LoadOptions
from ernie_image.runtime.local.pipe import LocalPipe
from ernie_image.runtime.lora import parsed as parsed_module
from ernie_image.runtime.lora.attach import LoraLinear, apply_stack, wrapped_layers
from ernie_image.runtime.lora.keys import dit_linear_shapes
from ernie_image.runtime.lora.parsed import load_lora
from ernie_image.runtime.model.compile import fuse_projections
from ernie_image.runtime.quant.linear import QuantLinear

REQUEST = GenerationRequest(prompt="a red fox", width=256, height=256, steps=2, cfg=1.0, seed=7)

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny models: threads only add overhead


@pytest.fixture(scope="module")
def model(tiny_turbo_folder):
    return ModelSources(model_dir=tiny_turbo_folder)


@pytest.fixture(scope="module")
def loras(tiny_turbo_folder, tmp_path_factory):
    return lf.tiny_model_loras(tiny_turbo_folder, tmp_path_factory.mktemp("loras"))


@pytest.fixture(scope="module")
def pipe(model):
    return LocalPipe.load(model, LoadOptions(device="cpu", dtype="fp32", lora_mode="branch"))


@pytest.fixture(scope="module")
def base_image(pipe):
    return pipe.generate(REQUEST, NullHost()).images


def test_removing_every_lora_gives_the_base_image_bit_for_bit(pipe, loras, base_image):
    with_lora = pipe.with_loras([(loras["kohya"], 1.0), (loras["lokr"], 0.5)]).generate(REQUEST, NullHost()).images
    assert not torch.equal(with_lora, base_image)
    dit = pipe.parts.dit
    assert wrapped_layers(dit)
    again = pipe.generate(REQUEST, NullHost()).images
    assert torch.equal(again, base_image)
    assert not wrapped_layers(dit) and isinstance(dit.layers[0].self_attention.to_q, torch.nn.Linear)
    assert not any("lora" in name or "kron" in name for name, _ in dit.named_buffers())


def test_switching_loras_and_strengths_never_reads_the_base_weights_again(pipe, loras, base_image, monkeypatch):
    pipe.generate(REQUEST, NullHost())
    dit = pipe.parts.dit
    builds = []
    real_build = local_parts_module.build_dit
    monkeypatch.setattr(local_parts_module, "build_dit", lambda *a, **k: builds.append(1) or real_build(*a, **k))
    first = pipe.with_loras([(loras["kohya"], 1.0)])
    images = {}
    for label, view in [("kohya 1.0", first), ("kohya 0.3", pipe.with_loras([(loras["kohya"], 0.3)])),
                        ("toolkit", pipe.with_loras([(loras["toolkit"], 1.0)])), ("kohya 1.0 again", first),
                        ("base", pipe)]:
        images[label] = view.generate(REQUEST, NullHost()).images
    assert builds == [] and pipe.parts.dit is dit
    assert torch.equal(images["kohya 1.0"], images["kohya 1.0 again"])
    assert not torch.equal(images["kohya 1.0"], images["kohya 0.3"])
    assert torch.equal(images["base"], base_image)
    reads = parsed_module.reads
    pipe.with_loras([(loras["toolkit"], 0.5)]).generate(REQUEST, NullHost())
    assert parsed_module.reads == reads  # the parsed file is cached by path, size and mtime


def test_a_same_shape_switch_refills_the_branch_buffers_in_place(pipe, loras):
    pipe.with_loras([(loras["kohya"], 1.0)]).generate(REQUEST, NullHost())
    wrapper = pipe.parts.dit.layers[0].mlp.linear_fc2
    down, up = wrapper.lora_down, wrapper.lora_up
    pipe.with_loras([(loras["toolkit"], -0.5)]).generate(REQUEST, NullHost())
    assert pipe.parts.dit.layers[0].mlp.linear_fc2 is wrapper
    assert wrapper.lora_down is down and wrapper.lora_up is up  # a compiled block keeps its graph inputs


def test_a_lora_on_some_blocks_only_leaves_the_others_plain_in_an_uncompiled_dit(pipe, tiny_turbo_folder, tmp_path):
    weights = lf.dit_weights(tiny_turbo_folder)
    only_block_0 = {k: v for k, v in lf.linear_shapes(weights, ("mlp.linear_fc2",)).items() if k.startswith("layers.0.")}
    path = lf.write_ai_toolkit(tmp_path / "block0.safetensors", lf.random_lora(only_block_0, 3, seed=11))
    pipe.with_loras([(path, 1.0)]).generate(REQUEST, NullHost())
    blocks = pipe.parts.dit.layers
    assert isinstance(blocks[0].mlp.linear_fc2, LoraLinear)
    assert all(type(block.mlp.linear_fc2) is torch.nn.Linear for block in blocks[1:])  # no zero branch to run


# Per stack: {block: rank} of a LoRA on those blocks' layers of one kind (q/k/v fused: one physical layer).
SKIPPING_STACKS = {
    "one block's MLP output": ("mlp.linear_fc2", {0: 3}),
    "two blocks at one rank": ("mlp.linear_fc2", {0: 4, 2: 4}),
    "two blocks at two ranks": ("mlp.linear_fc2", {0: 2, 2: 5}),
    "fused q/k/v of the middle block": ("self_attention.to_q", {1: 3}),
}


def skipping_lora(tmp_path, module: str, ranks: dict[int, int]) -> list:
    from reference_models import DIT_CONFIG

    files = []
    for block, rank in ranks.items():
        shapes = {name: shape for name, shape in dit_linear_shapes(DIT_CONFIG).items()
                  if name.startswith(f"layers.{block}.") and name.endswith(module)}
        path = lf.write_ai_toolkit(tmp_path / f"block{block}.safetensors", lf.random_lora(shapes, rank, seed=block))
        files.append((load_lora(path, DIT_CONFIG), 1.0))
    return files


@pytest.mark.parametrize("stack", list(SKIPPING_STACKS), ids=list(SKIPPING_STACKS))
def test_uncompiled_blocks_carry_only_their_own_branches_and_compute_what_padded_ones_do(stack, tmp_path):
    """Compiled blocks share one branch shape (zero branches where a LoRA skips a block, ranks padded to the
    largest); uncompiled ones get neither, and compute the same: bit for bit where the ranks are the same."""
    from reference_models import random_dit

    module, ranks = SKIPPING_STACKS[stack]
    loras = skipping_lora(tmp_path, module, ranks)
    plain, compiled = random_dit("cpu", torch.float32), random_dit("cpu", torch.float32)
    for dit in (plain, compiled):
        fuse_projections(dit)
    for block in compiled.layers:
        block.compile(backend="eager")  # compiled blocks, run by the same eager kernels
    apply_stack(plain, loras)
    apply_stack(compiled, loras)
    kind = "self_attention.to_qkv" if module.endswith("to_q") else module
    assert sorted(wrapped_layers(plain)) == [f"layers.{block}.{kind}" for block in sorted(ranks)]
    assert all(plain.get_submodule(f"layers.{block}.{kind}").lora_up.shape[-1] == rank for block, rank in ranks.items())
    assert sorted(wrapped_layers(compiled)) == [f"layers.{block}.{kind}" for block in range(len(compiled.layers))]
    assert len({tuple(compiled.get_submodule(name).lora_up.shape) for name in wrapped_layers(compiled)}) == 1
    generator = torch.Generator().manual_seed(0)
    latents, text = torch.randn((1, 128, 4, 4), generator=generator), torch.randn((1, 5, 96), generator=generator)
    with torch.inference_mode():
        own, padded = (dit(latents, torch.tensor([500.0]), text, [5]) for dit in (plain, compiled))
    if len(set(ranks.values())) == 1:
        assert torch.equal(own, padded)
    else:  # the padded rank sums zeros in other places: rounding apart
        assert (own - padded).abs().max().item() <= 1e-5 * padded.abs().max().item()


def test_blocks_compiled_after_a_lora_was_put_on_take_it_again_in_one_structure(model, tiny_turbo_folder, tmp_path,
                                                                                  monkeypatch):
    """compile='auto' compiles a loaded DiT between jobs: its LoRA is put on again, padded for the compiled blocks.
    CPU: the compiler is made "available" and compiles with dynamo's eager backend (the same kernels)."""
    from ernie_image.runtime.local import compile_policy

    monkeypatch.setattr(local_parts_module, "compile_available", lambda device: True)
    monkeypatch.setattr(local_parts_module, "compile_blocks",
                        lambda dit: [block.compile(backend="eager") for block in dit.layers] and True)
    monkeypatch.setattr(local_parts_module, "caches_hold", lambda weight_format, device: True)
    monkeypatch.setitem(compile_policy.COMPILE_SECONDS, "bf16", 1e9)  # never pays: stays uncompiled
    pipe = LocalPipe.load(model, LoadOptions(device="cpu", dtype="fp32", lora_mode="branch"))
    weights = lf.dit_weights(tiny_turbo_folder)
    only_block_0 = {k: v for k, v in lf.linear_shapes(weights, ("mlp.linear_fc2",)).items() if k.startswith("layers.0.")}
    view = pipe.with_loras([(lf.write_ai_toolkit(tmp_path / "block0.safetensors", lf.random_lora(only_block_0, 3, 11)),
                             1.0)])
    uncompiled = view.generate(REQUEST, NullHost()).images
    assert list(wrapped_layers(pipe.parts.dit)) == ["layers.0.mlp.linear_fc2"]
    monkeypatch.setitem(compile_policy.COMPILE_SECONDS, "bf16", 0.0)  # pays from the next job on
    compiled = view.generate(REQUEST, NullHost()).images
    blocks = pipe.parts.dit.layers
    assert all(isinstance(block.mlp.linear_fc2, LoraLinear) for block in blocks)
    assert len({tuple(block.mlp.linear_fc2.lora_up.shape) for block in blocks}) == 1
    assert torch.equal(compiled, uncompiled)  # zero branches of the same rank add exact zeros


def test_fused_qkv_and_gate_up_receive_their_own_slices(model, loras):
    config_pipe = LocalPipe.load(model, LoadOptions(device="cpu", dtype="fp32", lora_mode="branch"))
    plain = config_pipe.parts.load_dit()
    fused = LocalPipe.load(model, LoadOptions(device="cpu", dtype="fp32", lora_mode="branch")).parts.load_dit()
    assert fuse_projections(fused) == 2 * len(fused.layers)
    config = plain.config
    stack = [(load_lora(loras["attention"], config), 0.7), (load_lora(loras["kohya"], config), 1.1)]
    for dit in (plain, fused):
        apply_stack(dit, stack)
    assert isinstance(fused.layers[0].self_attention.to_qkv, LoraLinear)
    assert fused.layers[0].self_attention.to_qkv.slices == 3 and fused.layers[0].mlp.gate_up.slices == 2
    generator = torch.Generator().manual_seed(0)
    latents = torch.randn((1, 128, 4, 4), generator=generator)
    text = torch.randn((1, 5, config.text_in_dim), generator=generator)
    timestep = torch.tensor([500.0])
    with torch.inference_mode():
        expected, got = plain(latents, timestep, text, [5]), fused(latents, timestep, text, [5])
        apply_stack(plain, [])
        base = plain(latents, timestep, text, [5])
    assert (got - expected).abs().max().item() < 1e-5
    assert (expected - base).abs().max().item() > 1e-2


def test_streamed_blocks_with_a_lora_give_the_resident_image(tmp_path_factory, loras):
    from test_offload_pipe import SIZES, streaming_budget_gb

    model = build_tiny_model(tmp_path_factory.mktemp("tiny6"), variant="turbo", sizes=SIZES)
    weights = lf.dit_weights(model.model_dir)
    path = lf.write_down_up(tmp_path_factory.mktemp("l6") / "six.safetensors",
                            lf.random_lora(lf.linear_shapes(weights), 4, seed=5), 4.0, lf.kohya_name)
    resident = LocalPipe.load(model, LoadOptions(device="cpu", lora_mode="branch"), loras=[(path, 0.8)]).generate(REQUEST, NullHost())
    config = LocalPipe.load(model, LoadOptions(device="cpu", lora_mode="branch"))._lora.dit_config(model)
    lora_gb = load_lora(path, config).branch_params() * 4 / 1024**3
    # A budget that streams some blocks with room for the branches too: adding the LoRA keeps the placement.
    budget = streaming_budget_gb(model) + lora_gb
    streamed_pipe = LocalPipe.load(model, LoadOptions(device="cpu", vram_budget_gb=budget, lora_mode="branch"))
    base = streamed_pipe.generate(REQUEST, NullHost())
    placement = streamed_pipe.memory.dit
    host_bytes = placement.streamer.host_bytes
    streamed = streamed_pipe.with_loras([(path, 0.8)]).generate(REQUEST, NullHost())
    assert streamed_pipe.memory.dit is placement and placement.streamer.host_bytes == host_bytes
    assert placement.plan.streamed and torch.equal(streamed.images, resident.images)
    assert not torch.equal(streamed.images, base.images)
    assert streamed_pipe.memory.lora_bytes > 0
    assert torch.equal(streamed_pipe.generate(REQUEST, NullHost()).images, base.images)


def test_the_planner_counts_the_lora_branches_in_the_dit_stem(model, loras):
    budgeted = LocalPipe.load(model, LoadOptions(device="cpu", vram_budget_gb=4.0, lora_mode="branch"))
    budgeted.generate(REQUEST, NullHost())
    stem = budgeted.memory.plan.dit.stem_bytes
    budgeted.with_loras([(loras["kohya"], 1.0)]).generate(REQUEST, NullHost())
    lora_bytes = load_lora(loras["kohya"], budgeted.parts.dit.config).branch_params() * 4
    assert budgeted.memory.lora_bytes == lora_bytes
    assert budgeted.memory.plan.dit.stem_bytes == stem + lora_bytes
    branches = sum(b.numel() * b.element_size() for n, b in budgeted.parts.dit.named_buffers() if "lora_" in n)
    assert branches == lora_bytes


# Each format's own image tolerance against the unquantised weights (test_quant_pipe.py).
PACKED = {"q8_0": (torch.uint8, 0.01), "fp8": (torch.float8_e4m3fn, 0.02), "nvfp4": (torch.uint8, 0.05)}


@pytest.mark.parametrize("fmt", list(PACKED))
def test_a_packed_dit_keeps_its_weights_packed_and_takes_the_lora_as_a_branch(model, loras, pipe, fmt):
    reference = pipe.with_loras([(loras["toolkit"], 1.0)]).generate(REQUEST, NullHost()).images
    quantised = LocalPipe.load(model, LoadOptions(device="cpu", dtype="fp32", quant=fmt, lora_mode="branch"))
    base = quantised.generate(REQUEST, NullHost()).images
    images = quantised.with_loras([(loras["toolkit"], 1.0)]).generate(REQUEST, NullHost()).images
    wrapper = quantised.parts.dit.layers[0].mlp.gate_proj
    packed_dtype, tolerance = PACKED[fmt]
    assert isinstance(wrapper, LoraLinear) and isinstance(wrapper.base, QuantLinear)
    assert wrapper.base.weight.dtype == packed_dtype  # still packed
    assert (images - reference).abs().max().item() <= tolerance  # the format's error, no more
    assert (images - base).abs().max().item() > 0.05
    assert torch.equal(quantised.generate(REQUEST, NullHost()).images, base)


def test_a_lora_given_to_load_is_the_pipes_own_and_is_recorded(model, loras):
    pipe = LocalPipe.load(model, LoadOptions(device="cpu", dtype="fp32", lora_mode="branch"), loras=[loras["kohya"]])
    result = pipe.generate(REQUEST, NullHost())
    assert result.info["loras"] == [{"name": "kohya.safetensors", "strength": 1.0,
                                     "style": "kohya (lora_unet_) LoRA", "mode": "branch"}]
    assert "LoRA: kohya.safetensors (1)" in pipe.describe()
    view = pipe.with_loras([(loras["toolkit"], 0.5)]).describe()
    assert view.count("LoRA: ") == 1 and "LoRA: kohya.safetensors (1), toolkit.safetensors (0.5)" in view


def test_a_bf16_branch_is_as_close_to_the_exact_merge_as_a_bf16_merge(tmp_path):
    """The error the branch adds, stated against merging: both in bf16, both against the fp32 merge (measured:
    branch 0.54%, bf16 merge 0.51% relative, for a LoRA that moves the output by 12.5%)."""
    import copy

    from ernie_image.runtime.lora.keys import dit_linear_shapes
    from ernie_image.runtime.model.dit import DiTConfig
    from small_dits import scaled_random_dit, step_inputs

    config = DiTConfig(hidden_size=256, num_attention_heads=2, num_layers=4, ffn_hidden_size=768, text_in_dim=192,
                       rope_axes_dim=(32, 48, 48))
    dit = scaled_random_dit(config)
    lora = lf.random_lora(dit_linear_shapes(config), 16, seed=1)
    path = lf.write_ai_toolkit(tmp_path / "r16.safetensors", lora)
    merged = copy.deepcopy(dit)
    state = merged.state_dict()
    for module, (down, up) in lora.items():
        state[f"{module}.weight"] += up @ down
    merged.load_state_dict(state)
    args = step_inputs(config)
    bf16_args = (args[0].bfloat16(), args[1].bfloat16(), args[2].bfloat16(), args[3])
    branched = copy.deepcopy(dit).to(torch.bfloat16)
    apply_stack(branched, [(load_lora(path, config), 1.0)])
    with torch.inference_mode():
        exact = merged(*args)
        relative = lambda out: ((out.float() - exact).norm() / exact.norm()).item()  # noqa: E731
        merge_error = relative(copy.deepcopy(merged).to(torch.bfloat16)(*bf16_args))
        branch_error = relative(branched(*bf16_args))
        effect = relative(dit(*args))
    assert effect > 0.05 and merge_error < 0.02
    assert branch_error <= 1.5 * merge_error


def test_with_loras_refuses_a_lora_for_a_dit_of_another_size_when_it_is_added(model, tmp_path):
    from safetensors.torch import save_file

    from ernie_image.runtime.core.errors import ModelFileError

    path = tmp_path / "wider.safetensors"
    save_file({"diffusion_model.layers.0.mlp.linear_fc2.lora_A.weight": torch.zeros(2, 100),
               "diffusion_model.layers.0.mlp.linear_fc2.lora_B.weight": torch.zeros(64, 2)}, str(path))
    unloaded = LocalPipe.load(model, LoadOptions(device="cpu", dtype="fp32"))
    with pytest.raises(ModelFileError, match=r"^LoRA wider.safetensors: layers.0.mlp.linear_fc2 adapts a \[64, 100\] "
                                             r"weight but ERNIE-Image's is \[64, 128\]: the LoRA is for a model of "
                                             r"another size$"):
        unloaded.with_loras([(path, 1.0)])
    assert not unloaded.is_loaded()  # found from the DiT file's header, before any weights are read


def test_a_pipe_and_its_lora_view_generating_at_once_each_get_their_own_image(pipe, loras, base_image):
    import threading

    view = pipe.with_loras([(loras["kohya"], 1.0)])
    want_view = view.generate(REQUEST, NullHost()).images
    results: dict[str, torch.Tensor] = {}

    def run(name, runner):
        results[name] = runner.generate(REQUEST, NullHost()).images

    threads = [threading.Thread(target=run, args=(name, runner)) for name, runner in (("base", pipe), ("view", view))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    assert torch.equal(results["base"], base_image) and torch.equal(results["view"], want_view)
