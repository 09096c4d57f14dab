"""The rotary-embedding (RoPE) fields of a Mistral-family text config, the text encoder's `text_config` or the
prompt enhancer's config, checked as the config is read.

transformers builds the rotary tables from `rope_parameters` (or the older `rope_scaling`) with the function its
`rope_type` names (modeling_rope_utils.ROPE_INIT_FUNCTIONS) and only warns about a value out of range: a `factor` of
0 or NaN, a `rope_theta` of 0, a `beta_fast` of NaN build tables of NaN, and the text encoder's output is then blamed
on its weights. Each field the config's rope type reads is held to its rule here; fields it does not read are left
alone, as transformers leaves them.
"""
from __future__ import annotations

from typing import Any, Optional

from .value_rules import (AT_LEAST_ZERO, FLAG, MISSING, OBJECT_OR_NULL, POSITIVE, POSITIVES, ROPE_BASE, SIZE, Fault,
                          Rule, finite)

# Mistral and Ministral3 rotate the whole head: a rope type that rotates a part of it leaves cos/sin narrower than
# the heads they multiply.
WHOLE_HEAD = Rule("1 (this model rotates the whole head)", lambda value: finite(value) and value == 1)
FRACTION = Rule("a finite number > 0 and <= 1", lambda value: finite(value) and 0 < value <= 1)
_BASE_FIELDS: dict[str, Rule] = {"rope_theta": ROPE_BASE, "partial_rotary_factor": WHOLE_HEAD}
_SCALED_FIELDS: dict[str, Rule] = {**_BASE_FIELDS, "original_max_position_embeddings": SIZE}

# The fields each rope type reads (transformers' modeling_rope_utils._compute_<type>_parameters), and those it
# cannot do without. rope_theta and original_max_position_embeddings have defaults (the config's top-level
# rope_theta, max_position_embeddings); a yarn or longrope factor of null is derived from the context lengths.
READS: dict[str, dict[str, Rule]] = {
    "default": {"rope_theta": ROPE_BASE},
    "linear": {**_BASE_FIELDS, "factor": POSITIVE},
    "dynamic": {**_BASE_FIELDS, "factor": POSITIVE},
    "yarn": {**_SCALED_FIELDS, "factor": POSITIVE.or_null(), "attention_factor": POSITIVE.or_null(),
             "beta_fast": POSITIVE.or_null(), "beta_slow": POSITIVE.or_null(), "mscale": AT_LEAST_ZERO.or_null(),
             "mscale_all_dim": AT_LEAST_ZERO.or_null(), "truncate": FLAG.or_null()},
    "longrope": {**_SCALED_FIELDS, "factor": POSITIVE.or_null(), "attention_factor": POSITIVE.or_null(),
                 "short_factor": POSITIVES, "long_factor": POSITIVES},
    "llama3": {**_SCALED_FIELDS, "factor": POSITIVE, "low_freq_factor": POSITIVE, "high_freq_factor": POSITIVE},
    "proportional": {"rope_theta": ROPE_BASE, "partial_rotary_factor": FRACTION, "factor": POSITIVE},
}
NEEDS: dict[str, tuple[str, ...]] = {
    "linear": ("factor",),
    "dynamic": ("factor",),
    "yarn": ("factor",),
    "longrope": ("short_factor", "long_factor"),
    "llama3": ("factor", "low_freq_factor", "high_freq_factor"),
}
# Ministral3's attention (the prompt enhancer) scales its queries by 1 + beta * log(1 + floor(position / span)),
# beta and span read from the rope parameters whatever the rope type.
PE_READS: dict[str, Rule] = {"llama_4_scaling_beta": AT_LEAST_ZERO, "original_max_position_embeddings": SIZE}
_SPAN_DEFAULTED = ("yarn", "longrope", "llama3")  # transformers fills original_max_position_embeddings in for these


def rope_types() -> tuple[str, ...]:
    """The rope types the installed transformers builds ("default" and its ROPE_INIT_FUNCTIONS)."""
    try:
        from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    except ImportError:
        return tuple(sorted(READS))
    return tuple(sorted({"default", *ROPE_INIT_FUNCTIONS}))


def rope_fault(section: dict[str, Any], prefix: str, kind: str) -> Optional[Fault]:
    """The first RoPE field of a text config `section` (at dotted path `prefix`: "" or "text_config.") its rope type
    reads whose value is out of range, or None. `kind`: "text_encoder" or "pe" (the PE's attention reads more)."""
    for name in ("rope_scaling", "rope_parameters"):
        if name in section and not OBJECT_OR_NULL.accepts(section[name]):
            return Fault(prefix + name, section[name], OBJECT_OR_NULL.wanted)
    # transformers: `rope_scaling or rope_parameters`; with neither, Ministral3 its own (sound) defaults.
    name = "rope_scaling" if section.get("rope_scaling") else "rope_parameters"
    params = section.get(name)
    if params is None:
        return None
    path = f"{prefix}{name}."
    type_field = "rope_type" if "rope_type" in params else "type"
    rope_type = params.get(type_field, "default")
    known = rope_types()
    if not isinstance(rope_type, str) or rope_type not in known:
        return Fault(path + type_field, rope_type, "one of " + ", ".join(f'"{known_type}"' for known_type in known))
    reads = READS.get(rope_type, {"rope_theta": ROPE_BASE})
    fields = {**params}
    if "partial_rotary_factor" not in fields and "partial_rotary_factor" in section:
        fields["partial_rotary_factor"] = section["partial_rotary_factor"]  # transformers' default for the dict's
    reader = f'rope_type "{rope_type}"'
    for field in NEEDS.get(rope_type, ()):
        if field not in fields:
            return Fault(path + field, MISSING, reads[field].wanted, reader)
    for field, rule in reads.items():
        if field in fields and not rule.accepts(fields[field]):
            where = path if field in params else prefix  # the top-level partial_rotary_factor
            return Fault(where + field, fields[field], rule.wanted)
    if kind == "pe":
        for field, rule in PE_READS.items():
            if field not in fields:
                if field == "original_max_position_embeddings" and rope_type in _SPAN_DEFAULTED:
                    continue
                return Fault(path + field, MISSING, rule.wanted, "the prompt enhancer's attention")
            if not rule.accepts(fields[field]):
                return Fault(path + field, fields[field], rule.wanted)
    return _order_fault(fields, path, rope_type, section)


def _order_fault(fields: dict[str, Any], path: str, rope_type: str, section: dict[str, Any]) -> Optional[Fault]:
    """The rope type's fields that must stand in an order to each other, or its lists' lengths, when they do not."""
    if rope_type == "yarn":
        fast, slow = fields.get("beta_fast") or 32, fields.get("beta_slow") or 1  # transformers' defaults
        if fast < slow and fields.get("beta_fast"):
            slow_name = f"{path}beta_slow" if fields.get("beta_slow") else "the default beta_slow"
            return Fault(path + "beta_fast", fast, f"at least {slow_name} ({slow:g})")
        if fast < slow:
            return Fault(path + "beta_slow", slow, f"at most the default beta_fast ({fast:g})")
    if rope_type == "llama3" and fields["high_freq_factor"] <= fields["low_freq_factor"]:
        return Fault(path + "high_freq_factor", fields["high_freq_factor"],
                     f"above {path}low_freq_factor ({fields['low_freq_factor']:g})")
    if rope_type == "longrope":
        head_dim = _head_dim(section)
        for field in ("short_factor", "long_factor"):
            if head_dim is not None and len(fields[field]) != head_dim // 2:
                return Fault(path + field, fields[field],
                             f"a list of {head_dim // 2} numbers (half the head size, {head_dim})")
    return None


def _head_dim(section: dict[str, Any]) -> Optional[int]:
    head_dim = section.get("head_dim")
    if head_dim:
        return head_dim
    hidden, heads = section.get("hidden_size"), section.get("num_attention_heads")
    return hidden // heads if hidden and heads else None
