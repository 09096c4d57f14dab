"""A RoPE value out of range in a part's config (the text encoder's and the prompt enhancer's `rope_parameters`, or
the older `rope_scaling`, at the top of the config or inside its `text_config`; the DiT's `rope_theta` and
`rope_axes_dim`) is refused in one line as the config is read, naming the config, the field by its dotted path, the
value and the fix, before any weight is read: never run to NaN and blamed on the weights. Fields the config's rope
type does not read, and keys no one reads, still load."""
from __future__ import annotations

import copy
import json
import math
from pathlib import Path
from typing import Any, Optional

import pytest
import torch

from ernie_image.runtime.cli.commands import main
from ernie_image.runtime.core.errors import ModelFileError
from ernie_image.runtime.demo.tiny import TinySizes, build_tiny_model
from ernie_image.runtime.formats import open_component
from ernie_image.runtime.formats.config_json import load_config
from ernie_image.runtime.formats.config_values import config_fault
from ernie_image.runtime.formats.rope_values import rope_types
from ernie_image.runtime.formats.safetensors_reader import SafetensorsFile
from ernie_image.runtime.model.builders import rebuild_rotary_tables, text_tower_on_meta
from ernie_image.runtime.text.pe_model import pe_on_meta

NAN, INF = float("nan"), float("inf")
HEAD_DIM = TinySizes().text_hidden // TinySizes().text_heads
FOLDER = {"text_encoder": "text_encoder", "pe": "pe", "dit": "transformer"}
FIX = "fix it or re-download it"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("rope"), layout="diffusers", variant="turbo",
                            with_pe=True).model_dir


@pytest.fixture
def no_weight_is_read(monkeypatch):
    monkeypatch.setattr(SafetensorsFile, "tensor", lambda *a, **k: pytest.fail("a weight was read"))


def tiny_rope(kind: str, tiny: Path) -> dict[str, Any]:
    config = json.loads((tiny / FOLDER[kind] / "config.json").read_text())
    return copy.deepcopy(config.get("text_config", config)["rope_parameters"])


# Where a text config's rope dict sits: the text encoder's diffusers config nests the tower's config in text_config,
# its single file (and a plain Mistral config.json) does not; the PE's is at the top and may be nested.
PLACEMENTS = [("text_encoder", nested, key) for nested in (True, False) for key in ("rope_parameters", "rope_scaling")]
PLACEMENTS += [("pe", nested, key) for nested in (False, True) for key in ("rope_parameters", "rope_scaling")]


def text_config(kind: str, tiny: Path, nested: bool, key: str, rope: Optional[dict], **section: Any) -> dict:
    """The tiny part's config with its rope dict replaced by `rope` under `key`, laid out `nested` or not."""
    config = json.loads((tiny / FOLDER[kind] / "config.json").read_text())
    inner = config.pop("text_config") if "text_config" in config else config
    inner.pop("rope_parameters")
    inner[key] = rope
    inner.update(section)
    if not nested:
        return inner
    return {**config, "text_config": inner} if kind == "text_encoder" else {"text_config": inner}


def placed(tmp_path: Path, tiny: Path, kind: str, config: dict) -> Path:
    """A part folder holding `config` as config.json beside the tiny part's weights (linked, not copied)."""
    folder = tmp_path / FOLDER[kind]
    folder.mkdir()
    for weights in (tiny / FOLDER[kind]).glob("*.safetensors"):
        (folder / weights.name).symlink_to(weights)
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def refusal(folder: Path, kind: str) -> str:
    with pytest.raises(ModelFileError) as refused:
        open_component(folder, kind)
    message = str(refused.value)
    assert "\n" not in message
    return message


def says(folder: Path, field: str, value: Any, wanted: str) -> str:
    return f"{folder / 'config.json'} says {field} {json.dumps(value)}, which is not {wanted}: {FIX}"


# ---- every field a rope type reads, each bad value ------------------------------------------------------------

BASE = "a finite number > 1"
POSITIVE = "a positive finite number"
SIZE = "a positive whole number"
WHOLE_HEAD = "1 (this model rotates the whole head)"
COMMON_BAD = (0, -1, NAN, INF, -INF, "2", True, None)


def _cases(rope: str, field: str, wanted: str, allowed: tuple = (), extra: tuple = ()) -> list[tuple]:
    """(rope type, field, bad value, wanted): every common bad value but those `allowed`, and `extra` ones."""
    nullable = None in allowed
    shown = f"{wanted} or null" if nullable else wanted
    return [(rope, field, value, shown) for value in (*COMMON_BAD, *extra)
            if not any(value is ok or (value == ok and type(value) is type(ok)) for ok in allowed)]


YARN_CASES = [
    *_cases("yarn", "rope_theta", BASE, extra=(1, 0.5)),
    *_cases("yarn", "factor", POSITIVE, allowed=(None,)),
    *_cases("yarn", "original_max_position_embeddings", SIZE, extra=(2.5, "256")),
    *_cases("yarn", "beta_fast", POSITIVE, allowed=(None,)),
    *_cases("yarn", "beta_slow", POSITIVE, allowed=(None,)),
    *_cases("yarn", "attention_factor", POSITIVE, allowed=(None,)),
    *_cases("yarn", "mscale", "a finite number >= 0", allowed=(None, 0)),
    *_cases("yarn", "mscale_all_dim", "a finite number >= 0", allowed=(None, 0)),
    *_cases("yarn", "truncate", "true or false", allowed=(None, True), extra=(1, "false")),
    *_cases("yarn", "partial_rotary_factor", WHOLE_HEAD, extra=(0.5,)),
]
OTHER_RULES = {
    "linear": {"rope_type": "linear", "rope_theta": 1e6, "factor": 2.0},
    "dynamic": {"rope_type": "dynamic", "rope_theta": 1e6, "factor": 2.0},
    "llama3": {"rope_type": "llama3", "rope_theta": 1e6, "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 256},
    "longrope": {"rope_type": "longrope", "rope_theta": 1e6, "short_factor": [1.0] * (HEAD_DIM // 2),
                 "long_factor": [1.5] * (HEAD_DIM // 2), "original_max_position_embeddings": 256},
    "proportional": {"rope_type": "proportional", "rope_theta": 1e6, "partial_rotary_factor": 0.5},
    "default": {"rope_type": "default", "rope_theta": 1e6},
}
OTHER_CASES = [
    *_cases("linear", "factor", POSITIVE),
    *_cases("linear", "partial_rotary_factor", WHOLE_HEAD, extra=(0.5,)),
    *_cases("dynamic", "factor", POSITIVE),
    *_cases("llama3", "factor", POSITIVE),
    *_cases("llama3", "low_freq_factor", POSITIVE),
    *_cases("llama3", "high_freq_factor", POSITIVE),
    *_cases("llama3", "original_max_position_embeddings", SIZE),
    *_cases("longrope", "short_factor", "a list of positive finite numbers", extra=([], [1.0, NAN], [0.0, 1.0])),
    *_cases("longrope", "long_factor", "a list of positive finite numbers", extra=([], [1.0, -1.0])),
    *_cases("longrope", "factor", POSITIVE, allowed=(None,)),
    *_cases("proportional", "partial_rotary_factor", "a finite number > 0 and <= 1", extra=(1.5,)),
    *_cases("proportional", "factor", POSITIVE),
    *_cases("default", "rope_theta", BASE, extra=(1,)),
]
FIELD_CASES = [("yarn", field, value, wanted) for _, field, value, wanted in YARN_CASES] + OTHER_CASES


def _id(case: tuple) -> str:
    return " ".join(map(str, case))


@pytest.mark.parametrize("kind, nested, key", PLACEMENTS, ids=map(_id, PLACEMENTS))
@pytest.mark.parametrize("rope_type, field, value, wanted", FIELD_CASES, ids=map(_id, FIELD_CASES))
def test_a_rope_value_out_of_range_is_refused_as_the_config_is_read_naming_its_dotted_path(
        tmp_path, tiny, no_weight_is_read, kind, nested, key, rope_type, field, value, wanted):
    if rope_type not in rope_types():
        pytest.skip(f"the installed transformers has no rope type {rope_type!r}")
    rope = tiny_rope(kind, tiny) if rope_type == "yarn" else dict(OTHER_RULES[rope_type])
    if kind == "pe":  # Ministral3's attention reads these whatever the rope type
        rope.setdefault("llama_4_scaling_beta", 0.1)
        rope.setdefault("original_max_position_embeddings", 256)
    rope[field] = value
    folder = placed(tmp_path, tiny, kind, text_config(kind, tiny, nested, key, rope))
    path = ("text_config." if nested else "") + f"{key}.{field}"
    assert refusal(folder, kind) == says(folder, path, value, wanted)


PE_CASES = _cases("yarn", "llama_4_scaling_beta", "a finite number >= 0", allowed=(0,))


@pytest.mark.parametrize("nested, key", [(n, k) for _, n, k in PLACEMENTS if _ == "pe"])
@pytest.mark.parametrize("value, wanted", [(value, wanted) for *_, value, wanted in PE_CASES],
                         ids=[repr(case[2]) for case in PE_CASES])
def test_the_prompt_enhancers_query_scaling_beta_is_held_to_its_rule(tmp_path, tiny, no_weight_is_read, nested, key,
                                                                      value, wanted):
    rope = {**tiny_rope("pe", tiny), "llama_4_scaling_beta": value}
    folder = placed(tmp_path, tiny, "pe", text_config("pe", tiny, nested, key, rope))
    path = ("text_config." if nested else "") + f"{key}.llama_4_scaling_beta"
    assert refusal(folder, "pe") == says(folder, path, value, wanted)


RTYPE_BAD = ("bogus", "", "axial", 0, True, None)


@pytest.mark.parametrize("kind, nested, key", PLACEMENTS, ids=map(_id, PLACEMENTS))
@pytest.mark.parametrize("type_field", ["rope_type", "type"])
@pytest.mark.parametrize("value", RTYPE_BAD, ids=map(repr, RTYPE_BAD))
def test_a_rope_type_transformers_does_not_build_is_refused_naming_the_types_it_builds(
        tmp_path, tiny, no_weight_is_read, kind, nested, key, type_field, value):
    rope = {k: v for k, v in tiny_rope(kind, tiny).items() if k not in ("rope_type", "type")}
    rope[type_field] = value
    folder = placed(tmp_path, tiny, kind, text_config(kind, tiny, nested, key, rope))
    path = ("text_config." if nested else "") + f"{key}.{type_field}"
    message = refusal(folder, kind)
    assert message == says(folder, path, value, "one of " + ", ".join(f'"{t}"' for t in rope_types()))
    assert '"default"' in message and '"yarn"' in message


# The config's own level: its rope_theta and partial_rotary_factor are transformers' defaults for the rope dict's.
SECTION_CASES = [*_cases("yarn", "rope_theta", BASE, extra=(1,)),
                 *_cases("yarn", "partial_rotary_factor", WHOLE_HEAD, extra=(0.5,))]


@pytest.mark.parametrize("kind, nested", [("text_encoder", True), ("text_encoder", False), ("pe", False),
                                          ("pe", True)])
@pytest.mark.parametrize("field, value, wanted", [case[1:] for case in SECTION_CASES], ids=map(_id, SECTION_CASES))
def test_a_rope_default_at_the_configs_own_level_is_refused_naming_that_level(tmp_path, tiny, no_weight_is_read,
                                                                              kind, nested, field, value, wanted):
    rope = {k: v for k, v in tiny_rope(kind, tiny).items() if k != field}
    folder = placed(tmp_path, tiny, kind, text_config(kind, tiny, nested, "rope_parameters", rope, **{field: value}))
    path = ("text_config." if nested else "") + field
    assert refusal(folder, kind) == says(folder, path, value, wanted)


# ---- fields that must stand in an order to each other, fields a rope type cannot do without -------------------

def _relation_cases(path: str) -> list[tuple[str, dict, str]]:
    llama3 = OTHER_RULES["llama3"]
    half = HEAD_DIM // 2
    return [
        ("yarn", {"beta_fast": 1.0, "beta_slow": 2.0},
         f"says {path}beta_fast 1.0, which is not at least {path}beta_slow (2)"),
        ("yarn", {"beta_fast": None, "beta_slow": 40},
         f"says {path}beta_slow 40, which is not at most the default beta_fast (32)"),
        ("yarn", {"beta_fast": 0.5, "beta_slow": None},
         f"says {path}beta_fast 0.5, which is not at least the default beta_slow (1)"),
        ("llama3", {**llama3, "high_freq_factor": 1.0, "low_freq_factor": 4.0},
         f"says {path}high_freq_factor 1.0, which is not above {path}low_freq_factor (4)"),
        ("llama3", {**llama3, "high_freq_factor": 2.0, "low_freq_factor": 2.0},
         f"says {path}high_freq_factor 2.0, which is not above {path}low_freq_factor (2)"),
        ("longrope", {**OTHER_RULES["longrope"], "short_factor": [1.0] * (half + 1)},
         f"says {path}short_factor {json.dumps([1.0] * (half + 1))}, which is not a list of {half} numbers (half "
         f"the head size, {HEAD_DIM})"),
        ("linear", {"rope_type": "linear", "rope_theta": 1e6},
         f'has no {path}factor, which rope_type "linear" reads: it must be a positive finite number'),
        ("dynamic", {"rope_type": "dynamic"},
         f'has no {path}factor, which rope_type "dynamic" reads: it must be a positive finite number'),
        ("llama3", {k: v for k, v in llama3.items() if k != "low_freq_factor"},
         f'has no {path}low_freq_factor, which rope_type "llama3" reads: it must be a positive finite number'),
        ("longrope", {k: v for k, v in OTHER_RULES["longrope"].items() if k != "long_factor"},
         f'has no {path}long_factor, which rope_type "longrope" reads: it must be a list of positive finite numbers'),
    ]


@pytest.mark.parametrize("kind, nested, key", PLACEMENTS, ids=map(_id, PLACEMENTS))
@pytest.mark.parametrize("case", range(len(_relation_cases(""))))
def test_rope_fields_out_of_order_or_missing_are_refused_naming_them(tmp_path, tiny, no_weight_is_read, kind, nested,
                                                                     key, case):
    path = ("text_config." if nested else "") + f"{key}."
    rope_type, fields, expected = _relation_cases(path)[case]
    rope = {**tiny_rope(kind, tiny), **fields} if rope_type == "yarn" else dict(fields)
    if kind == "pe":
        rope.setdefault("llama_4_scaling_beta", 0.1)
        rope.setdefault("original_max_position_embeddings", 256)
    folder = placed(tmp_path, tiny, kind, text_config(kind, tiny, nested, key, rope))
    assert refusal(folder, kind) == f"{folder / 'config.json'} {expected}: {FIX}"


@pytest.mark.parametrize("nested, key", [(n, k) for _, n, k in PLACEMENTS if _ == "pe"])
@pytest.mark.parametrize("rope, missing", [
    ({"rope_type": "default", "rope_theta": 1e6, "original_max_position_embeddings": 256},
     "llama_4_scaling_beta, which the prompt enhancer's attention reads: it must be a finite number >= 0"),
    ({"rope_type": "linear", "rope_theta": 1e6, "factor": 2.0, "llama_4_scaling_beta": 0.1},
     "original_max_position_embeddings, which the prompt enhancer's attention reads: it must be a positive whole "
     "number"),
])
def test_a_prompt_enhancer_rope_dict_without_what_its_attention_reads_is_refused(tmp_path, tiny, no_weight_is_read,
                                                                                  nested, key, rope, missing):
    folder = placed(tmp_path, tiny, "pe", text_config("pe", tiny, nested, key, rope))
    path = ("text_config." if nested else "") + f"{key}."
    assert refusal(folder, "pe") == f"{folder / 'config.json'} has no {path}{missing}: {FIX}"


@pytest.mark.parametrize("kind", ["text_encoder", "pe"])
@pytest.mark.parametrize("nested", [True, False])
@pytest.mark.parametrize("key, value", [("rope_parameters", "yarn"), ("rope_parameters", [1.0]),
                                        ("rope_scaling", 16.0), ("rope_scaling", "yarn")])
def test_a_rope_dict_that_is_not_an_object_is_refused(tmp_path, tiny, no_weight_is_read, kind, nested, key, value):
    config = text_config(kind, tiny, nested, "rope_parameters", tiny_rope(kind, tiny), **{key: value})
    folder = placed(tmp_path, tiny, kind, config)
    path = ("text_config." if nested else "") + key
    assert refusal(folder, kind) == says(folder, path, value, "a JSON object or null")


@pytest.mark.parametrize("kind", ["text_encoder", "pe"])
@pytest.mark.parametrize("value", ["mistral", None, [1], 3])
def test_a_text_config_that_is_not_an_object_is_refused_naming_it(tmp_path, tiny, no_weight_is_read, kind, value):
    config = json.loads((tiny / FOLDER[kind] / "config.json").read_text())
    config["text_config"] = value
    folder = placed(tmp_path, tiny, kind, config)
    assert refusal(folder, kind) == says(folder, "text_config", value, "a JSON object")


# ---- the DiT ----------------------------------------------------------------------------------------------------

DIT_CASES = [
    *[("rope_theta", value, BASE) for value in (*COMMON_BAD, 1, 0.5, "256")],
    *[("rope_axes_dim", value, "a list of three positive even whole numbers")
      for value in ([8, 12], [8, 12, 12, 0], [7, 13, 12], [8, 0, 24], [8, -12, 36], [8.0, 12, 12], [True, 12, 14],
                    [8, NAN, 12], "8,12,12", [], None, 32)],
]


@pytest.mark.parametrize("field, value, wanted", DIT_CASES, ids=map(_id, DIT_CASES))
def test_a_dit_rope_value_out_of_range_is_refused_as_its_config_is_read(tmp_path, tiny, no_weight_is_read, field,
                                                                         value, wanted):
    config = json.loads((tiny / "transformer" / "config.json").read_text())
    config[field] = value
    folder = placed(tmp_path, tiny, "dit", config)
    assert refusal(folder, "dit") == says(folder, field, value, wanted)


# The tiny DiT: hidden_size 64 over 2 heads, heads of 32 channels shared by the axes (8, 12, 12).
DIT_SUM_CASES = [
    ({"rope_axes_dim": [8, 12, 14]},
     "rope_axes_dim [8, 12, 14] sums to 34, but hidden_size / num_attention_heads is 32"),
    ({"rope_axes_dim": [8, 8, 8]}, "rope_axes_dim [8, 8, 8] sums to 24, but hidden_size / num_attention_heads is 32"),
    ({"hidden_size": 65}, "rope_axes_dim [8, 12, 12] sums to 32, but hidden_size / num_attention_heads is 32.5"),
]


@pytest.mark.parametrize("change, said", DIT_SUM_CASES, ids=[str(change) for change, _ in DIT_SUM_CASES])
def test_dit_rope_axes_that_do_not_fill_a_head_are_refused_with_the_sum_and_the_head_size(change, said):
    from ernie_image.runtime.model.dit import DiTConfig

    with pytest.raises(ValueError) as refused:  # config_json.config_named names the file around it
        DiTConfig.from_dict({"hidden_size": 64, "num_attention_heads": 2, "rope_axes_dim": [8, 12, 12], **change})
    assert str(refused.value) == said


# ---- the text configs' head size: RoPE rotates channel pairs, so transformers refuses an odd one ----------------

EVEN = "a positive even whole number (RoPE rotates channels in pairs) or null"
HEAD_CASES = [*[({"head_dim": value}, "head_dim", value, f"is not {EVEN}") for value in (13, 1, 7, 0, -2, 12.0, "12")],
              # no head_dim: transformers takes hidden_size // num_attention_heads (60 // 4 is 15)
              *[({"head_dim": absent, "hidden_size": 60}, "num_attention_heads", 4,
                 "with {p}hidden_size 60 and no {p}head_dim makes heads of 15 channels, which is not even (RoPE "
                 "rotates channels in pairs)") for absent in (None, "absent")]]


@pytest.mark.parametrize("kind, nested", [("text_encoder", True), ("text_encoder", False), ("pe", False),
                                          ("pe", True)])
@pytest.mark.parametrize("change, field, value, broken", HEAD_CASES, ids=[str(case[0]) for case in HEAD_CASES])
def test_an_odd_text_head_size_is_refused_naming_its_dotted_path(tmp_path, tiny, no_weight_is_read, kind, nested,
                                                                 change, field, value, broken):
    config = text_config(kind, tiny, nested, "rope_parameters", tiny_rope(kind, tiny), **change)
    inner = config.get("text_config", config)
    if inner.get("head_dim") == "absent":
        del inner["head_dim"]
    prefix = "text_config." if nested else ""
    folder = placed(tmp_path, tiny, kind, config)
    assert refusal(folder, kind) == (f"{folder / 'config.json'} says {prefix}{field} {json.dumps(value)}, which "
                                     f"{broken.format(p=prefix)}: {FIX}")


LONG = "x" * 150 + " a `quoted_field`=13 that the cut would `split` here"
LIBRARY_CASES = [
    # huggingface_hub's wrappers left out; the field transformers names kept; no backtick, no line break
    ("transformers", {"hidden_size": "x"}, "TypeError: Field 'hidden_size' expected int, got str (value: 'x')"),
    ("transformers", {"head_dim": 13}, "ValueError: RoPE requires an even rotary dimension, but got head_dim=13 with "
                                       "partial_rotary_factor=1.0 for full_attention."),
    ("plain", ValueError(LONG), "ValueError: " + "x" * 150 + " a quoted_field=13 that the cut would ..."),
    ("plain", ValueError("a `b`\nc"), "ValueError: a b c"),
]


@pytest.mark.parametrize("source, given, said", LIBRARY_CASES, ids=[str(case[1])[:30] for case in LIBRARY_CASES])
def test_a_library_refusal_of_a_config_is_one_line_cut_at_a_word(source, given, said):
    from ernie_image.runtime.formats.config_json import library_detail

    error = given
    if source == "transformers":
        from transformers import MistralConfig

        try:
            MistralConfig(**given)
        except Exception as raised:  # noqa: BLE001 - whichever error transformers raises is the one worded
            error = raised
    detail = library_detail(error)
    assert detail == said and "`" not in detail and "\n" not in detail and len(detail) <= 204


# ---- what still loads ---------------------------------------------------------------------------------------------

def _builds_finite_rotary_tables(folder: Path, kind: str) -> None:
    component = open_component(folder, kind)
    model = text_tower_on_meta(component) if kind == "text_encoder" else pe_on_meta(component).model
    rebuild_rotary_tables(model, model.config, torch.device("cpu"))
    assert torch.isfinite(model.rotary_emb.inv_freq).all()
    assert math.isfinite(model.rotary_emb.attention_scaling)


LOADS = [
    ("the tiny model's own", {}),
    ("yarn's factor null (derived from the context lengths)", {"factor": None}),
    ("yarn's optional fields null", {"beta_fast": None, "beta_slow": None, "mscale": None, "attention_factor": None}),
    ("a mscale of 0 (unused)", {"mscale": 0}),
    ("a `type` that rope_type overrides", {"type": "bogus"}),
    ("unknown keys", {"foo": NAN, "bar": {"baz": "x"}}),
    ("a default rope with fields it never reads", {"rope_type": "default", "factor": 0, "beta_fast": NAN,
                                                   "partial_rotary_factor": 0.5, "truncate": "no"}),
    ("a linear rope", OTHER_RULES["linear"]),
    ("a llama3 rope", OTHER_RULES["llama3"]),
    ("a longrope rope", OTHER_RULES["longrope"]),
]


@pytest.mark.parametrize("kind, nested, key", PLACEMENTS, ids=map(_id, PLACEMENTS))
@pytest.mark.parametrize("what, fields", LOADS, ids=[what for what, _ in LOADS])
def test_sound_rope_values_and_fields_the_rope_type_does_not_read_still_load(tmp_path, tiny, kind, nested, key, what,
                                                                             fields):
    rope = {**tiny_rope(kind, tiny), **fields}
    if "rope_type" in fields:
        rope = {k: v for k, v in rope.items() if k != "type"}
    _builds_finite_rotary_tables(placed(tmp_path, tiny, kind, text_config(kind, tiny, nested, key, rope)), kind)


@pytest.mark.parametrize("kind", ["text_encoder", "pe"])
@pytest.mark.parametrize("nested", [True, False])
def test_configs_with_no_rope_dict_use_the_models_defaults(tmp_path, tiny, kind, nested):
    config = text_config(kind, tiny, nested, "rope_parameters", None)
    _builds_finite_rotary_tables(placed(tmp_path, tiny, kind, config), kind)


def test_the_text_encoder_ignores_the_prompt_enhancers_query_scaling_beta(tmp_path, tiny):
    rope = {**tiny_rope("text_encoder", tiny), "llama_4_scaling_beta": NAN}
    config = text_config("text_encoder", tiny, True, "rope_parameters", rope)
    _builds_finite_rotary_tables(placed(tmp_path, tiny, "text_encoder", config), "text_encoder")


def test_rope_scaling_given_beside_rope_parameters_is_the_one_read(tmp_path, tiny):
    config = text_config("text_encoder", tiny, True, "rope_scaling", tiny_rope("text_encoder", tiny),
                         rope_parameters={"rope_type": "linear", "factor": 0})
    _builds_finite_rotary_tables(placed(tmp_path, tiny, "text_encoder", config), "text_encoder")


@pytest.mark.parametrize("layout", ["diffusers", "comfy"])
def test_every_config_the_tiny_models_and_the_released_models_carry_passes(tmp_path, layout):
    sources = build_tiny_model(tmp_path / layout, layout=layout, variant="turbo", with_pe=True)
    for kind, part in (("dit", "transformer"), ("text_encoder", "text_encoder"), ("vae", "vae"), ("pe", "pe")):
        config = open_component(sources.component(part), kind).config
        assert config is None or config_fault(config, kind) is None, (kind, config)
        for variant in ("base", "turbo"):
            assert config_fault(load_config(variant, part), kind) is None


# ---- from the command line ------------------------------------------------------------------------------------------

def _set(config_path: Path, *path_and_value: Any) -> None:
    *path, value = path_and_value
    config = json.loads(config_path.read_text())
    target = config
    for step in path[:-1]:
        target = target[step]
    target[path[-1]] = value
    config_path.write_text(json.dumps(config))


@pytest.mark.parametrize("part, path, value, extra", [
    ("text_encoder", ("text_config", "rope_parameters", "factor"), 0, ()),
    ("pe", ("rope_parameters", "factor"), NAN, ("--use-pe",)),
    ("pe", ("rope_parameters", "llama_4_scaling_beta"), NAN, ("--use-pe",)),
    ("transformer", ("rope_theta",), 0, ()),
], ids=["text encoder factor 0", "pe factor NaN", "pe beta NaN", "dit rope_theta 0"])
def test_the_cli_refuses_a_bad_rope_value_in_one_line_with_exit_2_and_writes_nothing(
        capsys, tmp_path, tiny, monkeypatch, part, path, value, extra):
    import shutil

    from ernie_image.runtime.model import builders
    from ernie_image.runtime.text import pe_model

    for module in (builders, pe_model):
        monkeypatch.setattr(module, "fill_from_file", lambda *a, **k: pytest.fail("a part was filled with weights"))
    if part != "pe":  # the PE's file is opened after the DiT's tensors are mapped (views: no data read)
        monkeypatch.setattr(SafetensorsFile, "tensor", lambda *a, **k: pytest.fail("a weight was read"))
    model = Path(shutil.copytree(tiny, tmp_path / "model"))
    config = model / part / "config.json"
    _set(config, *path, value)
    out = tmp_path / "x.png"
    code = main(["generate", "--model-dir", str(model), "--steps", "1", "--device", "cpu", "--width", "256",
                 "--height", "256", "--out", str(out), *extra])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1, err
    kind = {"transformer": "dit"}.get(part, part)
    wanted = {"dit": BASE, "pe": POSITIVE + " or null" if path[-1] == "factor" else "a finite number >= 0",
              "text_encoder": POSITIVE + " or null"}[kind]
    assert err[0] == f"error: {config} says {'.'.join(path)} {json.dumps(value)}, which is not {wanted}: {FIX}"
    assert not out.exists()


def test_the_cli_names_a_bad_rope_value_in_a_single_files_embedded_config_with_the_fix_re_export(
        capsys, tmp_path, monkeypatch):
    from safetensors import safe_open
    from safetensors.torch import save_file

    sources = build_tiny_model(tmp_path / "comfy", layout="comfy", variant="turbo")
    with safe_open(str(sources.text_encoder), "pt") as handle:
        tensors, metadata = {key: handle.get_tensor(key) for key in handle.keys()}, handle.metadata()
    config = json.loads(metadata["config"])
    config["rope_parameters"]["beta_fast"] = NAN
    save_file(tensors, str(sources.text_encoder), metadata={**metadata, "config": json.dumps(config)})
    monkeypatch.setattr(SafetensorsFile, "tensor", lambda *a, **k: pytest.fail("a weight was read"))
    out = tmp_path / "x.png"
    code = main(["generate", "--dit", str(sources.dit), "--text-encoder", str(sources.text_encoder), "--vae",
                 str(sources.vae), "--steps", "1", "--device", "cpu", "--width", "256", "--height", "256",
                 "--out", str(out)])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and err == [
        f"error: the config in {sources.text_encoder.name}'s metadata says rope_parameters.beta_fast NaN, which is not "
        f"{POSITIVE} or null: re-export or re-download the file"]
    assert not out.exists()
