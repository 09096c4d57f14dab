"""What a weight file holds, told from its tensor names and shapes alone (never from the file name).

`identify` answers with the ERNIE-Image component the keys belong to (and where the canonical names start), or
with a plain description of the other model family it recognises, for error messages that say what the file is.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Iterable, Optional

Shapes = dict[str, tuple[int, ...]]

DIT_PREFIXES = ("model.diffusion_model.", "diffusion_model.", "transformer.", "model.", "")
TEXT_PREFIXES = ("model.language_model.", "language_model.model.", "language_model.", "text_model.model.", "model.", "")
VAE_PREFIXES = ("vae.", "first_stage_model.", "")

DIT_PROBES = ("final_linear.weight", "layers.0.self_attention.to_q.weight")
TEXT_PROBE = "layers.0.self_attn.q_proj.weight"
VAE_PROBE = "decoder.conv_in.weight"

# Other families, by a key (after any prefix) that only they have. Checked in order.
OTHER_FAMILIES: tuple[tuple[str, str], ...] = (
    ("double_stream_modulation_img.lin.weight", "a FLUX.2 transformer"),
    ("double_blocks.0.img_attn.qkv.weight", "a FLUX.1 transformer"),
    ("single_transformer_blocks.0.attn.to_qkv_mlp_proj.weight", "a FLUX.2 transformer (diffusers names)"),
    ("single_transformer_blocks.0.proj_mlp.weight", "a FLUX.1 transformer (diffusers names)"),
    ("joint_blocks.0.x_block.attn.qkv.weight", "an SD3 transformer"),
    ("input_blocks.0.0.weight", "a Stable Diffusion (SD1/SD2/SDXL) UNet"),
    ("conv_in.weight", "a Stable Diffusion UNet (diffusers names)"),
    ("transformer_blocks.0.img_mod.1.weight", "a Qwen-Image transformer"),
    ("patch_embedding.weight", "a Wan video transformer"),
    ("cap_embedder.0.weight", "a Lumina / Z-Image transformer"),
    ("text_model.encoder.layers.0.self_attn.q_proj.weight", "a CLIP text encoder"),
    ("encoder.block.0.layer.0.SelfAttention.q.weight", "a T5 text encoder"),
    ("shared.weight", "a T5 text encoder"),
    ("vision_model.encoder.layers.0.self_attn.q_proj.weight", "a CLIP / SigLIP vision model"),
    ("lora_unet_", "a LoRA"),
)


# A name part that only an adapter's tensors have: PEFT/kohya lora_A/lora_B/lora_down/lora_up (and diffusers' older
# lora.down/lora.up) and their alpha, LyCORIS lokr_*/hada_*/oft_*, its full-weight diff and GLoRA's a1/a2/b1/b2,
# DoRA's magnitude (kohya's dora_scale, PEFT's lora_magnitude_vector). No ERNIE-Image part has a tensor so named.
_ADAPTER_PART = re.compile(r"(lora_(A|B|down|up|magnitude_vector)|lora|alpha|lokr_\w+|hada_\w+|oft_\w+|diff|diff_b"
                           r"|[ab][12]|dora_scale)$")


def adapter_key(key: str) -> bool:
    """Whether `key` names a LoRA/LyCORIS adapter's tensor (`layers.0.attn.to_q.lora_A.weight`), never a model's."""
    return any(_ADAPTER_PART.match(part) for part in key.split("."))


@dataclass(frozen=True)
class Identity:
    kind: Optional[str]  # "dit", "text_encoder", "vae" (an ERNIE-Image component) or None
    prefix: str  # where the canonical names start in the raw keys
    layout: str  # "diffusers" or "bfl" for the VAE; "hf" / "diffusers" otherwise
    description: str  # what the file is, for messages


def layer_count(keys: Iterable[str], prefix: str = "") -> int:
    """How many layers `keys` name (`<prefix>layers.N.`...): the highest N plus one; 0 when they name none."""
    pattern = re.compile(re.escape(prefix) + r"layers\.(\d+)\.")
    return 1 + max((int(match[1]) for key in keys if (match := pattern.match(key))), default=-1)


def _find_prefix(keys: Shapes, prefixes: tuple[str, ...], probes: tuple[str, ...]) -> Optional[str]:
    for prefix in prefixes:
        if all(prefix + probe in keys for probe in probes):
            return prefix
    return None


def _text_identity(keys: Shapes, prefix: str) -> Identity:
    width = keys[prefix + TEXT_PROBE][1]
    layers = layer_count(keys, prefix)
    if prefix + "layers.0.self_attn.q_norm.weight" in keys:
        return Identity(None, prefix, "hf", f"a Qwen3 text model (width {width}, {layers} layers)")
    if prefix + "layers.0.self_attn.q_proj.bias" in keys:
        return Identity(None, prefix, "hf", f"a Qwen2 text model (width {width}, {layers} layers)")
    if width == 5120:
        return Identity(None, prefix, "hf", f"Mistral-Small 24B (FLUX.2's text encoder, {layers} layers)")
    if width == 4096 and layers == 32:
        return Identity(None, prefix, "hf", "a Llama-3 8B-class text model")
    name = "Ministral-3B" if width == 3072 else "a Mistral-style"
    return Identity("text_encoder", prefix, "hf", f"{name} text model (width {width}, {layers} layers)")


def text_model_role(keys: Shapes, prefix: str) -> Optional[str]:
    """Which of ERNIE-Image's two Ministral-3B-shaped models a text-model file holds: "text_encoder", "pe" or None.

    Same geometry (26 layers, width 3072), other weights; the files differ in what they carry besides the layers.
    The text encoder is a Mistral3Model: a vision tower and `language_model.` names (diffusers text_encoder/), or,
    as Comfy-Org repacks it, `model.` names with an explicit `lm_head.weight` beside the embedded `tekken_model`
    tokenizer. The prompt enhancer is a Ministral3ForCausalLM with its head tied to the embeddings, so its files
    (diffusers pe/, Comfy-Org's ernie-image-prompt-enhancer) store `model.` names and no head and no vision tower.
    """
    vision = any(k.startswith(("vision_tower.", "multi_modal_projector.", "model.vision_tower.")) for k in keys)
    if vision or "language_model." in prefix:
        return "text_encoder"
    if prefix != "model.":
        return None
    if "lm_head.weight" in keys:
        return "text_encoder" if "tekken_model" in keys else None
    return "pe"


def _vae_identity(keys: Shapes, prefix: str) -> Identity:
    latent = keys[prefix + VAE_PROBE][1] if len(keys[prefix + VAE_PROBE]) > 1 else 0
    bfl = any(k.startswith(prefix + "decoder.up.") for k in keys)
    layout = "bfl" if bfl else "diffusers"
    if latent == 32 and prefix + "bn.running_mean" in keys:
        return Identity("vae", prefix, layout, f"the FLUX.2 VAE ({'BFL' if bfl else 'diffusers'} names)")
    family = {4: "an SD1/SD2/SDXL VAE", 16: "a FLUX.1 / SD3 VAE"}.get(latent, f"a VAE with {latent} latent channels")
    return Identity(None, prefix, layout, family + " (ERNIE-Image needs the FLUX.2 VAE: 32 channels + BatchNorm)")


def identify(keys: Shapes) -> Identity:
    if any(k.startswith("model.diffusion_model.") for k in keys) and any(k.startswith("first_stage_model.") for k in keys):
        return Identity(None, "", "", "a full Stable-Diffusion-style checkpoint (UNet + VAE + text encoder in one file)")
    prefix = _find_prefix(keys, DIT_PREFIXES, DIT_PROBES)
    if prefix is not None:
        return Identity("dit", prefix, "diffusers", "an ERNIE-Image transformer")
    prefix = _find_prefix(keys, TEXT_PREFIXES, (TEXT_PROBE,))
    if prefix is not None:
        return _text_identity(keys, prefix)
    prefix = _find_prefix(keys, VAE_PREFIXES, (VAE_PROBE,))
    if prefix is not None:
        return _vae_identity(keys, prefix)
    for marker, description in OTHER_FAMILIES:
        if any(k == marker or k.endswith("." + marker) or k.startswith(marker) for k in keys):
            return Identity(None, "", "", description)
    return Identity(None, "", "", "of an unknown layout")


def copies(keys: Shapes, identity: Identity) -> list[str]:
    """Every prefix under which `keys` hold the probes of the family `identity` was found as (the DiT's, a text
    model's, a VAE's): one for a model, two where its weights are there twice (a prefixed copy beside them)."""
    for prefixes, probes in ((DIT_PREFIXES, DIT_PROBES), (TEXT_PREFIXES, (TEXT_PROBE,)), (VAE_PREFIXES, (VAE_PROBE,))):
        if all(identity.prefix + probe in keys for probe in probes):
            return [prefix for prefix in prefixes if all(prefix + probe in keys for probe in probes)]
    return [identity.prefix]


def sample_keys(keys, count: int = 3) -> str:
    """A few representative names for a message: the first layer's rather than 100 near-identical ones."""
    ordered = sorted(keys, key=lambda k: (bool(re.search(r"\.([1-9]\d*)\.", k)), k))
    return ", ".join(ordered[:count]) if ordered else "no tensors at all"
