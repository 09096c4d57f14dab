"""A part's config held against its weights before the part is built.

A config.json (or a config embedded in a file's metadata) that does not fit the weights beside it would build
another model than the file holds: fewer layers than the file has run silently with the rest never read; other
widths fail mid-load blaming the weights; a switch that leaves a layer out (the VAE's use_post_quant_conv,
mid_block_add_attention) would leave the file's tensors unread, or fail after a whole sampling run. Each field the
weights show (layer and block counts, widths, channels, which optional layers they hold) must be what the config
says; a field the config lacks must have a default that fits. Fields no shape shows (GroupNorm's group count, the
RoPE base) must be the released model's where the weights are the released model's. Each refusal is one line naming
the config, the field and what the weights hold. The part the config then builds is held against the file tensor by
tensor (tensor_fit.py).
"""
from __future__ import annotations

import dataclasses
import inspect
import re
from dataclasses import dataclass
from typing import Any, Callable, Optional

from ..core.errors import ModelFileError, shown_shortly
from ..core.variant import Variant
from ..formats.config_json import config_origin, load_config
from ..formats.detect import layer_count
from ..formats.vae_keys import config_from_shapes

Shape = Optional[tuple[int, ...]]


@dataclass(frozen=True)
class Seen:
    """A config field the weights show: its value there, and the words saying where ("2 layers")."""

    field: str
    value: Any
    evidence: str
    also: tuple[Any, ...] = ()  # other values a config may give it (a text encoder file may lack its last layer)
    counts: bool = False  # the field is a list whose length the weights show (`value` is that length)


def _shape_of(component, key: str) -> Shape:
    return tuple(component.tensor(key).shape) if key in component.keys else None


LAYER_FIELDS = {"dit": "num_layers", "text_encoder": "num_hidden_layers", "pe": "num_hidden_layers"}


def _dims(component, where: tuple[tuple[str, str, int], ...]) -> list[Seen]:
    """Fields read off one dimension of one tensor each: (field, key, axis); a tensor the file lacks shows none."""
    seen = []
    for field, key, axis in where:
        shape = _shape_of(component, key)
        if shape is not None:
            seen.append(Seen(field, shape[axis], f"{shape[axis]} ({key} is {list(shape)})"))
    return seen


def _layer_count(component, also_one_more: bool = False) -> list[Seen]:
    """The layer count (`layers.N.`); `also_one_more`: a config may count one layer more than the file holds."""
    layers = layer_count(component.keys)
    if not layers:
        return []
    return [Seen(LAYER_FIELDS[component.kind], layers, f"{layers} layers", (layers + 1,) if also_one_more else ())]


def dit_fields_from_shapes(component) -> list[Seen]:
    """The DiT config's fields its weights' shapes show, a field whose tensors the file lacks left out: widths and
    channels, the heads (the width over the q norm's head dim), the layer count. What the fit check holds a given
    config against, and what a DiT without one is built from (builders.dit_config_for)."""
    seen = _dims(component, (("hidden_size", "x_embedder.proj.weight", 0), ("in_channels", "x_embedder.proj.weight", 1),
                             ("ffn_hidden_size", "layers.0.mlp.gate_proj.weight", 0),
                             ("out_channels", "final_linear.weight", 0), ("text_in_dim", "text_proj.weight", 1)))
    embed = _shape_of(component, "x_embedder.proj.weight")
    head = _shape_of(component, "layers.0.self_attention.norm_q.weight")
    if embed is not None and head is not None and head[0] and embed[0] % head[0] == 0:
        heads = embed[0] // head[0]
        seen.append(Seen("num_attention_heads", heads, f"{heads} heads of {head[0]} "
                                                       f"(layers.0.self_attention.norm_q.weight is {list(head)})"))
    if head is not None:
        seen.append(Seen("qk_layernorm", True,
                         f"the q/k norms (layers.0.self_attention.norm_q.weight is {list(head)})"))
    return seen + _layer_count(component)


def text_seen(component, whole_file_layers: bool) -> list[Seen]:
    """The Mistral text model's fields; `whole_file_layers`: False for the text encoder, whose file may lack the
    last layer (the layer hidden_states[-2] never reads), so its config may count one more."""
    seen = _dims(component, (("hidden_size", "embed_tokens.weight", 1), ("vocab_size", "embed_tokens.weight", 0),
                             ("intermediate_size", "layers.0.mlp.gate_proj.weight", 0)))
    return seen + _layer_count(component, also_one_more=not whole_file_layers)


def _held(component, field: str, key: str, layer: str) -> Seen:
    """A switch that keeps or leaves out one layer (`layer`, in a message): on where the file holds `key`."""
    shape = _shape_of(component, key)
    return Seen(field, shape is not None, f"{key} {list(shape)}" if shape is not None else f"no {layer}")


def _blocks(component, side: str, name: str) -> int:
    pattern = re.compile(rf"{side}\.{name}\.(\d+)\.")
    return 1 + max((int(match[1]) for key in component.keys if (match := pattern.match(key))), default=-1)


def vae_seen(component) -> list[Seen]:
    """The VAE's fields its weights show: channels, block counts, layers per block, and which optional layers it has
    (quant_conv, post_quant_conv, the mid blocks' attention). A decoder-only file shows nothing of the encoder."""
    decoder = {key: tuple(component.tensor(key).shape) for key in component.keys if key.startswith("decoder.")}
    inferred = config_from_shapes(decoder, {})
    config = component.config or {}
    # The decoder's channels are decoder_block_out_channels where the config gives them, else block_out_channels.
    split = config.get("decoder_block_out_channels") is not None
    seen = [Seen("decoder_block_out_channels" if split and field == "block_out_channels" else field, inferred[field],
                 f"{_shown(inferred[field])} (the decoder's tensors)")
            for field in ("block_out_channels", "layers_per_block", "latent_channels") if field in inferred]
    ups = _blocks(component, "decoder", "up_blocks")
    if ups:
        seen.append(Seen("up_block_types", ups, f"{ups} up blocks (decoder.up_blocks.0 to {ups - 1})", counts=True))
    seen.append(_held(component, "use_post_quant_conv", "post_quant_conv.weight", "post_quant_conv.*"))
    seen.append(_held(component, "mid_block_add_attention", "decoder.mid_block.attentions.0.to_q.weight",
                      "decoder.mid_block.attentions.* (the mid block's attention)"))
    downs = _blocks(component, "encoder", "down_blocks")
    if downs:
        seen.append(Seen("down_block_types", downs, f"{downs} down blocks (encoder.down_blocks.0 to {downs - 1})",
                         counts=True))
        seen.append(_held(component, "use_quant_conv", "quant_conv.weight", "quant_conv.*"))
        if split:
            outs = [tuple(component.tensor(f"encoder.down_blocks.{i}.resnets.0.conv1.weight").shape)[0]
                    for i in range(downs) if f"encoder.down_blocks.{i}.resnets.0.conv1.weight" in component.keys]
            seen.append(Seen("block_out_channels", outs, f"{outs} (the encoder's tensors)"))
    return seen + _dims(component, (("out_channels", "decoder.conv_out.weight", 0),
                                    ("in_channels", "encoder.conv_in.weight", 1)))


def _dit_defaults() -> dict[str, Any]:
    from .dit import DiTConfig

    return {field.name: field.default for field in dataclasses.fields(DiTConfig)}


def _vae_defaults() -> dict[str, Any]:
    from .libraries import AutoencoderKLFlux2

    parameters = inspect.signature(AutoencoderKLFlux2.__init__).parameters
    return {name: parameter.default for name, parameter in parameters.items()
            if parameter.default is not inspect.Parameter.empty}


def _text_defaults() -> dict[str, Any]:
    from .libraries import MistralConfig

    return MistralConfig().to_dict()


def _pe_defaults() -> dict[str, Any]:
    from .libraries import Ministral3Config

    return Ministral3Config().to_dict()


@dataclass(frozen=True)
class Part:
    what: str  # the part's name in a message
    seen: Callable[[Any], list[Seen]]
    defaults: Callable[[], dict[str, Any]]  # what the part's class takes for a field its config lacks
    released: Callable[[Variant], dict[str, Any]]
    unseen: tuple[str, ...]  # fields no shape shows: the released model's, beside the released model's weights


PARTS: dict[str, Part] = {
    "dit": Part("transformer", dit_fields_from_shapes, _dit_defaults, lambda variant: load_config(variant, "transformer"),
                ("rope_theta", "rope_axes_dim", "eps")),
    "text_encoder": Part("text encoder", lambda c: text_seen(c, whole_file_layers=False), _text_defaults,
                         lambda variant: load_config(variant, "text_encoder")["text_config"],
                         ("num_attention_heads", "num_key_value_heads", "head_dim", "rms_norm_eps")),
    "pe": Part("prompt enhancer", lambda c: text_seen(c, whole_file_layers=True), _pe_defaults,
               lambda variant: load_config(variant, "pe"),
               ("num_attention_heads", "num_key_value_heads", "head_dim", "rms_norm_eps")),
    "vae": Part("VAE", vae_seen, _vae_defaults, lambda variant: load_config(variant, "vae"), ("norm_num_groups",)),
}


def _shown(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    return shown_shortly(str(list(value)) if isinstance(value, (list, tuple)) else str(value))


def _shown_given(value: Any, seen: Seen) -> str:
    """A config's value in a message; a list whose length is what differs, with its length."""
    if seen.counts and isinstance(value, (list, tuple)):
        return f"{_shown(value)} ({len(value)} block{'' if len(value) == 1 else 's'})"
    return _shown(value)


def _is_size(value: Any) -> bool:
    """A number or a list of numbers: a value of another type is damage, which building the part names."""
    values = value if isinstance(value, (list, tuple)) else [value]
    return all(isinstance(item, (int, float)) and not isinstance(item, bool) for item in values)


def _same(value: Any, other: Any) -> bool:
    if isinstance(value, (list, tuple)) and isinstance(other, (list, tuple)):
        return list(value) == list(other)
    return value == other


def _comparable(value: Any, seen: Seen) -> bool:
    """A value of the type the weights can be held against: anything else is damage, which building the part names."""
    if seen.counts:
        return isinstance(value, (list, tuple))
    if isinstance(seen.value, bool):
        return isinstance(value, bool)
    return _is_size(value)


def _fits(value: Any, seen: Seen) -> bool:
    if seen.counts:
        return isinstance(value, (list, tuple)) and len(value) == seen.value
    if isinstance(seen.value, bool) or isinstance(value, bool):
        return value is seen.value
    return _same(value, seen.value) or any(_same(value, also) for also in seen.also)


def given_config(component) -> Optional[tuple[str, str]]:
    """(the config's name in a message, the fix: config_json.config_origin) for a config that came with the weights
    (a config.json, or one embedded in the file's metadata); None for one inferred from the weights or the released
    one."""
    if getattr(component, "config_file", None) is None and (
            component.config is None or "config" not in getattr(component, "metadata", {})):
        return None
    return config_origin(component)


def check_config_fits(component, kind: str, variant: Variant = "base") -> None:
    """Refuse, in one line naming the config, the field and what the weights hold, a config that came with the
    weights and does not fit them (module docstring). Only shapes are read: no weight."""
    given = given_config(component)
    if given is None:
        return
    origin, fix = given
    part = PARTS[kind]
    nested = kind == "text_encoder" and isinstance(component.config.get("text_config"), dict)
    section = component.config["text_config"] if nested else component.config
    prefix = "text_config." if nested else ""
    seen = part.seen(component)
    defaults: Optional[dict[str, Any]] = None
    for item in seen:
        if item.field in section:
            if _comparable(section[item.field], item) and not _fits(section[item.field], item):
                raise ModelFileError(f"{origin} says {prefix}{item.field} {_shown_given(section[item.field], item)} "
                                     f"but the weights hold {item.evidence}: {fix}")
            continue
        defaults = part.defaults() if defaults is None else defaults
        if not _fits(defaults.get(item.field), item):
            raise ModelFileError(f"{origin} has no {prefix}{item.field}, and the weights hold {item.evidence}: {fix}")
    released = part.released(variant)
    if seen and all(_fits(released.get(item.field), item) for item in seen):
        for field in part.unseen:
            if field in section and not _same(section[field], released.get(field)):
                raise ModelFileError(f"{origin} says {prefix}{field} {_shown(section[field])} but the weights are the "
                                     f"released ERNIE-Image {part.what}'s, whose {field} is "
                                     f"{_shown(released.get(field))}: {fix}")
