"""Which DiT Linear each key of a LoRA file names, whatever trainer wrote it; detection is by keys alone.

A key is `<prefix><module path><separator><adapter part>`. Prefixes: `transformer.` (diffusers, OneTrainer),
`base_model.model.` (PEFT), `diffusion_model.` (ai-toolkit, ComfyUI, musubi-tuner), none (bare PEFT), and the
kohya family `lora_unet_` / `lycoris_` / `lora_transformer_`, whose module paths have every `.` written `_`
(resolved against the DiT's own names, as ComfyUI does). Adapter parts: lora_A/lora_B, lora_down/lora_up, alpha,
LyCORIS LoKr (lokr_*) and LoHa (hada_*), DoRA magnitudes; diffusers' older lora.down/lora.up spelling.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Optional

import torch

from ..core.errors import ModelFileError
from ..model.dit import DiTConfig

# Longest first: `lora_A.default.weight` (a raw PEFT state dict) before `lora_A.weight`.
ADAPTER_PARTS = (
    "lora_A.default.weight", "lora_B.default.weight", "lora_A.weight", "lora_B.weight",
    "lora_down.weight", "lora_up.weight", "lora.down.weight", "lora.up.weight", "lora_mid.weight", "lora_B.bias",
    "lora_up.bias",
    "lokr_w1_a", "lokr_w1_b", "lokr_w2_a", "lokr_w2_b", "lokr_w1", "lokr_w2", "lokr_t2",
    "hada_w1_a", "hada_w1_b", "hada_w2_a", "hada_w2_b", "hada_t1", "hada_t2",
    "dora_scale", "lora_magnitude_vector.default.weight", "lora_magnitude_vector.weight", "lora_magnitude_vector",
    "alpha", "diff", "diff_b",
)
# Spellings of one part: a raw PEFT state dict's adapter name, diffusers' older `lora.down`/`lora.up`.
_CANONICAL_PARTS = {"lora_A.default.weight": "lora_A.weight", "lora_B.default.weight": "lora_B.weight",
                    "lora_magnitude_vector.default.weight": "lora_magnitude_vector.weight",
                    "lora.down.weight": "lora_down.weight", "lora.up.weight": "lora_up.weight"}
DOTTED_PREFIXES = (
    ("base_model.model.", "PEFT (base_model.model.)"),
    ("model.diffusion_model.", "ComfyUI (model.diffusion_model.)"),
    ("diffusion_model.", "ai-toolkit/ComfyUI/musubi (diffusion_model.)"),
    ("transformer.", "diffusers/OneTrainer (transformer.)"),
)
KOHYA_PREFIXES = ("lora_unet_", "lycoris_", "lora_transformer_")
TEXT_ENCODER_PREFIXES = ("lora_te_", "lora_te1_", "lora_te2_", "lora_te3_", "text_encoder.", "text_encoder_2.",
                         "text_encoders.", "te.", "lora_te")

# Other models' LoRAs, recognised by the module names their keys carry (dotted or kohya-underscored).
_SEP = r"[._]"
FOREIGN_MODELS: tuple[tuple[str, re.Pattern[str]], ...] = (
    ("FLUX.1/FLUX.2, Chroma or HunyuanVideo",
     re.compile(rf"(double_blocks|single_blocks|single_transformer_blocks){_SEP}\d")),
    ("Stable Diffusion 3", re.compile(rf"joint_blocks{_SEP}\d")),
    ("SDXL/SD1.5", re.compile(rf"(input_blocks|output_blocks|middle_block|down_blocks|up_blocks|mid_block){_SEP}")),
    ("Qwen-Image",
     re.compile(rf"transformer_blocks{_SEP}\d+{_SEP}(img_mod|txt_mod|img_mlp|txt_mlp|attn{_SEP}add_q_proj)")),
    ("Z-Image/Lumina2", re.compile(rf"(noise_refiner|context_refiner|"
                                   rf"layers{_SEP}\d+{_SEP}(attention{_SEP}(to_q|qkv)|feed_forward{_SEP}w[123]))")),
    ("Wan", re.compile(rf"blocks{_SEP}\d+{_SEP}(self_attn|cross_attn|ffn){_SEP}")),
)


def dit_linear_shapes(config: DiTConfig) -> dict[str, tuple[int, int]]:
    """(out, in) of every Linear of the DiT by its diffusers module path (q/k/v and gate/up before fusion)."""
    d, f = config.hidden_size, config.ffn_hidden_size
    shapes: dict[str, tuple[int, int]] = {}
    for index in range(config.num_layers):
        block = f"layers.{index}."
        for name in ("to_q", "to_k", "to_v", "to_out.0"):
            shapes[f"{block}self_attention.{name}"] = (d, d)
        shapes[f"{block}mlp.gate_proj"] = (f, d)
        shapes[f"{block}mlp.up_proj"] = (f, d)
        shapes[f"{block}mlp.linear_fc2"] = (d, f)
    if config.text_in_dim != d:
        shapes["text_proj"] = (d, config.text_in_dim)
    shapes["time_embedding.linear_1"] = (d, d)
    shapes["time_embedding.linear_2"] = (d, d)
    shapes["adaLN_modulation.1"] = (6 * d, d)
    shapes["final_norm.linear"] = (2 * d, d)
    shapes["final_linear"] = (config.out_channels, d)
    return shapes


def linear_names(keys: list[str]) -> dict[str, tuple[int, int]]:
    """Every DiT Linear path a DiT with as many blocks as `keys` name could have, with no shapes (0, 0): what
    checking a LoRA file's keys needs before the DiT's config is known (the shapes are checked when it is)."""
    indices = [int(found) for key in keys for found in re.findall(r"layers[._](\d+)[._]", key)]
    blocks = min(max(indices, default=0) + 1, 1024)
    shapes = dit_linear_shapes(DiTConfig(hidden_size=64, num_layers=blocks, ffn_hidden_size=64, text_in_dim=32))
    return {path: (0, 0) for path in shapes}


@dataclass
class MappedKeys:
    """A LoRA file's tensors grouped by the DiT Linear they adapt: {module path: {adapter part: tensor}}."""

    layers: dict[str, dict[str, torch.Tensor]]
    style: str  # e.g. "kohya (lora_unet_)", for messages and the result info
    skipped_text_encoder: int = 0
    unmatched: list[str] = field(default_factory=list)


def split_adapter_part(key: str) -> Optional[tuple[str, str]]:
    """(module part, adapter part) of a key, or None when it ends in no known adapter part."""
    for part in ADAPTER_PARTS:
        if key.endswith("." + part):
            return key[: -len(part) - 1], part
    return None


def _strip_prefix(module: str, kohya_names: dict[str, str]) -> tuple[Optional[str], str]:
    """The DiT module path a key's module part names (None: no DiT Linear), and the style its prefix shows."""
    for prefix in KOHYA_PREFIXES:
        if module.startswith(prefix):
            return kohya_names.get(module[len(prefix):]), f"kohya ({prefix})"
    for prefix, style in DOTTED_PREFIXES:
        if module.startswith(prefix):
            return module[len(prefix):], style
    return module, "bare PEFT (no prefix)"


def foreign_model(keys: list[str]) -> Optional[tuple[str, str]]:
    """(model name, an example key) when the keys are another model's LoRA."""
    for name, pattern in FOREIGN_MODELS:
        hit = next((key for key in keys if pattern.search(key)), None)
        if hit is not None:
            return name, hit
    return None


def _few(keys: list[str], count: int = 3) -> str:
    return ", ".join(keys[:count]) + (f" (+{len(keys) - count} more)" if len(keys) > count else "")


def map_keys(name: str, tensors: dict[str, torch.Tensor], targets: dict[str, tuple[int, int]]) -> MappedKeys:
    """Group `tensors` by DiT Linear. Refuses (ModelFileError, one line) a file that is not a LoRA, another model's
    LoRA, one whose keys name no DiT Linear, and one where two keys give one layer the same part under two names
    (prefixes, kohya's underscores, a part's spellings): keys that name nothing among others are returned as
    `unmatched`."""
    kohya_names = {path.replace(".", "_"): path for path in targets}
    layers: dict[str, dict[str, torch.Tensor]] = {}
    styles: dict[str, int] = {}
    unmatched: list[str] = []
    text_encoder = 0
    adapter_keys = 0
    named_by: dict[tuple[str, str], str] = {}  # (DiT Linear, canonical part) -> the first key that gave it
    for key, tensor in tensors.items():
        if key.startswith(TEXT_ENCODER_PREFIXES):
            text_encoder += 1
            continue
        split = split_adapter_part(key)
        if split is None:
            unmatched.append(key)
            continue
        adapter_keys += 1
        module, part = split
        path, style = _strip_prefix(module, kohya_names)
        styles[style] = styles.get(style, 0) + 1
        if path is None or path not in targets:
            unmatched.append(key)
            continue
        part = _CANONICAL_PARTS.get(part, part)
        earlier = named_by.setdefault((path, part), key)
        if earlier != key:
            raise ModelFileError(f"LoRA {name} holds two LoRAs for {path} (keys {earlier} and {key}, its {part} under "
                                 f"two names): it was merged from two files; use each LoRA's own file")
        layers.setdefault(path, {})[part] = tensor
    keys = list(tensors)
    style = max(styles, key=styles.get) if styles else "unknown"
    if not layers:
        foreign = foreign_model(keys)
        if foreign is not None:
            raise ModelFileError(f"LoRA {name} is for {foreign[0]} (keys like {foreign[1]}), not ERNIE-Image: pick a "
                                 f"LoRA trained on ERNIE-Image or ERNIE-Image-Turbo")
        if text_encoder and not adapter_keys:
            raise ModelFileError(f"LoRA {name} adapts only a text encoder ({text_encoder} keys), which this pack does "
                                 f"not apply: pick a LoRA of the ERNIE-Image DiT")
        if not adapter_keys:
            model_hint = " (it looks like a model checkpoint: load it as the DiT (dit))" if any(
                k.endswith(".weight") for k in keys) else ""
            raise ModelFileError(f"{name} is not a LoRA file{model_hint}: it has no lora_A/lora_B, lora_down/lora_up, "
                                 f"LoKr or LoHa weights (keys like {_few(keys)}); pick a LoRA .safetensors"
                                 ).naming("dit")
        raise ModelFileError(f"LoRA {name} ({style} keys) names no ERNIE-Image DiT layer (keys like "
                             f"{_few(unmatched)}): it is for another model, or its trainer's layout is not known")
    return MappedKeys(layers, style, text_encoder, unmatched)


def describe_unmatched(name: str, mapped: MappedKeys) -> list[str]:
    """The notices a partly matching file gets: never a silent skip."""
    notices = []
    if mapped.unmatched:
        notices.append(f"LoRA {name}: {len(mapped.unmatched)} key(s) name no ERNIE-Image DiT layer and were skipped "
                       f"(e.g. {_few(mapped.unmatched)})")
    if mapped.skipped_text_encoder:
        notices.append(f"LoRA {name}: {mapped.skipped_text_encoder} text-encoder key(s) were skipped (only the DiT "
                       f"part of a LoRA is applied)")
    return notices
