"""Merged LoRAs (lora_mode "merge", the default) on tiny models on the CPU, fp32 and bf16: the merged image equals
the branch image within rounding, removing every LoRA (also after A -> B -> none) gives the base model bit for bit,
weights are edited in place (same tensors, same addresses), a switch re-merges only the layers whose LoRAs changed
and never reads the base weights again, fused q/k/v and gate/up take their slices, FP8 weights are requantised
with their own scale layout, streamed blocks, GGUF and NVFP4 layers keep the branch with one notice, and the host
copy of the original weights is counted."""
from __future__ import annotations

import copy

import pytest
import torch

import lora_files as lf
from conftest import LoggingHost
from ernie_image.runtime.core.errors import InvalidInputError
from ernie_image.runtime.core.host import NullHost
from ernie_image.runtime.demo.tiny import build_tiny_model
from ernie_image.runtime.local import loras as pipe_loras_module, parts as local_parts_module
from ernie_image.runtime.local.options import LoadOptions
from ernie_image.runtime.local.pipe import LocalPipe
from ernie_image.runtime.lora.apply import apply_loras
from ernie_image.runtime.lora.attach import LoraLinear, wrapped_layers
from ernie_image.runtime.lora.keys import dit_linear_shapes
from ernie_image.runtime.lora.merge import merge_state
from ernie_image.runtime.lora.parsed import load_lora
from ernie_image.runtime.model.compile import fuse_projections
from ernie_image.runtime.model.dit import DiTConfig, ErnieDiT
from ernie_image.runtime.quant.fp8 import dequantize_fp8, quantize_fp8
from ernie_image.runtime.quant.linear import QuantLinear
from ernie_image.runtime.quant.qweight import QuantizedWeight
from small_dits import scaled_random_dit, step_inputs
from test_lora_pipe import REQUEST, loras, model  # noqa: F401  (the same request, tiny model and LoRA files)

# fp32: merged and branch images differ only by fp32 summation order: bound 3e-5 of the 0..1 image (measured 6e-6;
# 1/255 is 3.9e-3).
FP32_IMAGE_BOUND = 3e-5

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny models: threads only add overhead


def load(model, **options) -> LocalPipe:
    return LocalPipe.load(model, LoadOptions(device="cpu", **{"dtype": "fp32", **options}))


@pytest.fixture(scope="module")
def merged_pipe(model):
    return load(model)


@pytest.fixture(scope="module")
def branch_pipe(model):
    return load(model, lora_mode="branch")


@pytest.fixture(scope="module")
def base_image(merged_pipe):
    return merged_pipe.generate(REQUEST, NullHost()).images


def images(pipe, stack) -> torch.Tensor:
    return pipe.with_loras(stack).generate(REQUEST, NullHost()).images


def dit_tensors(dit) -> dict[str, torch.Tensor]:
    return {name: tensor.detach().clone() for name, tensor in dit.state_dict(keep_vars=True).items()}


def test_merge_is_the_default_mode_and_leaves_no_branch(merged_pipe, loras):
    result = merged_pipe.with_loras([(loras["kohya"], 1.0)]).generate(REQUEST, NullHost())
    assert result.info["loras"][0]["mode"] == "merge"
    dit = merged_pipe.parts.dit
    assert not wrapped_layers(dit) and not any("lora" in name for name, _ in dit.named_buffers())
    assert merge_state(dit).merged  # the weights carry it


@pytest.mark.parametrize("names", [("kohya",), ("toolkit", "attention"), ("lokr",), ("loha",), ("kohya", "lokr")],
                         ids="+".join)
def test_fp32_merged_image_equals_the_branch_image_within_rounding(merged_pipe, branch_pipe, loras, base_image,
                                                                   names):
    stack = [(loras[name], strength) for name, strength in zip(names, (0.8, -1.3))]
    merged, branch = images(merged_pipe, stack), images(branch_pipe, stack)
    assert (merged - branch).abs().max().item() <= FP32_IMAGE_BOUND
    assert (merged - base_image).abs().max().item() > 0.05  # the LoRA really changes the image


def test_merged_weights_equal_the_hand_merge_of_the_stack(merged_pipe, loras, tiny_turbo_folder):
    """W + sum strength * delta in fp32, delta from each format's definition (lora_files), for a stack of three."""
    weights = lf.dit_weights(tiny_turbo_folder)
    shapes = lf.linear_shapes(weights)
    kohya, toolkit = lf.random_lora(shapes, 4, seed=1), lf.random_lora(shapes, 4, seed=2)
    lokr = lf.random_lokr(shapes, 2, seed=4)
    merged_pipe.with_loras([(loras["kohya"], 0.5), (loras["toolkit"], -1.0), (loras["lokr"], 2.0)]).generate(
        REQUEST, NullHost())
    dit = merged_pipe.parts.dit
    for module in ("layers.0.self_attention.to_k", "layers.1.mlp.gate_proj", "final_linear", "adaLN_modulation.1"):
        expected = (weights[f"{module}.weight"].double() + 0.5 * lf.lora_delta(*kohya[module], alpha=2.0)
                    - lf.lora_delta(*toolkit[module], alpha=None) + 2.0 * lf.lokr_delta(lokr[module], alpha=1.0))
        got = dit.get_submodule(module).weight.double()
        assert (got - expected).abs().max().item() <= 1e-6 * expected.abs().max().item()


def test_removing_every_lora_after_a_to_b_gives_the_base_bit_for_bit_in_place(model, loras):
    pipe = load(model)
    base = pipe.generate(REQUEST, NullHost()).images
    dit = pipe.parts.dit
    host_before = pipe.host_bytes()["host"]  # on the CPU the weights themselves are host memory
    originals = dit_tensors(dit)
    addresses = {name: (id(t), t.data_ptr()) for name, t in dit.state_dict(keep_vars=True).items()}
    version = dit.structure_version
    with_a = images(pipe, [(loras["kohya"], 1.0), (loras["lokr"], 0.5)])
    with_b = images(pipe, [(loras["toolkit"], 0.7)])
    assert not torch.equal(with_a, base) and not torch.equal(with_b, with_a)
    assert torch.equal(pipe.generate(REQUEST, NullHost()).images, base)
    assert pipe.parts.dit is dit and dit.structure_version == version  # nothing wrapped, nothing to recapture
    after = dit.state_dict(keep_vars=True)
    assert {name: (id(t), t.data_ptr()) for name, t in after.items()} == addresses  # edited in place
    assert all(torch.equal(after[name], tensor) for name, tensor in originals.items())
    assert not merge_state(dit).backups and pipe.host_bytes()["host"] == host_before  # the copy went with the LoRA


def test_a_switch_remerges_only_changed_layers_and_never_reads_the_base_weights(model, loras, monkeypatch):
    pipe = load(model)
    pipe.with_loras([(loras["kohya"], 1.0)]).generate(REQUEST, NullHost())
    dit = pipe.parts.dit
    state = merge_state(dit)
    backups = dict(state.backups)
    fc2 = dit.layers[0].mlp.linear_fc2.weight.detach().clone()
    builds = []
    real_build = local_parts_module.build_dit
    monkeypatch.setattr(local_parts_module, "build_dit", lambda *a, **k: builds.append(1) or real_build(*a, **k))
    pipe.with_loras([(loras["kohya"], 1.0), (loras["attention"], 0.6)]).generate(REQUEST, NullHost())
    assert builds == [] and pipe.parts.dit is dit
    assert all(state.backups[p] is backup for p, backup in backups.items())  # made once, kept
    assert torch.equal(dit.layers[0].mlp.linear_fc2.weight, fc2)  # untouched by the attention-only LoRA
    reads = load_lora.__globals__["reads"]
    pipe.with_loras([(loras["kohya"], 0.3)]).generate(REQUEST, NullHost())
    assert load_lora.__globals__["reads"] == reads  # strength change: nothing read from disk


def test_the_diffusers_layout_merged_matches_diffusers_within_1_255(merged_pipe, tiny_turbo_folder, tmp_path):
    """The branch's fidelity test (test_lora_fidelity.py) in merge mode for the layout diffusers writes itself."""
    from diffusers import ErnieImagePipeline

    from ernie_image.runtime.sampling.euler import initial_noise

    shapes = lf.linear_shapes(lf.dit_weights(tiny_turbo_folder))
    path = lf.write_diffusers(tmp_path, lf.random_lora(shapes, 4, seed=8), 4, alpha=8)
    reference = ErnieImagePipeline.from_pretrained(str(tiny_turbo_folder), torch_dtype=torch.float32)
    reference.load_lora_weights(str(path.parent), weight_name=path.name, adapter_name="test")
    reference.set_adapters(["test"], adapter_weights=[0.9])
    theirs = reference(prompt=[REQUEST.prompt], width=256, height=256, num_inference_steps=REQUEST.steps,
                       guidance_scale=1.0, latents=initial_noise(REQUEST.seed, 1, 256, 256), output_type="pt",
                       use_pe=False).images.permute(0, 2, 3, 1).float()
    result = merged_pipe.with_loras([(path, 0.9)], mode="merge").generate(REQUEST, NullHost())
    assert result.info["loras"][0]["mode"] == "merge"
    assert (result.images - theirs).abs().max().item() <= 1 / 255


def small_dit() -> tuple[ErnieDiT, DiTConfig]:
    config = DiTConfig(hidden_size=256, num_attention_heads=2, num_layers=3, ffn_hidden_size=768, text_in_dim=192,
                       rope_axes_dim=(32, 48, 48))
    return scaled_random_dit(config), config


def test_fused_qkv_and_gate_up_merge_slice_by_slice(tmp_path):
    plain, config = small_dit()
    fused = copy.deepcopy(plain)
    assert fuse_projections(fused) == 2 * config.num_layers
    shapes = dit_linear_shapes(config)
    attention = {k: v for k, v in shapes.items() if k.rsplit(".", 1)[-1] in ("to_q", "to_v")}
    stack = [(load_lora(lf.write_ai_toolkit(tmp_path / "qv.safetensors", lf.random_lora(attention, 4, seed=1)),
                        config), 0.7, "merge"),
             (load_lora(lf.write_down_up(tmp_path / "all.safetensors", lf.random_lora(shapes, 8, seed=2), 4.0,
                                         lf.kohya_name), config), -1.1, "merge")]
    for dit in (plain, fused):
        applied = apply_loras(dit, stack)
        assert applied.branch_layers == 0 and not applied.fallback
    attention_block = fused.layers[1].self_attention
    expected = torch.cat([plain.layers[1].self_attention.get_submodule(n).weight for n in ("to_q", "to_k", "to_v")])
    assert (attention_block.to_qkv.weight - expected).abs().max().item() <= 1e-6
    expected = torch.cat([plain.layers[2].mlp.gate_proj.weight, plain.layers[2].mlp.up_proj.weight])
    assert (fused.layers[2].mlp.gate_up.weight - expected).abs().max().item() <= 1e-6
    with torch.inference_mode():
        assert (fused(*step_inputs(config)) - plain(*step_inputs(config))).abs().max().item() <= 1e-5


def test_a_bf16_merge_is_as_close_to_the_exact_merge_as_the_bf16_branch(tmp_path):
    """bf16 merge: each weight is W_bf16 + delta computed in fp32 and rounded once (within half a bf16 step, 2^-8
    of its value), the rounding the bf16 base weights already have; on the output, against the fp32 exact merge,
    merged and branch bf16 DiTs are equally close (measured: merge 0.53%, branch 0.54% relative L2, for a LoRA that
    moves the output by 13%)."""
    dit, config = small_dit()
    path = lf.write_ai_toolkit(tmp_path / "r16.safetensors", lf.random_lora(dit_linear_shapes(config), 16, seed=1))
    stack = [(load_lora(path, config), 1.0)]
    exact = copy.deepcopy(dit)
    apply_loras(exact, [(*stack[0], "merge")])
    merged, branched = copy.deepcopy(dit).to(torch.bfloat16), copy.deepcopy(dit).to(torch.bfloat16)
    apply_loras(merged, [(*stack[0], "merge")])
    apply_loras(branched, [(*stack[0], "branch")])
    delta = stack[0][0].adapters["layers.0.mlp.gate_proj"].delta()
    want = dit.layers[0].mlp.gate_proj.weight.to(torch.bfloat16).float() + delta
    weight = merged.layers[0].mlp.gate_proj.weight.float()
    assert ((weight - want).abs() <= want.abs() * (2 ** -8 + 1e-6)).all()
    with torch.inference_mode():
        reference = exact(*step_inputs(config))
        relative = lambda out: ((out.float() - reference).norm() / reference.norm()).item()  # noqa: E731
        merge_error, branch_error = relative(merged(*step_inputs(config, dtype=torch.bfloat16))), relative(
            branched(*step_inputs(config, dtype=torch.bfloat16)))
        effect = relative(dit(*step_inputs(config)))
    assert effect > 0.05 and merge_error < 0.02 and merge_error <= 1.5 * branch_error


def fp8_layer(weight: torch.Tensor, per_row: bool) -> QuantLinear:
    data, scale = quantize_fp8(weight, per_row=per_row)
    return QuantLinear(QuantizedWeight("fp8", "e4m3fn", data, tuple(weight.shape), scale=scale),
                       compute_dtype=torch.float32)


@pytest.mark.parametrize("per_row", [True, False], ids=["per-row scale", "per-tensor scale"])
def test_fp8_merge_requantises_with_the_layers_scale_layout_within_one_fp8_step(per_row):
    """FP8 merge error, stated against the exact (fp32) merge: each element within one e4m3 step of W_fp8 + delta
    (< 2^-3 of its value, or 2^-9 of the scale below e4m3's normals), unbiased (stochastic rounding): even a delta
    far below half a step survives in the mean; a bf16 merge would be within 2^-8 of the value."""
    torch.manual_seed(0)
    weight = torch.randn(256, 512) * 0.05
    layer = fp8_layer(weight, per_row)
    original = {name: getattr(layer, name).clone() for name in ("weight", "weight_scale", "weight_scale_row")}
    pointers = {name: getattr(layer, name).data_ptr() for name in original}
    base = dequantize_fp8(layer.weight, layer.weight_scale, torch.float32)
    # A delta of ~3e-4 everywhere, ~1/10 of an FP8 step here: round-to-nearest would keep almost none of it.
    down, up = torch.rand(8, 512) / 512 ** 0.5, torch.full((256, 8), 1e-3)
    from ernie_image.runtime.lora.adapters import LowRank
    from ernie_image.runtime.lora.merge import Contribution, merge_layers

    class Holder(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.proj = layer

    holder = Holder()
    merge_layers(holder, {"proj": [Contribution(("x",), 0, 1, LowRank(down, up, 1.0), 1.0)]})
    exact = base + up @ down
    got = dequantize_fp8(layer.weight, layer.weight_scale, torch.float32)
    assert layer.weight.dtype == torch.float8_e4m3fn and layer.weight_scale.shape == original["weight_scale"].shape
    assert {name: getattr(layer, name).data_ptr() for name in original} == pointers  # in place
    scale = layer.weight_scale.reshape(-1, 1) if per_row else layer.weight_scale
    step = torch.where(exact.abs() / scale >= 2 ** -6, 2.0 ** (torch.floor(torch.log2(exact.abs() / scale)) - 3),
                       torch.full_like(exact, 2.0 ** -9)) * scale
    assert ((got - exact).abs() <= step * (1 + 1e-6)).all()
    assert ((got - base).mean() - (up @ down).mean()).abs().item() < 0.1 * (up @ down).mean().item()
    assert torch.allclose(layer.weight_scale_row.reshape(-1), layer.weight_scale.reshape(-1).expand(256))
    merge_layers(holder, {})
    assert all(torch.equal(getattr(layer, name), tensor) for name, tensor in original.items())


def test_an_fp8_dit_merges_and_stays_fp8_with_its_error_stated(model, loras, merged_pipe):
    """Measured on the tiny model's image against the fp32 merge: FP8 merge 0.014 max, FP8 branch 0.006 (the merge
    rounds each weight twice: the base's half FP8 step, then up to one step of stochastic requantisation; both
    within the 0.02 test_quant_pipe.py allows the FP8 format); removing it gives the FP8 base bit for bit."""
    reference = images(merged_pipe, [(loras["toolkit"], 1.0)])
    fp8 = load(model, quant="fp8")
    base = fp8.generate(REQUEST, NullHost()).images
    gate = fp8.parts.dit.layers[0].mlp.gate_proj
    pointer = gate.weight.data_ptr()
    merged = images(fp8, [(loras["toolkit"], 1.0)])
    assert isinstance(gate, QuantLinear) and fp8.parts.dit.layers[0].mlp.gate_proj is gate
    assert gate.weight.dtype == torch.float8_e4m3fn and gate.weight.data_ptr() == pointer
    assert not wrapped_layers(fp8.parts.dit)
    branched = images(load(model, quant="fp8", lora_mode="branch"), [(loras["toolkit"], 1.0)])
    assert (merged - reference).abs().max().item() <= 0.02
    assert (branched - reference).abs().max().item() <= 0.02
    assert (merged - base).abs().max().item() > 0.05
    assert torch.equal(fp8.generate(REQUEST, NullHost()).images, base)


@pytest.mark.parametrize("fmt, reason", [("q8_0", "GGUF blocks"), ("nvfp4", "NVFP4")])
def test_gguf_and_nvfp4_layers_keep_the_branch_with_one_notice(model, loras, fmt, reason):
    pipe = load(model, quant=fmt)
    host = LoggingHost()
    result = pipe.with_loras([(loras["toolkit"], 1.0)]).generate(REQUEST, host)
    assert result.info["loras"][0]["mode"] in ("branch", "merge and branch")  # what ran, not what was asked
    dit = pipe.parts.dit
    wrapper = dit.layers[0].mlp.gate_proj
    assert isinstance(wrapper, LoraLinear) and isinstance(wrapper.base, QuantLinear)
    notices = [m for m in host.messages if m.startswith("LoRA merge:")]
    assert len(notices) == 1 and reason in notices[0] and "branch" in notices[0]
    assert "\n" not in notices[0]
    pipe.generate(REQUEST, host)
    assert len([m for m in host.messages if m.startswith("LoRA merge:")]) == 1  # removing it says nothing more


def test_streamed_blocks_keep_the_branch_and_resident_ones_merge(tmp_path_factory):
    from test_offload_pipe import SIZES, streaming_budget_gb

    model = build_tiny_model(tmp_path_factory.mktemp("tiny6-merge"), variant="turbo", sizes=SIZES)
    path = lf.write_down_up(tmp_path_factory.mktemp("l6m") / "six.safetensors",
                            lf.random_lora(lf.linear_shapes(lf.dit_weights(model.model_dir)), 4, seed=5), 4.0,
                            lf.kohya_name)
    resident = LocalPipe.load(model, LoadOptions(device="cpu"), loras=[(path, 0.8)]).generate(REQUEST, NullHost())
    config = LocalPipe.load(model, LoadOptions(device="cpu"))._lora.dit_config(model)
    budget = streaming_budget_gb(model) + load_lora(path, config).branch_params() * 4 / 1024**3
    pipe = LocalPipe.load(model, LoadOptions(device="cpu", vram_budget_gb=budget))
    base = pipe.generate(REQUEST, NullHost())
    placement = pipe.memory.dit
    slab = placement.streamer.host_bytes
    host = LoggingHost()
    streamed = pipe.with_loras([(path, 0.8)]).generate(REQUEST, host)
    dit = pipe.parts.dit
    assert pipe.memory.dit is placement and placement.streamer.host_bytes == slab
    for index, block in enumerate(dit.layers):
        wrapped = isinstance(block.mlp.linear_fc2, LoraLinear)
        assert wrapped == (index in placement.plan.streamed)
    assert placement.plan.streamed and (streamed.images - resident.images).abs().max().item() <= FP32_IMAGE_BOUND
    notices = [m for m in host.messages if m.startswith("LoRA merge:")]
    assert len(notices) == 1 and "stream" in notices[0] and "merged into the weights" in notices[0]
    assert streamed.info["loras"][0]["mode"] == "merge and branch"
    assert torch.equal(pipe.generate(REQUEST, NullHost()).images, base.images)


def test_the_host_copy_is_counted_described_and_given_back(model, loras):
    pipe = load(model)
    pipe.generate(REQUEST, NullHost())
    before = pipe.host_bytes()["host"]
    host = LoggingHost()
    pipe.with_loras([(loras["attention"], 1.0)]).generate(REQUEST, host)
    dit = pipe.parts.dit
    touched = sum(block.self_attention.get_submodule(n).weight.nbytes for block in dit.layers
                  for n in ("to_q", "to_k", "to_v"))
    assert merge_state(dit).host_bytes == touched
    assert pipe.host_bytes()["host"] == before + touched
    assert sum(t.nbytes for t in pipe.host_tensors()) >= touched  # ComfyUI's cache weighs it
    assert f"{touched / 1e9:.2f} GB" in next(m for m in host.messages if m.startswith("LoRA merge:"))
    assert "LoRA merge: 6 layer(s) merged; host copy of their original weights" in pipe.describe()
    pipe.generate(REQUEST, NullHost())
    assert pipe.host_bytes()["host"] == before and "LoRA merge" not in pipe.describe()


def test_short_host_memory_runs_the_merge_as_a_branch_with_one_notice(model, loras, monkeypatch):
    monkeypatch.setattr(pipe_loras_module, "available_host_bytes", lambda: 1024**3)
    pipe = load(model)
    host = LoggingHost()
    result = pipe.with_loras([(loras["kohya"], 1.0)]).generate(REQUEST, host)
    pipe.with_loras([(loras["kohya"], 1.0)]).generate(REQUEST, host)
    notices = [m for m in host.messages if "host RAM" in m]
    assert len(notices) == 1 and "runs as a branch instead" in notices[0]
    assert result.info["loras"][0]["mode"] == "branch" and wrapped_layers(pipe.parts.dit)


def test_a_mode_that_is_not_known_is_refused_in_one_line(merged_pipe, loras):
    with pytest.raises(InvalidInputError, match="LoRA mode 'fast' is not known: use merge"):
        LoadOptions(lora_mode="fast").validate()
    with pytest.raises(InvalidInputError, match="LoRA mode 'fused' is not known"):
        merged_pipe.with_loras([(loras["kohya"], 1.0)], mode="fused")


def test_modes_mix_in_one_stack(merged_pipe, branch_pipe, loras):
    """A view's entries may name their own mode: kohya merged, toolkit as a branch, together equal to both as
    branches."""
    mixed = merged_pipe.with_loras([(loras["kohya"], 1.0, "merge"), (loras["toolkit"], 0.5, "branch")])
    result = mixed.generate(REQUEST, NullHost())
    assert [item["mode"] for item in result.info["loras"]] == ["merge", "branch"]
    assert wrapped_layers(merged_pipe.parts.dit) and merge_state(merged_pipe.parts.dit).merged
    reference = images(branch_pipe, [(loras["kohya"], 1.0), (loras["toolkit"], 0.5)])
    assert (result.images - reference).abs().max().item() <= FP32_IMAGE_BOUND


SMALL = DiTConfig(hidden_size=256, num_attention_heads=2, num_layers=2, ffn_hidden_size=512, text_in_dim=96,
                  rope_axes_dim=(32, 48, 48))


@pytest.mark.parametrize("fmt", ["bf16", "fp8"])
def test_a_dit_built_under_inference_mode_takes_a_merge_and_gives_its_base_back(tmp_path, fmt):
    """Code that builds, fuses or packs the DiT inside `torch.inference_mode()` (ComfyUI runs nodes in it) holds
    inference tensors, which may only be edited in place inside inference mode."""
    from ernie_image.runtime.quant.linear import quantize_linears
    from ernie_image.runtime.quant.writer import quantize_weight

    path = lf.write_ai_toolkit(tmp_path / "a.safetensors", lf.random_lora(dit_linear_shapes(SMALL), 4, seed=1))
    with torch.inference_mode():
        torch.manual_seed(0)
        dit = ErnieDiT(SMALL).to(torch.bfloat16).eval()
        for param in dit.parameters():
            param.normal_(0.0, 0.05)
        fuse_projections(dit)
        if fmt == "fp8":
            quantize_linears(dit, {key: quantize_weight(value, "fp8") for key, value in dit.state_dict().items()
                                   if key.startswith("layers.") and key.endswith(".weight") and value.dim() == 2})
        assert dit.layers[0].mlp.linear_fc2.weight.is_inference()
        generator = torch.Generator().manual_seed(1)
        args = (torch.randn(1, 128, 6, 6, generator=generator).bfloat16(), torch.full((1,), 600.0).bfloat16(),
                torch.randn(1, 8, 96, generator=generator).bfloat16(), [8])
        base = dit(*args).clone()
        before = {name: tensor.clone() for name, tensor in dit.state_dict().items()}
        applied = apply_loras(dit, [(load_lora(path, SMALL), 1.0, "merge")])
        assert applied.merged_layers and not applied.branch_layers
        assert not torch.equal(dit(*args), base)
        apply_loras(dit, [])
        assert all(torch.equal(tensor, before[name]) for name, tensor in dit.state_dict().items())
        assert torch.equal(dit(*args), base)
