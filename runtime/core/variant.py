"""Base or Turbo: which ERNIE-Image release a DiT is, and how that was decided, for every line that names it.

The two releases share every key and shape, so the weights cannot tell them apart. What can, first to last:
  1. the variant the user set (ModelSources.variant; the Loader's variant widget; `--variant`);
  2. `ernie_image.variant` in the DiT file's metadata, which every DiT file this pack writes records;
  3. the transformer config (a diffusers folder's, or the one beside a DiT file inside such a folder): the Turbo
     release's carries LoRA fields (`use_lora`, `lora_rank`) the base release's lacks (the two releases'
     model_index.json and scheduler configs are identical);
  4. the file or folder name, then a file's folder's, read word by word (name_variant): the word "turbo" is Turbo,
     "base" or "ernie" without "turbo" the base model; a word after "not", "no", "non" or "without" counts as the
     other variant (`base_not_turbo` is Base); a name with words of both variants tells nothing;
  5. else the base model, saying that nothing told which.
Where the metadata or the config decides and the file or folder name says the other variant (a folder named
ERNIE-Image-Turbo whose transformer config is the base release's), the model runs as they say, with a notice naming
both and the setting that chooses (name_notice).
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, Optional

from .errors import InvalidInputError, ModelFileError, NamedLine, naming_line

Variant = Literal["base", "turbo"]
VARIANTS: tuple[Variant, ...] = ("base", "turbo")
AUTO = "auto"
METADATA_KEY = "ernie_image.variant"
VARIANT_SETTING = "variant"  # the name runtime lines use for the override; front ends show their own (cli/names.py)
TURBO_CONFIG_KEYS = ("use_lora", "lora_rank")
# Baidu's recommended settings per model.
VARIANT_DEFAULTS: dict[str, dict[str, float]] = {
    "base": {"steps": 50, "cfg": 4.0},
    "turbo": {"steps": 8, "cfg": 1.0},
}

Source = Literal["set", "metadata", "config", "name", "default"]


@dataclass(frozen=True)
class NameSays:
    """What a file or folder name says (name_variant): the variant, "file" or "folder", and the name."""

    variant: Variant
    what: str
    name: str


@dataclass(frozen=True)
class VariantChoice:
    variant: Variant
    source: Source
    how: str  # "from the file's metadata", ...: the words after the variant's name
    overrides: Optional["VariantChoice"] = None  # set by the user against what the files say: what they say
    evidence: str = ""  # what in the files says it ("ernie_image.variant base", "it has no use_lora or lora_rank")
    name_says: Optional[NameSays] = None  # the name, where it says the other variant than the metadata or config
    config_says: str = ""  # where the metadata decides and the config says the other variant: what in it says so

    @property
    def label(self) -> str:
        return _label(self.variant)

    @property
    def settings(self) -> tuple[str, ...]:
        """The settings `text()` names by their Python names (errors.worded swaps them for a front end's)."""
        return (VARIANT_SETTING,) if self.source in ("set", "default") else ()

    def text(self) -> str:
        """"Turbo, from the file name": the variant and how it was decided."""
        return f"{self.label}, {self.how}"


def set_by_user(variant: Variant, files_say: Optional[VariantChoice] = None) -> VariantChoice:
    """The variant the user set; `files_say`: what the files say, kept when they say the other variant."""
    says_other = files_say is not None and files_say.source != "default" and files_say.variant != variant
    overrides = files_say if says_other else None
    return VariantChoice(variant, "set", f"set by {VARIANT_SETTING}", overrides)


def override_notice(choice: VariantChoice) -> Optional[NamedLine]:
    """The line for a variant set against what the files say ("variant set to base overrides what the files say
    (Turbo, from the file's metadata): the model is taken as Base"); None when the user set none or they agree."""
    said = choice.overrides
    if said is None:
        return None
    return naming_line(f"{VARIANT_SETTING} set to {choice.variant} overrides what the files say ({said.text()}): the "
                       f"model is taken as {choice.label}", VARIANT_SETTING)


def name_notice(choice: VariantChoice) -> Optional[NamedLine]:
    """The line for files whose metadata or config says one variant and whose name the other ("the folder name
    ERNIE-Image-Turbo says Turbo, but the transformer config says Base (...): it runs as Base; set variant to turbo or
    base to choose"); None when they agree, or the name says nothing, or the user set the variant."""
    named = choice.name_says
    if named is None:
        return None
    decider = "the file's metadata" if choice.source == "metadata" else "the transformer config"
    return naming_line(f"the {named.what} name {named.name} says {_label(named.variant)}, but {decider} says "
                       f"{choice.label} ({choice.evidence}): it runs as {choice.label}; set {VARIANT_SETTING} to "
                       "turbo or base to choose", VARIANT_SETTING)


def config_notice(choice: VariantChoice) -> Optional[NamedLine]:
    """The line for a file whose metadata says one variant and whose config the other ("the transformer config says
    Turbo (it has use_lora), but the file's metadata says Base (...): it runs as Base; ..."); None when they agree,
    or either is missing, or the user set the variant."""
    if not choice.config_says:
        return None
    other = _label(_OTHER[choice.variant])
    return naming_line(f"the transformer config says {other} ({choice.config_says}), but the file's metadata says "
                       f"{choice.label} ({choice.evidence}): it runs as {choice.label}; set {VARIANT_SETTING} to "
                       "turbo or base to choose", VARIANT_SETTING)


def files_notices(choice: VariantChoice) -> list[NamedLine]:
    """Every line for what the user set against the files, and for files that disagree among themselves."""
    return [line for line in (override_notice(choice), name_notice(choice), config_notice(choice)) if line]


def _label(variant: Variant) -> str:
    return "Turbo" if variant == "turbo" else "Base"


def checked_variant_option(value: object) -> Optional[Variant]:
    """The variant override as given: None or "auto" (decided from the files), "base" or "turbo"."""
    if value is None or value == AUTO:
        return None
    if value in VARIANTS:
        return value  # type: ignore[return-value]
    raise InvalidInputError(f"{VARIANT_SETTING} {value!r} is not allowed: give 'base', 'turbo' or 'auto' (decided from "
                            "the files)").naming(VARIANT_SETTING)


def decide_variant(dit, set_to: Optional[Variant] = None) -> VariantChoice:
    """Base or Turbo for an opened DiT (formats.component_file.ComponentFile), and how that was decided; `set_to`
    (the user's) wins, remembering what the files say when that is the other variant (override_notice)."""
    if set_to is None:
        return _files_say(dit)
    try:
        return set_by_user(set_to, _files_say(dit))
    except ModelFileError:  # a recorded variant that is neither: set_to is the fix that error names
        return set_by_user(set_to)


def _files_say(dit) -> VariantChoice:
    named = _name_says(Path(dit.path))
    recorded = dit.metadata.get(METADATA_KEY)
    config_says = _config_says(dit.config) if dit.config is not None else None
    if recorded is not None:
        variant = _recorded_variant(recorded, dit.path)
        other = config_says[1] if config_says is not None and config_says[0] != variant else ""
        return VariantChoice(variant, "metadata", "from the file's metadata", evidence=f"{METADATA_KEY} {recorded}",
                             name_says=_other(named, variant), config_says=other)
    if config_says is not None:
        variant, evidence = config_says
        return VariantChoice(variant, "config", "from the transformer config", evidence=evidence,
                             name_says=_other(named, variant))
    if named is not None:
        return VariantChoice(named.variant, "name", f"from the {named.what} name")
    return VariantChoice("base", "default", f"by default: nothing in the files says which (set {VARIANT_SETTING} "
                                            "if it is Turbo)")


def _config_says(config: dict) -> tuple[Variant, str]:
    """The variant a transformer config says, and what in it says so."""
    held = [key for key in TURBO_CONFIG_KEYS if key in config]
    if held:
        return "turbo", f"it has {' and '.join(held)}"
    return "base", f"it has no {' or '.join(TURBO_CONFIG_KEYS)}, which Turbo's carries"


def _name_says(path: Path) -> Optional[NameSays]:
    """What the first name that says a variant says (_names, in turn), or None."""
    for name, what in _names(path):
        said = name_variant(name)
        if said is not None:
            return NameSays(said, what, name)
    return None


def _other(named: Optional[NameSays], variant: Variant) -> Optional[NameSays]:
    return named if named is not None and named.variant != variant else None


_NEGATIONS = frozenset({"not", "no", "non", "without"})
_OTHER: dict[str, Variant] = {"base": "turbo", "turbo": "base"}


def _words(name: str) -> list[str]:
    """A name's words, lower case: split at anything but letters and digits, and where camelCase starts a word
    ("ERNIE-Image-Turbo", "ernie_image_turbo_q8_0.gguf", "ErnieTurbo")."""
    return [word.lower() for word in re.findall(r"[A-Z]+(?![a-z])|[A-Z]?[a-z]+|\d+", name)]


def name_variant(name: str) -> Optional[Variant]:
    """What a file, folder or model name says, word by word (never inside a word: "turbocharged" says nothing):
    "turbo" Turbo; "base", or "ernie" without "turbo", the base model; a variant's word right after a negation
    ("not", "no", "non", "without") counts as the other's ("base_not_turbo", "non-turbo": the base model). None when
    it says neither, or says both ("ernie-base-turbo-merge")."""
    words = _words(name)
    said: set[Variant] = set()
    for index, word in enumerate(words):
        if word in _OTHER:
            negated = index > 0 and words[index - 1] in _NEGATIONS
            said.add(_OTHER[word] if negated else word)  # type: ignore[arg-type]
    if not said and "ernie" in words:
        said.add("base")
    return said.pop() if len(said) == 1 else None


def _recorded_variant(value: str, path: Path) -> Variant:
    if value in VARIANTS:
        return value  # type: ignore[return-value]
    raise ModelFileError(f"{Path(path).name} records {METADATA_KEY} {value!r} in its metadata, which is neither 'base' "
                         f"nor 'turbo': set {VARIANT_SETTING} to the right one, or write the file again"
                         ).naming(VARIANT_SETTING)


def _names(path: Path) -> list[tuple[str, str]]:
    """The names that may tell, in turn: a file's own, then its folder's (`ERNIE-Image-Turbo/model.safetensors`); for
    a folder (diffusers transformer/), its name and its parent's."""
    if path.is_dir():
        return [(path.name, "folder"), (path.parent.name, "folder")]
    return [(path.name, "file"), (path.parent.name, "folder")]


def variant_words(variant: str) -> str:
    """How a line names a variant's model: "Turbo", "the base model"."""
    return "Turbo" if variant == "turbo" else "the base model"


def own_settings(variant: str) -> str:
    """A variant's own steps and CFG, in the library's words ("steps=8, cfg=1"): a name a notice records
    (errors.naming_line), which a front end shows as its way to get them (ComfyUI: the Turbo Sampler)."""
    own = VARIANT_DEFAULTS[variant]
    return f"steps={int(own['steps'])}, cfg={own['cfg']:g}"


def other_settings(variant: Variant, settings_for: Optional[str], steps: int, cfg: float) -> Optional[str]:
    """The clause for steps and CFG given for the other variant than `variant`'s model ("these settings (1 step, CFG
    4) were given for the base model: Turbo is made for 8 steps at CFG 1: use steps=8, cfg=1"); None when nobody said
    whose they are, they are for this variant, or they are this variant's own whoever gave them."""
    own = VARIANT_DEFAULTS[variant]
    if settings_for is None or settings_for == variant or (steps, cfg) == (int(own["steps"]), own["cfg"]):
        return None
    label = "Turbo" if variant == "turbo" else "Base"
    return (f"these settings ({steps} step{'' if steps == 1 else 's'}, CFG {cfg:g}) were given for "
            f"{variant_words(settings_for)}: {label} is made for {int(own['steps'])} steps at CFG {own['cfg']:g}: "
            f"use {own_settings(variant)}")


def settings_notice(model: VariantChoice, settings_for: Optional[str], steps: int, cfg: float) -> Optional[NamedLine]:
    """The notice for a local model run with settings given for the other variant (a Turbo model under the base
    Sampler, or the base model under the Turbo Sampler); None when there is none (other_settings). It names the
    settings it offers (own_settings, and the variant setting once), for a front end to show its own names."""
    clause = other_settings(model.variant, settings_for, steps, cfg)
    if clause is None:
        return None
    override = () if model.settings else (VARIANT_SETTING,)
    tail = f", or set {VARIANT_SETTING} if the model is not {model.label}" if override else ""
    return naming_line(f"the model is {model.text()}, but {clause}{tail}", own_settings(model.variant),
                       *model.settings, *override)
