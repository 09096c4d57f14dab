"""Whole images at full size with random weights: this pack's LocalPipe against diffusers' ErnieImagePipeline,
sharing the same DiT, text-encoder and VAE tensors on one GPU."""
from __future__ import annotations

import json

import torch

from common import REPO_ROOT, dit_config, import_package, randomise_dit_, wall_time

import_package()

from ernie_image.runtime.core.host import NullHost  # noqa: E402
from ernie_image.runtime.core.request import GenerationRequest  # noqa: E402
from ernie_image.runtime.demo.tiny import BOS_ID, EOS_ID, PAD_ID, build_tokenizer  # noqa: E402
from ernie_image.runtime.formats.sources import ModelSources  # noqa: E402
from ernie_image.runtime.local.options import LoadOptions  # noqa: E402
from ernie_image.runtime.local.pipe import LocalPipe
from ernie_image.runtime.model.dit import DiTConfig, ErnieDiT  # noqa: E402
from ernie_image.runtime.sampling.euler import initial_noise  # noqa: E402

# 255 bytes -> 256 tokens with the byte-level test tokenizer (BOS + one token per byte).
PROMPT = ("a detailed photograph of a red fox standing in fresh snow at sunrise, soft golden light, pine forest "
          "in the background, shallow depth of field, frost on the fur, breath visible in the cold air, "
          "ultra sharp focus, natural colours, award winning wildlife shot")[:255].ljust(255, ".")


def _config(component: str) -> dict:
    return json.loads((REPO_ROOT / "runtime" / "formats" / "configs" / "ERNIE-Image" / component / "config.json").read_text())


def build_components():
    from diffusers import AutoencoderKLFlux2, ErnieImageTransformer2DModel
    from transformers import Mistral3Config, Mistral3Model, PreTrainedTokenizerFast

    torch.set_default_dtype(torch.bfloat16)
    with torch.device("cuda"):
        dit = ErnieDiT(DiTConfig.from_dict(dit_config()))
        text_raw = _config("text_encoder")
        text_encoder = Mistral3Model(Mistral3Config(**{k: v for k, v in text_raw.items() if k != "architectures"}))
        vae = AutoencoderKLFlux2.from_config({k: v for k, v in _config("vae").items() if not k.startswith("_")})
    torch.set_default_dtype(torch.float32)
    randomise_dit_(dit)
    vae = vae.to(torch.bfloat16)
    with torch.no_grad():
        vae.bn.running_var.fill_(1.0)
    with torch.device("meta"):
        reference_dit = ErnieImageTransformer2DModel(**{k: v for k, v in dit_config().items() if not k.startswith("_")})
    reference_dit.load_state_dict(dit.state_dict(), assign=True)

    tower = shared_text_tower(text_encoder, torch.device("cuda"))
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=build_tokenizer(), bos_token="<s>", eos_token="</s>",
                                        pad_token="<pad>", unk_token="<unk>", model_max_length=2048)
    assert tokenizer.bos_token_id == BOS_ID and tokenizer.eos_token_id == EOS_ID and tokenizer.pad_token_id == PAD_ID
    for module in (dit, reference_dit, text_encoder, tower, vae):
        module.eval().requires_grad_(False)
    return dit, reference_dit, text_encoder, tower, vae, tokenizer


def shared_text_tower(text_encoder, device: torch.device):
    """The pack's text tower (the language model cut after the layer hidden_states[-2] reads, no final norm)
    holding `text_encoder`'s own tensors: one copy of the weights serves both pipelines."""
    from transformers import MistralConfig, MistralModel

    language = text_encoder.language_model
    tower_config = MistralConfig(**{**language.config.to_dict(), "num_hidden_layers": language.config.num_hidden_layers - 1})
    with torch.device("meta"):
        tower = MistralModel(tower_config)
    tower.norm = torch.nn.Identity()
    state = {k: v for k, v in language.state_dict().items()
             if not k.startswith(f"layers.{language.config.num_hidden_layers - 1}.") and not k.startswith("norm.")}
    tower.load_state_dict(state, assign=True, strict=False)
    with torch.device("cpu"):
        tower.rotary_emb = type(language.rotary_emb)(tower_config).to(device)
    return tower.eval().requires_grad_(False)


def fp8_rows(ours: LocalPipe, dit: ErnieDiT, compile_dit: bool, presets: dict) -> list[dict]:
    """The same pipe with the DiT's Linears packed to FP8 (native scaled matmuls on SM >= 8.9)."""
    from common import quantised_copy

    from ernie_image.runtime.model.compile import compile_blocks

    ours.parts.dit = quantised_copy(dit, "fp8")
    if compile_dit:
        compile_blocks(ours.parts.dit)
    label = "ours, FP8 DiT" + (" (compiled)" if compile_dit else "")
    return [ours_row(ours, label, preset, steps, cfg) for preset, (steps, cfg) in presets.items()]


def ours_row(ours: LocalPipe, label: str, preset: str, steps: int, cfg: float) -> dict:
    """A cold and a warm whole image through LocalPipe, with its own per-phase timings."""
    request = GenerationRequest(prompt=PROMPT, steps=steps, cfg=cfg, width=1024, height=1024, seed=3)
    timings = []
    for _ in range(2):
        result, seconds = wall_time(lambda: ours.generate(request, NullHost()))
        timings.append(seconds)
    assert torch.isfinite(result.images).all()
    info = result.info
    return {"pipeline": label, "preset": preset, "cold s": f"{timings[0]:.2f}", "warm s": f"{timings[1]:.2f}",
            "text ms": f"{info['text_s'] * 1000:.0f}", "steps s": f"{info['sampling_s']:.2f}",
            "decode ms": f"{info['decode_s'] * 1000:.0f}"}


def end_to_end_rows(compile_dit: bool) -> list[dict]:
    from diffusers import ErnieImagePipeline, FlowMatchEulerDiscreteScheduler

    dit, reference_dit, text_encoder, tower, vae, tokenizer = build_components()
    scheduler = FlowMatchEulerDiscreteScheduler.from_config(_config("scheduler"))
    reference = ErnieImagePipeline(transformer=reference_dit, vae=vae, text_encoder=text_encoder, tokenizer=tokenizer,
                                   scheduler=scheduler, pe=None, pe_tokenizer=None)
    reference.set_progress_bar_config(disable=True)
    ours = LocalPipe(ModelSources(), LoadOptions(device="cuda", dtype="bf16", previews=False), "turbo")
    ours.memory.active = False  # everything resident, as diffusers runs it; weights injected, not read from files
    ours.parts.tokenizer, ours.parts.text_tower, ours.parts.dit, ours.parts.vae = tokenizer, tower, dit, vae
    from ernie_image.runtime.model.compile import compile_blocks, fuse_projections

    fuse_projections(dit)
    if compile_dit:
        compile_blocks(dit)
    rows = []
    presets = {"Turbo 8 steps CFG 1": (8, 1.0), "Base 50 steps CFG 4": (50, 4.0)}
    for preset, (steps, cfg) in presets.items():
        rows.append(ours_row(ours, "ours" + (" (compiled DiT)" if compile_dit else ""), preset, steps, cfg))
        reference_times = []
        for _ in range(2):
            reference_times.append(wall_time(lambda: reference(
                prompt=PROMPT, negative_prompt="", width=1024, height=1024, num_inference_steps=steps,
                guidance_scale=cfg, latents=initial_noise(3, 1, 1024, 1024).cuda().bfloat16(), output_type="np",
                use_pe=False))[1])
        rows.append({"pipeline": "diffusers ErnieImagePipeline", "preset": preset,
                     "cold s": f"{reference_times[0]:.2f}", "warm s": f"{reference_times[1]:.2f}"})
    rows.extend(fp8_rows(ours, dit, compile_dit, presets))
    peak = torch.cuda.max_memory_allocated() / 2**30
    rows.append({"pipeline": f"(peak allocated {peak:.1f} GiB, both pipelines' shared weights)", "preset": ""})
    return rows
