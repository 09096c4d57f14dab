"""The tensors a part's config builds (on the meta device) held against the tensors its file holds: names and shapes.

config_fit.py holds the fields the weights show against the config before the part is built; this check catches
what is left, on the part as built: a tensor the config makes that the file lacks (filling it would fail at the
first use, for the VAE after a whole sampling run), a tensor the file holds that the config makes no place for
(never read: the picture would come from another model than the file's), and a tensor in another shape. Names are
compared after the readers' own renames (formats/component_file.py: BFL VAE keys, prefixes), so every layout is
held to the same rule. Each refusal is one line naming the config, the first few tensors, the config field most
likely responsible where one is, and the fix. Only names and shapes are read: no weight.
"""
from __future__ import annotations

import json
import re
from typing import Any, Callable, Mapping, Optional

from ..core.errors import ModelFileError
from ..formats.config_json import config_origin
from ..formats.detect import sample_keys
from .config_fit import given_config

Shape = tuple[int, ...]

# Per part: (a tensor name pattern, the config fields that make, leave out or size such tensors), most specific first.
LIKELY_FIELDS: dict[str, tuple[tuple[str, tuple[str, ...]], ...]] = {
    "vae": (
        (r"^post_quant_conv\.", ("use_post_quant_conv",)),
        (r"^quant_conv\.", ("use_quant_conv",)),
        (r"^(en|de)coder\.mid_block\.attentions\.", ("mid_block_add_attention",)),
        (r"^bn\.", ("patch_size",)),  # latent_channels is config_fit's
        (r"^encoder\.down_blocks\.", ("down_block_types",)),  # their counts and channels are config_fit's
        (r"^decoder\.up_blocks\.", ("up_block_types",)),
    ),
    "dit": (
        (r"\.self_attention\.norm_[qk]\.", ("qk_layernorm",)),
        (r"^text_proj\.", ("text_in_dim",)),
        (r"^layers\.", ("num_layers",)),
    ),
    "text_encoder": (
        (r"\.self_attn\.[qo]_proj\.", ("num_attention_heads", "head_dim")),
        (r"\.self_attn\.[kv]_proj\.", ("num_key_value_heads", "head_dim")),
        (r"^layers\.", ("num_hidden_layers",)),
    ),
}
LIKELY_FIELDS["pe"] = ((r"^lm_head\.", ("tie_word_embeddings",)), *LIKELY_FIELDS["text_encoder"])

# Fields that decide whether tensors exist, not their shapes: a likely cause of a tensor missing or unplaced only.
PRESENCE_FIELDS = frozenset({"use_post_quant_conv", "use_quant_conv", "mid_block_add_attention", "down_block_types",
                             "up_block_types", "qk_layernorm", "num_layers", "num_hidden_layers",
                             "tie_word_embeddings"})

SHOWN_KEYS = 3


def _section(component, kind: str) -> tuple[dict, str]:
    """The part's fields in its config, and how a message names them (the text encoder's under text_config)."""
    config = component.config or {}
    if kind == "text_encoder" and isinstance(config.get("text_config"), dict):
        return config["text_config"], "text_config."
    return config, ""


def _likely_field(component, kind: str, keys: list[str], shapes_only: bool = False) -> str:
    """' (its FIELD VALUE is the likely cause)' for the first of `keys` a field of the part's config explains: the
    fields the config gives, else the first one, left at its default. `shapes_only`: for a tensor in another shape,
    which no field in PRESENCE_FIELDS explains."""
    section, prefix = _section(component, kind)
    for key in keys:
        for pattern, all_fields in LIKELY_FIELDS.get(kind, ()):
            fields = tuple(field for field in all_fields if not (shapes_only and field in PRESENCE_FIELDS))
            if fields and re.search(pattern, key):
                given = [f"{prefix}{field} {_json(section[field])}" for field in fields
                         if section.get(field) is not None]
                if not given:
                    return f" (its {prefix}{fields[0]}, left at the default, is the likely cause)"
                return f" (its {' or '.join(given)} is the likely cause)"
    return ""


def _json(value: Any) -> str:
    try:
        return json.dumps(value)
    except (TypeError, ValueError):
        return repr(value)


def _listed(keys: set[str]) -> str:
    shown = sample_keys(keys, SHOWN_KEYS)
    return shown + (f" ({len(keys)} tensors in all)" if len(keys) > SHOWN_KEYS else "")


def _file_shape(component, key: str) -> Optional[Shape]:
    shape = getattr(component.tensor(key), "shape", None)
    return tuple(shape) if shape is not None else None


def check_built_tensors(component, kind: str, made: Mapping[str, Shape],
                        may_lack: Callable[[str], bool] = lambda key: False,
                        may_hold: Callable[[str], bool] = lambda key: False) -> None:
    """Refuse, in one line (module docstring), a part whose config makes tensors (`made`: name -> shape, the part
    built on the meta device) that its file lacks, or in another shape, or that leaves out tensors its file holds.
    `may_lack`: tensors the file may lack (a decoder-only VAE's encoder); `may_hold`: tensors the file may hold that
    the part never uses (the text encoder's last layer). Tensors the config makes no place for are refused only for
    a config that came with the weights: where the config is inferred or the released one, the file is as it was
    made, and what it holds beyond the part was never the config's to describe."""
    origin, fix = config_origin(component)
    given = given_config(component) is not None
    keys = set(component.keys)
    lacking = {key for key in made if key not in keys and not may_lack(key)}
    unplaced = {key for key in keys if key not in made and not may_hold(key)} if given else set()
    if lacking or unplaced:
        what = []
        if lacking:
            what.append(f"it makes {_listed(lacking)}, which the weights lack")
        if unplaced:
            what.append(f"the weights hold {_listed(unplaced)}, for which it makes no place")
        likely = _likely_field(component, kind, sorted(lacking) + sorted(unplaced))
        raise ModelFileError(f"{origin} does not fit the weights: {'; '.join(what)}{likely}: {fix}")
    if component.quantized:
        return  # packed files keep their own layouts: their fill checks them
    for key, shape in made.items():
        held = _file_shape(component, key) if key in keys else None
        if held is not None and held != tuple(shape):
            raise ModelFileError(f"{origin} does not fit the weights: it makes {key} {list(shape)} but the weights "
                                 f"hold {list(held)}{_likely_field(component, kind, [key], shapes_only=True)}: {fix}")


def shapes_of(module) -> dict[str, Shape]:
    """A module's tensors (parameters and persistent buffers) by name: what its config makes."""
    return {key: tuple(tensor.shape) for key, tensor in module.state_dict().items()}
