"""The tensors a part's config builds (on the meta device) held against the tensors its file holds: names and shapes.

config_fit.py holds the fields the weights show against the config before the part is built; this check catches
what is left, on the part as built: a tensor the config makes that the file lacks (filling it would fail at the
first use, for the VAE after a whole sampling run), a tensor the file holds that the config makes no place for
(never read: the picture would come from another model than the file's), and a tensor in another shape. Names are
compared after the readers' own renames (formats/component_file.py: BFL VAE keys, prefixes), so every layout is
held to the same rule. Each refusal is one line naming the config, the first few tensors, the config field most
likely responsible where one is, and the fix; tensors missing only where the weights' other layers hold them are the
file's damage, and the file is named instead. Only names and shapes are read: no weight.
"""
from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any, Callable, Container, Iterable, Mapping, Optional

from ..core.errors import ModelFileError
from ..core.phrases import counted
from ..files.cut_files import REDOWNLOAD
from ..formats.component_file import LABELS
from ..formats.config_json import config_origin
from ..formats.detect import adapter_key, sample_keys
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

# Fields that decide whether tensors exist, not their shapes: the only likely causes of a tensor missing or unplaced.
PRESENCE_FIELDS = frozenset({"use_post_quant_conv", "use_quant_conv", "mid_block_add_attention", "down_block_types",
                             "up_block_types", "qk_layernorm", "num_layers", "num_hidden_layers",
                             "tie_word_embeddings"})

# Fields that make whole layers, counted: the likely cause only of layers missing from the top or made for none.
LAYER_COUNTS = frozenset({"num_layers", "num_hidden_layers"})
LAYER = re.compile(r"^layers\.(\d+)\.")

SHOWN_KEYS = 3


def _section(component, kind: str) -> tuple[dict, str]:
    """The part's fields in its config, and how a message names them (the text encoder's under text_config)."""
    config = component.config or {}
    if kind == "text_encoder" and isinstance(config.get("text_config"), dict):
        return config["text_config"], "text_config."
    return config, ""


def _likely_field(component, kind: str, keys: list[str], shapes_only: bool = False,
                  counted: Container[str] = ()) -> str:
    """' (its FIELD VALUE is the likely cause)' for the first of `keys` a field of the part's config explains: the
    fields the config gives, else the first one, left at its default. A tensor missing or unplaced is explained only
    by a field in PRESENCE_FIELDS, and by a layer count only where it is `counted` (_counted_layers); a tensor in
    another shape (`shapes_only`) only by another field."""
    section, prefix = _section(component, kind)
    for key in keys:
        for pattern, all_fields in LIKELY_FIELDS.get(kind, ()):
            fields = tuple(field for field in all_fields if (field in PRESENCE_FIELDS) != shapes_only
                           and (field not in LAYER_COUNTS or key in counted))
            if fields and re.search(pattern, key):
                given = [f"{prefix}{field} {_json(section[field])}" for field in fields
                         if section.get(field) is not None]
                if not given:
                    return f" (its {prefix}{fields[0]}, left at the default, is the likely cause)"
                return f" (its {' or '.join(given)} is the likely cause)"
    return ""


def _layer(key: str) -> Optional[int]:
    match = LAYER.match(key)
    return int(match[1]) if match else None


def _counted_layers(lacking: set[str], unplaced: set[str], made: Iterable[str], held: Iterable[str]) -> set[str]:
    """The tensors of `lacking` and `unplaced` a layer count explains: of layers above the last one the weights hold,
    and of layers the config makes none of. A tensor missing from a layer the weights hold (or below one) is not the
    count's doing, nor is one the config leaves out of a layer it makes."""
    top = max((index for index in map(_layer, held) if index is not None), default=-1)
    made_layers = {_layer(key) for key in made}
    return ({key for key in lacking if (index := _layer(key)) is not None and index > top}
            | {key for key in unplaced if _layer(key) is not None and _layer(key) not in made_layers})


def _gaps(lacking: set[str], held: set[str]) -> bool:
    """Every tensor of `lacking` is one the weights hold in another layer (`layers.1.x` missing, `layers.0.x` there):
    the weights lost it, whatever the config says."""
    kinds = {LAYER.sub("layers.N.", key) for key in held if LAYER.match(key)}
    return all(LAYER.match(key) and LAYER.sub("layers.N.", key) in kinds for key in lacking)


def _lost_from_held_layers(lacking: set[str], held: set[str]) -> bool:
    """Every tensor of `lacking` is of a layer the weights hold other tensors of, and of a kind their other layers
    hold: lost from the file, whichever field would otherwise seem to leave it out (every layer of a part makes the
    same tensors)."""
    held_layers = {_layer(key) for key in held} - {None}
    return all(_layer(key) in held_layers for key in lacking) and _gaps(lacking, held)


def _lacking_file(component, lacking: set[str]) -> Path:
    """The file `lacking` is missing from: the one holding the rest of their layers, else the part's one file; the
    part's folder where those are in several files."""
    layers = tuple(match[0] for match in map(LAYER.match, lacking) if match)
    near = [key for key in component.keys if key.startswith(layers)] or component.keys
    files = {Path(_stored_in(component, key)) for key in near}
    return files.pop() if len(files) == 1 else Path(component.path)


def _holding_file(component, keys: set[str]) -> Path:
    """The one file holding `keys`, else the part's folder."""
    files = {Path(_stored_in(component, key)) for key in keys}
    return files.pop() if len(files) == 1 else Path(component.path)


def _tell_unread(component, kind: str, unplaced: set[str]) -> None:
    """A line (the component's notice) for tensors a file without a config of its own holds beyond the part: they
    are not read (the part is built from the released config, which makes no place for them)."""
    line = (f"{Path(component.path).name} holds {counted(len(unplaced), 'tensor')} no {LABELS[kind]} has "
            f"({_listed(unplaced)}): they are not read")
    if hasattr(component, "notices") and line not in component.notices:
        component.notices = (*component.notices, line)


def _stored_in(component, key: str) -> Path:
    stored_as = getattr(component, "stored_as", None)
    return stored_as(key)[0] if stored_as is not None else component.path


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
    refuse_adapter_tensors(component, kind, keys)
    lacking = {key for key in made if key not in keys and not may_lack(key)}
    unplaced = {key for key in keys if key not in made and not may_hold(key)}
    if unplaced and not given:
        _tell_unread(component, kind, unplaced)
        unplaced = set()
    if lacking or unplaced:
        what = []
        if lacking:
            what.append(f"it makes {_listed(lacking)}, which the weights lack")
        if unplaced:
            what.append(f"the weights hold {_listed(unplaced)}, for which it makes no place")
        likely = _likely_field(component, kind, sorted(lacking) + sorted(unplaced),
                               counted=_counted_layers(lacking, unplaced, made, keys))
        if lacking and not unplaced and (_lost_from_held_layers(lacking, keys) or not likely and _gaps(lacking, keys)):
            raise ModelFileError(f"{_lacking_file(component, lacking)} lacks {_listed(lacking)}, which the "
                                 f"config makes and the weights' other layers hold: {REDOWNLOAD}")
        if unplaced and not lacking and not likely:  # no field of the config makes such tensors: the file holds more
            raise ModelFileError(f"{_holding_file(component, unplaced)} holds {_listed(unplaced)}, which no "
                                 f"{LABELS[kind]} has: save the weights without them, or re-download them")
        raise ModelFileError(f"{origin} does not fit the weights: {'; '.join(what)}{likely}: {fix}")
    if component.quantized:
        return  # packed files keep their own layouts: their fill checks them
    for key, shape in made.items():
        held = _file_shape(component, key) if key in keys else None
        if held is not None and held != tuple(shape):
            raise ModelFileError(f"{origin} does not fit the weights: it makes {key} {list(shape)} but the weights "
                                 f"hold {list(held)}{_likely_field(component, kind, [key], shapes_only=True)}: {fix}")


def refuse_sparse_layers(component) -> None:
    """A layer holding fewer than half the tensors the part's fullest layer holds is not a layer that lost a tensor
    or two (check_built_tensors names those) but stray tensors, or a file pieced together: the layer count the
    weights show would count it, and the config would be blamed for the file's damage. Refused naming the file."""
    kinds: dict[int, set[str]] = {}
    for key in component.keys:
        match = LAYER.match(key)
        if match:
            kinds.setdefault(int(match[1]), set()).add(key[match.end():])
    fullest = max(map(len, kinds.values()), default=0)
    sparse = sorted(index for index, held in kinds.items() if 2 * len(held) < fullest)
    if sparse:
        index = sparse[0]
        keys = {f"layers.{index}.{kind}" for kind in kinds[index]}
        others = sparse[1:]
        also = (f" (so does layer {others[0]})" if len(others) == 1 else
                f" (so do layers {', '.join(map(str, others))})" if others else "")
        raise ModelFileError(f"{_holding_file(component, keys)} holds {_listed(keys)} of a layer {index} that lacks "
                             f"{fullest - len(keys)} of the {fullest} tensors its fullest layer holds{also}: stray "
                             "tensors, or the file is damaged: download it again, or save the weights without them")


def refuse_adapter_tensors(component, kind: str, keys: Iterable[str]) -> None:
    """A part's file holding a LoRA's tensors beside its weights (an adapter saved into the model, unmerged) is
    refused, whatever its config: they would never be applied, and the picture would come without the LoRA."""
    adapters = {key: None for key in keys if adapter_key(key)}
    if adapters:
        raise ModelFileError(f"{component.path.name} holds {counted(len(adapters), 'LoRA tensor')} "
                             f"({sample_keys(adapters, 2)}{', ...' if len(adapters) > 2 else ''}) beside the "
                             f"{LABELS[kind]}'s weights, where a LoRA is never "
                             "applied: load the LoRA from a file of its own, or merge it into the weights and save "
                             "them without it")


def shapes_of(module) -> dict[str, Shape]:
    """A module's tensors (parameters and persistent buffers) by name: what its config makes."""
    return {key: tuple(tensor.shape) for key, tensor in module.state_dict().items()}
