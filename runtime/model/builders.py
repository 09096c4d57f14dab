"""The DiT, text tower and VAE a part's file describes: built on the meta device from its config (the file's own,
the released one, or one read from the weights' shapes), then filled from the file (fill.py).

Reading weight files (layouts, key names, detection, errors) is `formats/`'s job; this module composes the parts.
"""
from __future__ import annotations

import inspect
from typing import TYPE_CHECKING, Literal, Optional

import torch

from ..core.errors import ModelFileError
from ..core.variant import Variant
from ..formats.config_json import config_named, load_config
from .arithmetic import ArithmeticName
from .config_fit import check_config_fits, dit_fields_from_shapes
from .dtype_fit import check_built_dtypes, floating_tensors
from .fill import fill_from_file
from .tensor_fit import check_built_tensors, refuse_sparse_layers, shapes_of

if TYPE_CHECKING:
    from .dit import DiTConfig


# The fields a DiT without a config is built from, each read off its weights (config_fit.dit_fields_from_shapes).
_DIT_FIELDS_SEEN = ("hidden_size", "in_channels", "ffn_hidden_size", "out_channels", "num_attention_heads", "num_layers")


def dit_config_for(component) -> "DiTConfig":
    from .dit import DiTConfig

    if component.config is not None:
        with config_named(component, "DiT"):
            return DiTConfig.from_dict(component.config)
    fields = {seen.field: seen.value for seen in dit_fields_from_shapes(component)}
    unseen = [field for field in _DIT_FIELDS_SEEN if field not in fields]
    if unseen:
        raise ModelFileError(f"{component.path} has no config and its tensors do not show the transformer's "
                             f"{', '.join(unseen)}: its weights are incomplete: re-download them")
    fields.setdefault("text_in_dim", fields["hidden_size"])  # no text_proj: the text comes in at the model's width
    released = DiTConfig()  # the rope axes scale with the head dim
    head_dim = fields["hidden_size"] // fields["num_attention_heads"]
    fields["rope_axes_dim"] = tuple(a * head_dim // released.head_dim for a in released.rope_axes_dim)
    with config_named(component, "DiT"):
        return DiTConfig.from_dict(fields)


def build_dit(component, device: torch.device, dtype: torch.dtype, quant: str = "none",
              quant_device: Optional[torch.device] = None, arithmetic: ArithmeticName = "fast"):
    """The DiT on `device`; `quant` quantises bf16 Linear weights on load (on `quant_device`, default `device`);
    `arithmetic`: how its uncompiled forward computes (arithmetic.py)."""
    return fill_from_file(dit_on_meta(component, arithmetic), component, device, dtype, quant, quant_device)


def dit_on_meta(component, arithmetic: ArithmeticName = "fast") -> torch.nn.Module:
    """The DiT its config describes, on the meta device (no memory): a config that does not build it is named."""
    from .dit import ErnieDiT

    with config_named(component, "DiT"), torch.device("meta"):
        return ErnieDiT(dit_config_for(component), arithmetic)


def text_config_for(component, variant: Variant = "base") -> dict:
    """The text tower's config: the folder's, one embedded in the file, or the released Ministral-3B one."""
    config = component.config
    if config is not None:
        return dict(config.get("text_config", config))
    released = load_config(variant, "text_encoder")["text_config"]
    width = tuple(component.tensor("embed_tokens.weight").shape)[1]
    if width != released["hidden_size"]:
        raise ModelFileError(
            f"{component.path}: text encoder width {width} is not Ministral-3B's {released['hidden_size']}: "
            f"ERNIE-Image needs the ministral-3-3b text encoder"
        )
    return dict(released)


def rebuild_rotary_tables(model: torch.nn.Module, config, device: torch.device) -> None:
    """A meta-built Mistral-family model's rotary tables are non-persistent buffers, in no file: compute them."""
    with torch.device("cpu"):
        model.rotary_emb = type(model.rotary_emb)(config).to(device)


def build_text_tower(component, device: torch.device, dtype: torch.dtype, variant: Variant = "base"):
    """Mistral text tower cut at the layer whose output is hidden_states[-2]: later layers and norm never load."""
    tower = text_tower_on_meta(component, variant)
    rebuild_rotary_tables(tower, tower.config, device)
    return fill_from_file(tower, component, device, dtype)


def text_tower_on_meta(component, variant: Variant = "base") -> torch.nn.Module:
    """The text tower its config describes, on the meta device: a config that does not build it is named."""
    from .libraries import MistralConfig, MistralModel

    with config_named(component, "text encoder"):
        raw = text_config_for(component, variant)
        total_layers = int(raw["num_hidden_layers"])
        raw = {k: v for k, v in raw.items() if k not in ("model_type", "architectures", "dtype", "transformers_version")}
        # Only Ministral3 (the PE) reads llama_4_scaling_beta; the reference text tower is a plain MistralModel.
        raw["rope_parameters"] = {k: v for k, v in (raw.get("rope_parameters") or {}).items()
                                  if k != "llama_4_scaling_beta"}
        raw["num_hidden_layers"] = total_layers - 1
        config = MistralConfig(**raw)
        config._attn_implementation = "sdpa"
        with torch.device("meta"):
            tower = MistralModel(config)
    tower.norm = torch.nn.Identity()
    return tower


VaePart = Literal["decoder", "encoder"]


def require_vae_encoder(component) -> None:
    """Image inputs need the VAE's encoder: a decoder-only file is named before any work starts."""
    if not any(key.startswith("encoder.") for key in component.keys):
        raise ModelFileError(f"{component.path.name} holds only the VAE decoder: image inputs need the encoder too: "
                             "pick the full vae/flux2-vae.safetensors (or a diffusers ERNIE-Image folder's vae/)")


def build_vae(component, device: torch.device, dtype: torch.dtype, part: VaePart = "decoder"):
    """One half of the FLUX.2 VAE with the latent BatchNorm statistics: the decoder (text-to-image never encodes)
    or the encoder (image inputs). The other half is dropped before anything is materialised."""
    if part == "encoder":
        require_vae_encoder(component)
    vae = vae_on_meta(component)
    if part == "encoder":
        vae.decoder = None
        vae.post_quant_conv = None
    else:
        vae.encoder = None
        vae.quant_conv = None
    return fill_from_file(vae, component, device, dtype, keep_fp32=("bn.running_mean", "bn.running_var"))


def vae_on_meta(component) -> torch.nn.Module:
    """The whole VAE its config describes, on the meta device: a config that does not build it is named."""
    from .libraries import AutoencoderKLFlux2

    with config_named(component, "VAE"):
        config = component.config if component.config is not None else load_config("base", "vae")
        # Keys the class does not take (force_upcast: a pipeline's setting) would print a warning at every build.
        accepted = inspect.signature(AutoencoderKLFlux2.__init__).parameters
        config = {k: v for k, v in config.items() if k in accepted}
        with torch.device("meta"):
            return AutoencoderKLFlux2.from_config(config)


def check_config_builds(component, kind: str, variant: Variant = "base") -> dict[str, tuple[int, ...]]:
    """The config held against the weights' shapes (config_fit.py), then the part it describes built on the meta
    device, its tensors held against the file's (tensor_fit.py) and their dtypes (dtype_fit.py), and dropped: a config
    that does not fit the weights or does not build its part (wrong types, values out of range), or a file holding
    integers where the part's weights are floating point, fails at load in one line, before any work. Returns the
    part's tensors' shapes by name: what the config makes."""
    refuse_sparse_layers(component)
    check_config_fits(component, kind, variant)
    if kind == "dit":
        part = dit_on_meta(component)
        made = shapes_of(part)
        check_built_tensors(component, kind, made)
    elif kind == "text_encoder":
        part = text_tower_on_meta(component, variant)
        made = shapes_of(part)
        last = f"layers.{len(part.layers)}."  # the layer hidden_states[-2] never reads, and the final norm
        check_built_tensors(component, kind, made, may_hold=lambda key: key.startswith(last) or key == "norm.weight")
    else:
        part = vae_on_meta(component)
        made = shapes_of(part)
        decoder_only = not any(key.startswith("encoder.") for key in component.keys)  # text-to-image needs no more
        check_built_tensors(component, kind, made,
                            may_lack=lambda key: decoder_only and key.startswith(("encoder.", "quant_conv.")))
    check_built_dtypes(component, floating_tensors(part))
    return made
