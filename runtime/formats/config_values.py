"""The values a part's config gives, checked as the config is read: sizes are positive whole numbers (or lists of
them), epsilons and RoPE bases positive finite numbers, switches true or false.

A value out of range builds a model that runs to NaN (a negative eps: then blamed on the weights) or fails later
with another error; a field's value is refused instead in one line naming the config, the field, the value and the
fix, before any weight is read. Whether the sizes fit the weights is model/config_fit.py's check, after this one.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Any, Callable

from ..core.errors import ModelFileError


def _whole(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


def _wholes(value: Any) -> bool:
    return isinstance(value, (list, tuple)) and bool(value) and all(_whole(item) for item in value)


def _finite(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and value > 0


@dataclass(frozen=True)
class Rule:
    wanted: str  # what the field must be, in a message
    accepts: Callable[[Any], bool]


SIZE = Rule("a positive whole number", _whole)
SIZES = Rule("a list of positive whole numbers", _wholes)
SIZE_OR_SIZES = Rule("a positive whole number or a list of them", lambda value: _whole(value) or _wholes(value))
SIZE_OR_NULL = Rule("a positive whole number or null", lambda value: value is None or _whole(value))
POSITIVE = Rule("a positive finite number", _finite)
FLAG = Rule("true or false", lambda value: isinstance(value, bool))  # a string "false" would read as true

# The text encoder's (in its text_config) and the prompt enhancer's Mistral fields; head_dim and num_key_value_heads
# may be null (transformers then derives them).
TEXT_RULES: dict[str, Rule] = {
    **dict.fromkeys(("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "vocab_size",
                     "max_position_embeddings"), SIZE),
    **dict.fromkeys(("num_key_value_heads", "head_dim"), SIZE_OR_NULL),
    **dict.fromkeys(("rms_norm_eps", "rope_theta"), POSITIVE),
}
RULES: dict[str, dict[str, Rule]] = {
    "dit": {
        **dict.fromkeys(("hidden_size", "num_attention_heads", "num_layers", "ffn_hidden_size", "in_channels",
                         "out_channels", "patch_size", "text_in_dim"), SIZE),
        "rope_axes_dim": SIZES,
        **dict.fromkeys(("rope_theta", "eps"), POSITIVE),
        "qk_layernorm": FLAG,
    },
    "vae": {
        **dict.fromkeys(("in_channels", "out_channels", "latent_channels", "layers_per_block", "norm_num_groups"),
                        SIZE),
        "block_out_channels": SIZES,
        **dict.fromkeys(("sample_size", "patch_size"), SIZE_OR_SIZES),
        "batch_norm_eps": POSITIVE,
        **dict.fromkeys(("use_quant_conv", "use_post_quant_conv", "mid_block_add_attention"), FLAG),
    },
    "text_encoder": TEXT_RULES,
    "pe": TEXT_RULES,
}


def check_config_values(config: dict[str, Any], kind: str, origin: str, fix: str) -> None:
    """Refuse the first field of part `kind`'s config ("dit", "vae", "text_encoder", "pe") whose value its rule does
    not accept, in one line: `origin` says which config (config_json.origin_of), `fix` what to do."""
    nested = kind in ("text_encoder", "pe") and isinstance(config.get("text_config"), dict)
    section = config["text_config"] if nested else config
    for field, rule in RULES[kind].items():
        if field in section and not rule.accepts(section[field]):
            name = f"text_config.{field}" if nested else field
            raise ModelFileError(f"{origin} says {name} {json.dumps(section[field])}, which is not {rule.wanted}: "
                                 f"{fix}")
