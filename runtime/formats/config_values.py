"""The values a part's config gives, checked as the config is read: sizes are positive whole numbers (or lists of
them), epsilons positive finite numbers, RoPE bases finite numbers above 1, switches true or false, and the text
configs' RoPE parameters what their rope type needs (rope_values.py).

A value out of range builds a model that runs to NaN (a negative eps, a RoPE factor of 0: then blamed on the
weights) or fails later with another error; a field's value is refused instead in one line naming the config, the
field by its dotted path, the value and the fix, before any weight is read. Whether the sizes fit the weights is
model/config_fit.py's check, after this one. Fields no rule names are left alone.
"""
from __future__ import annotations

from typing import Any, Optional

from .rope_values import rope_fault
from .value_rules import EVEN_SIZE, FLAG, POSITIVE, ROPE_BASE, SIZE, SIZE_OR_SIZES, SIZES, Fault, Rule

# ERNIE's rotary embedding has three axes (text position, row, column), each rotated in pairs of channels.
ROPE_AXES = Rule("a list of three positive even whole numbers",
                 lambda value: isinstance(value, (list, tuple)) and len(value) == 3
                 and all(SIZE.accepts(item) and item % 2 == 0 for item in value))
TEXT_SECTION = Rule("a JSON object", lambda value: isinstance(value, dict))

# The text encoder's (in its text_config) and the prompt enhancer's Mistral fields; head_dim and num_key_value_heads
# may be null (transformers then derives them). The whole head is rotated (rope_values.WHOLE_HEAD), so it is even.
TEXT_RULES: dict[str, Rule] = {
    **dict.fromkeys(("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "vocab_size",
                     "max_position_embeddings"), SIZE),
    "num_key_value_heads": SIZE.or_null(),
    "head_dim": EVEN_SIZE.or_null(),
    "rms_norm_eps": POSITIVE,
    "rope_theta": ROPE_BASE,
}
RULES: dict[str, dict[str, Rule]] = {
    "dit": {
        **dict.fromkeys(("hidden_size", "num_attention_heads", "num_layers", "ffn_hidden_size", "in_channels",
                         "out_channels", "patch_size", "text_in_dim"), SIZE),
        "rope_axes_dim": ROPE_AXES,
        "rope_theta": ROPE_BASE,
        "eps": POSITIVE,
        "qk_layernorm": FLAG,  # a string "false" would read as true
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
TEXT_KINDS = ("text_encoder", "pe")


def config_fault(config: dict[str, Any], kind: str) -> Optional[Fault]:
    """The first field of part `kind`'s config ("dit", "vae", "text_encoder", "pe") whose value is out of range,
    or None."""
    section, prefix = config, ""
    if kind in TEXT_KINDS and "text_config" in config:  # the text encoder's Mistral3 config: the tower's own inside
        if not TEXT_SECTION.accepts(config["text_config"]):
            return Fault("text_config", config["text_config"], TEXT_SECTION.wanted)
        section, prefix = config["text_config"], "text_config."
    for field, rule in RULES[kind].items():
        if field in section and not rule.accepts(section[field]):
            return Fault(prefix + field, section[field], rule.wanted)
    if kind in TEXT_KINDS:
        return _derived_head_fault(section, prefix) or rope_fault(section, prefix, kind)
    return None


def _derived_head_fault(section: dict[str, Any], prefix: str) -> Optional[Fault]:
    """A text config without head_dim: transformers takes hidden_size // num_attention_heads, which must be even."""
    hidden, heads = section.get("hidden_size"), section.get("num_attention_heads")
    if section.get("head_dim") is not None or hidden is None or heads is None or (hidden // heads) % 2 == 0:
        return None
    return Fault(prefix + "num_attention_heads", heads, EVEN_SIZE.wanted,
                 broken=f"with {prefix}hidden_size {hidden} and no {prefix}head_dim makes heads of "
                        f"{hidden // heads} channels, which is not even (RoPE rotates channels in pairs)")


def check_config_values(config: dict[str, Any], kind: str, origin: str, fix: str) -> None:
    """Refuse the first field of part `kind`'s config whose value its rule does not accept, in one line: `origin`
    says which config (config_json.origin_of), `fix` what to do."""
    fault = config_fault(config, kind)
    if fault is not None:
        raise fault.error(origin, fix)
