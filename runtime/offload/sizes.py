"""Weight sizes of ERNIE-Image's parts, derived from their configs (never hard-coded), per storage format.

Only what the runtime materialises is counted: the DiT, the text tower cut at hidden_states[-2] (the last layer,
the final norm and the vision tower never load), the prompt enhancer (a full causal LM), the VAE decoder and,
for jobs with an image in, the VAE encoder.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from ..core.errors import InvalidInputError

# Bytes per parameter of a Linear weight stored in each format (block scales included).
FORMAT_BYTES: dict[str, float] = {
    "fp32": 4.0,
    "bf16": 2.0,
    "fp16": 2.0,
    "fp8": 1.0,
    "q8_0": 34 / 32,
    "q6_k": 210 / 256,
    "q5_k": 176 / 256,
    "q5_0": 22 / 32,
    "q4_k": 144 / 256,
    "q4_0": 18 / 32,
    "nvfp4": 0.5 + 1 / 16,  # E2M1 pairs plus one fp8 scale per 16 values
}
# Formats whose Linear runs by dequantising the whole weight to bf16 first (transient memory per layer).
DEQUANT_FORMATS = {"q8_0", "q6_k", "q5_k", "q5_0", "q4_k", "q4_0", "nvfp4"}


def format_bytes(fmt: str) -> float:
    key = fmt.lower()
    if key not in FORMAT_BYTES:
        raise InvalidInputError(f"unknown weight format {fmt!r}: use one of {', '.join(FORMAT_BYTES)}")
    return FORMAT_BYTES[key]


@dataclass(frozen=True)
class LayeredSize:
    """A model made of `layers` identical layers plus a stem (embeddings, heads) that is not layer-wise."""

    layers: int
    layer_bytes: int
    stem_bytes: int
    largest_linear_params: int  # for the transient of a dequantising Linear

    @property
    def total_bytes(self) -> int:
        return self.layers * self.layer_bytes + self.stem_bytes


def _linear_bytes(params: int, fmt: str) -> int:
    return int(round(params * format_bytes(fmt)))


def dit_size(config: dict, fmt: str = "bf16", dtype_bytes: int = 2) -> LayeredSize:
    """diffusers' ErnieImageTransformer2DModel config -> bytes: block Linears in `fmt`, norms and stem in the
    compute dtype (`dtype_bytes` per value: 2 for bf16/fp16, 4 for fp32).

    Quantised files keep the small stem Linears unquantised too (ComfyUI and GGUF both do).
    """
    d = int(config["hidden_size"])
    f = int(config["ffn_hidden_size"])
    heads = int(config["num_attention_heads"])
    head_dim = d // heads
    text_in = int(config.get("text_in_dim", d))
    in_ch, out_ch = int(config["in_channels"]), int(config["out_channels"])
    block_linear = 4 * d * d + 3 * d * f
    block_norms = 2 * d + 2 * head_dim
    block = _linear_bytes(block_linear, fmt) + dtype_bytes * block_norms
    stem_params = (
        in_ch * d + d  # x_embedder (1x1 conv)
        + (text_in * d if text_in != d else 0)  # text_proj
        + 2 * (d * d + d)  # time_embedding
        + d * 6 * d + 6 * d  # shared adaLN modulation
        + d * 2 * d + 2 * d  # final_norm
        + d * out_ch + out_ch  # final_linear
    )
    return LayeredSize(int(config["num_layers"]), block, dtype_bytes * stem_params, max(d * f, d * d))


def _mistral_layer_params(text: dict) -> int:
    d = int(text["hidden_size"])
    heads, kv = int(text["num_attention_heads"]), int(text["num_key_value_heads"])
    head_dim = int(text.get("head_dim") or d // heads)
    ffn = int(text["intermediate_size"])
    attention = d * heads * head_dim * 2 + d * kv * head_dim * 2
    return attention + 3 * d * ffn + 2 * d


def text_tower_size(config: dict, dtype_bytes: int = 2) -> LayeredSize:
    """Mistral3Model config (or its text_config) -> the tower cut at hidden_states[-2]: N-1 layers + embedding."""
    text = config.get("text_config", config)
    d, vocab = int(text["hidden_size"]), int(text["vocab_size"])
    layers = int(text["num_hidden_layers"]) - 1
    ffn = int(text["intermediate_size"])
    return LayeredSize(layers, dtype_bytes * _mistral_layer_params(text), dtype_bytes * vocab * d, d * ffn)


def prompt_enhancer_size(config: dict, dtype_bytes: int = 2) -> LayeredSize:
    """Ministral3ForCausalLM config -> all layers, embedding, final norm and (when untied) the LM head."""
    d, vocab = int(config["hidden_size"]), int(config["vocab_size"])
    head = 0 if config.get("tie_word_embeddings", False) else vocab * d
    stem = vocab * d + head + d
    return LayeredSize(int(config["num_hidden_layers"]), dtype_bytes * _mistral_layer_params(config),
                       dtype_bytes * stem, vocab * d)


def vae_encoder_bytes(config: dict, dtype_bytes: int = 2) -> int:
    """AutoencoderKLFlux2 encoder (plus quant_conv and the BatchNorm statistics), from its config: built only for
    jobs with an image in."""
    channels = [int(c) for c in config["block_out_channels"]]
    layers = int(config["layers_per_block"])
    latent = int(config["latent_channels"])

    def conv(cin: int, cout: int, k: int) -> int:
        return cin * cout * k * k + cout

    def resnet(cin: int, cout: int) -> int:
        shortcut = conv(cin, cout, 1) if cin != cout else 0
        return 2 * cin + conv(cin, cout, 3) + 2 * cout + conv(cout, cout, 3) + shortcut

    params = conv(int(config["in_channels"]), channels[0], 3)  # conv_in
    previous = channels[0]
    for index, out in enumerate(channels):
        for layer in range(layers):
            params += resnet(previous if layer == 0 else out, out)
        previous = out
        if index < len(channels) - 1:
            params += conv(out, out, 3)  # downsampler
    top = channels[-1]
    params += 2 * resnet(top, top)  # mid block resnets
    if config.get("mid_block_add_attention", True):
        params += 2 * top + 4 * (top * top + top)
    params += 2 * top + conv(top, 2 * latent, 3)  # norm out, conv_out (mean and log-variance)
    params += conv(2 * latent, 2 * latent, 1)  # quant_conv
    batch_norm = 2 * 4 * latent * 4  # running mean/var over the 2x2-patchified channels, fp32
    return dtype_bytes * params + batch_norm


def vae_decoder_bytes(config: dict, dtype_bytes: int = 2) -> int:
    """AutoencoderKLFlux2 decoder (plus post_quant_conv and the BatchNorm statistics), from its config."""
    channels = [int(c) for c in config["block_out_channels"]]
    layers = int(config["layers_per_block"])
    latent = int(config["latent_channels"])
    groups_norm = lambda c: 2 * c  # noqa: E731 - GroupNorm weight + bias

    def conv(cin: int, cout: int, k: int) -> int:
        return cin * cout * k * k + cout

    def resnet(cin: int, cout: int) -> int:
        shortcut = conv(cin, cout, 1) if cin != cout else 0
        return groups_norm(cin) + conv(cin, cout, 3) + groups_norm(cout) + conv(cout, cout, 3) + shortcut

    top = channels[-1]
    params = conv(latent, latent, 1)  # post_quant_conv
    params += conv(latent, top, 3)  # conv_in
    params += 2 * resnet(top, top)  # mid block resnets
    if config.get("mid_block_add_attention", True):
        params += groups_norm(top) + 4 * (top * top + top)
    reversed_channels = list(reversed(channels))
    previous = top
    for index, out in enumerate(reversed_channels):
        for layer in range(layers + 1):
            params += resnet(previous if layer == 0 else out, out)
        previous = out
        if index < len(channels) - 1:
            params += conv(out, out, 3)  # upsampler
    params += groups_norm(channels[0]) + conv(channels[0], int(config["out_channels"]), 3)
    batch_norm = 2 * 4 * latent * 4  # running mean/var over the 2x2-patchified channels, fp32
    return dtype_bytes * params + batch_norm


def _side(sample_size) -> int:
    return int(sample_size[0] if isinstance(sample_size, (list, tuple)) else sample_size)


@dataclass(frozen=True)
class ModelSizes:
    dit: LayeredSize
    text: LayeredSize
    vae_bytes: int
    pe: Optional[LayeredSize] = None
    dit_format: str = "bf16"
    text_hidden: int = 3072
    text_layers: int = 25
    text_kv_width: int = 1024  # kv heads x head dim, for the enhancer's KV cache
    text_ffn: int = 9216
    dit_hidden: int = 4096
    dit_ffn: int = 12288
    vae_base_channels: int = 128
    activation_bytes: int = 2
    vae_encoder_bytes: int = 0  # the VAE encoder, for jobs with an image in
    vae_sample_size: int = 1024  # the tile side the VAE uses by itself for images above decode's threshold

    @classmethod
    def from_configs(cls, dit_config: dict, text_config: dict, vae_config: dict, pe_config: Optional[dict] = None,
                     dit_format: str = "bf16", activation_bytes: int = 2) -> "ModelSizes":
        text = text_config.get("text_config", text_config)
        heads = int(text["num_attention_heads"])
        head_dim = int(text.get("head_dim") or int(text["hidden_size"]) // heads)
        return cls(
            dit=dit_size(dit_config, dit_format, activation_bytes),
            text=text_tower_size(text_config, activation_bytes),
            vae_bytes=vae_decoder_bytes(vae_config, activation_bytes),
            pe=prompt_enhancer_size(pe_config, activation_bytes) if pe_config is not None else None,
            dit_format=dit_format.lower(),
            text_hidden=int(text["hidden_size"]),
            text_layers=int(text["num_hidden_layers"]),
            text_kv_width=int(text["num_key_value_heads"]) * head_dim,
            text_ffn=int(text["intermediate_size"]),
            dit_hidden=int(dit_config["hidden_size"]),
            dit_ffn=int(dit_config["ffn_hidden_size"]),
            vae_base_channels=int(vae_config["block_out_channels"][0]),
            activation_bytes=activation_bytes,
            vae_encoder_bytes=vae_encoder_bytes(vae_config, activation_bytes),
            vae_sample_size=_side(vae_config.get("sample_size", 1024)),
        )

    @classmethod
    def released(cls, variant: str = "turbo", dit_format: str = "bf16", with_pe: bool = False) -> "ModelSizes":
        from ..formats.config_json import load_config

        return cls.from_configs(load_config(variant, "transformer"), load_config(variant, "text_encoder"),
                                load_config(variant, "vae"), load_config(variant, "pe") if with_pe else None,
                                dit_format)
