"""Comfy-Org single files (what ComfyUI users have) load to the same model as Baidu's diffusers folder and give the
same image as diffusers' ErnieImagePipeline: max abs difference of the decoded image <= 1e-4 (fp32, CPU)."""
from __future__ import annotations


import pytest
import torch
from safetensors import safe_open

from ernie_image.runtime.core.host import NullHost
from ernie_image.runtime.core.request import GenerationRequest
from ernie_image.runtime.demo.comfy_files import save_comfy_layout
from ernie_image.runtime.demo.tiny import TinySizes, build_dit, build_text_encoder, build_tiny_model, build_vae
from ernie_image.runtime.formats import open_component
from ernie_image.runtime.formats.sources import ModelSources
from ernie_image.runtime.formats.vae_keys import bfl_to_diffusers, diffusers_to_bfl, to_bfl_state_dict
from ernie_image.runtime.local.options import LoadOptions
from ernie_image.runtime.local.pipe import LocalPipe
from ernie_image.runtime.sampling.euler import initial_noise

TOLERANCE = 1e-4
SIZES = TinySizes()


@pytest.fixture(scope="module")
def layouts(tmp_path_factory) -> dict[str, ModelSources]:
    root = tmp_path_factory.mktemp("layouts")
    folder = build_tiny_model(root / "diffusers", layout="diffusers", variant="base", seed=0)
    prefixed = build_tiny_model(root / "comfy", layout="comfy", variant="base", seed=0)
    modules = (build_dit(SIZES, 0), build_text_encoder(SIZES, 1), build_vae(SIZES, 2))
    unprefixed = save_comfy_layout(root / "comfy-bare", "base", *modules, pe=None, dit_prefix="")
    return {"diffusers folder": folder, "comfy single files": prefixed, "comfy single files, DiT without prefix": unprefixed}


@pytest.fixture(scope="module")
def reference(layouts):
    from diffusers import ErnieImagePipeline

    return ErnieImagePipeline.from_pretrained(str(layouts["diffusers folder"].model_dir), torch_dtype=torch.float32)


def _reference_images(reference, request: GenerationRequest) -> torch.Tensor:
    prompts = request.prompt_list()
    return reference(
        prompt=prompts, negative_prompt=[request.negative_prompt] * len(prompts), width=request.width,
        height=request.height, num_inference_steps=request.steps, guidance_scale=request.cfg,
        latents=initial_noise(request.seed, request.batch, request.width, request.height), output_type="pt",
        use_pe=False,
    ).images.permute(0, 2, 3, 1).float()


REQUESTS = {
    "cfg 4, negative, non-square, unicode": GenerationRequest(
        prompt="a red fox in snow, ünïcødé 狐狸 🦊", negative_prompt="blurry", width=256, height=320, steps=3, cfg=4.0, seed=7),
    "cfg off, batch 2 of different lengths": GenerationRequest(
        prompt="", prompts=("a cat", "an old stone bridge over a river, autumn"), batch=2, width=272, height=256,
        steps=2, cfg=1.0, seed=3),
    "empty prompt": GenerationRequest(prompt="", steps=2, cfg=4.0, width=256, height=256, seed=5),
}


@pytest.mark.parametrize("layout", ["diffusers folder", "comfy single files", "comfy single files, DiT without prefix"])
@pytest.mark.parametrize("case", list(REQUESTS))
def test_every_layout_gives_the_reference_image(layout, case, layouts, reference):
    request = REQUESTS[case]
    pipe = LocalPipe.load(layouts[layout], LoadOptions(device="cpu", dtype="fp32"))
    ours = pipe.generate(request, NullHost()).images
    theirs = _reference_images(reference, request)
    assert torch.isfinite(ours).all() and ours.std() > 0.01
    assert (ours - theirs).abs().max().item() <= TOLERANCE


def test_comfy_files_hold_comfy_key_layouts(layouts):
    sources = layouts["comfy single files"]
    with safe_open(str(sources.dit), "pt") as dit:
        assert all(key.startswith("model.diffusion_model.") for key in dit.keys())
    with safe_open(str(sources.text_encoder), "pt") as text:
        keys = set(text.keys())
        assert {"model.embed_tokens.weight", "model.layers.0.self_attn.q_proj.weight", "model.norm.weight"} <= keys
        assert text.get_tensor("tekken_model").dtype == torch.uint8
    with safe_open(str(sources.vae), "pt") as vae:
        keys = set(vae.keys())
        assert {"decoder.up.0.block.0.conv1.weight", "decoder.mid.attn_1.q.weight", "decoder.post_quant_conv.weight",
                "encoder.quant_conv.weight", "bn.running_mean", "decoder.norm_out.weight"} <= keys
        assert vae.get_tensor("decoder.mid.attn_1.q.weight").ndim == 4  # BFL keeps 1x1-conv attention weights
        assert not any("up_blocks" in key for key in keys)


@pytest.mark.parametrize("kind,name", [("dit", "dit"), ("text_encoder", "text_encoder"), ("vae", "vae")])
def test_single_files_read_as_the_folder_reads(kind, name, layouts):
    folder = layouts["diffusers folder"].component({"dit": "transformer"}.get(name, name))
    ours = open_component(folder, kind)
    for layout in ("comfy single files", "comfy single files, DiT without prefix"):
        single = open_component(getattr(layouts[layout], name), kind)
        assert single.keys == ours.keys
        for key in ours.keys:
            assert torch.equal(single.tensor(key), ours.tensor(key)), key


def test_vae_key_maps_are_inverse_and_cover_the_whole_vae():
    vae = build_vae(SIZES, 2)
    state = vae.state_dict()
    count = len(vae.config.block_out_channels)
    bfl = to_bfl_state_dict(state, count)
    assert len(bfl) == len(state)
    for key, tensor in state.items():
        bfl_key, _ = diffusers_to_bfl(key, count)
        back, reshape = bfl_to_diffusers(bfl_key, count)
        assert back == key
        restored = reshape(bfl[bfl_key]) if reshape else bfl[bfl_key]
        assert torch.equal(restored, tensor)
    # BFL numbers decoder up blocks from the lowest resolution: up.{N-1} is diffusers' up_blocks.0.
    assert diffusers_to_bfl("decoder.up_blocks.0.resnets.0.conv1.weight", 4)[0] == "decoder.up.3.block.0.conv1.weight"


def test_diffusers_named_vae_single_file_is_accepted(tmp_path):
    from safetensors.torch import save_file

    vae = build_vae(SIZES, 2)
    path = tmp_path / "vae.safetensors"
    save_file({k: v.contiguous() for k, v in vae.state_dict().items()}, str(path))
    component = open_component(path, "vae")
    assert component.layout == "single-file"
    assert set(component.keys) == set(vae.state_dict())
    # Shapes give the sizes; the group count (not visible in any shape) stays the released 32.
    assert component.config["block_out_channels"] == list(SIZES.vae_channels)
    assert component.config["layers_per_block"] == 1 and component.config["latent_channels"] == 32


def test_bfl_vae_without_step_counter_still_loads(tmp_path):
    from safetensors.torch import save_file

    vae = build_vae(SIZES, 2)
    bfl = to_bfl_state_dict(vae.state_dict(), len(vae.config.block_out_channels))
    bfl.pop("bn.num_batches_tracked")
    path = tmp_path / "flux2-vae.safetensors"
    save_file({k: v.contiguous() for k, v in bfl.items()}, str(path))
    component = open_component(path, "vae")
    assert component.layout == "single-file-bfl"
    assert "bn.num_batches_tracked" in component.keys
