"""Base or Turbo: which ERNIE-Image release a DiT is, and how that was decided, for every line that names it.

The two releases share every key and shape, so the weights cannot tell them apart. What can, first to last:
  1. the variant the user set (ModelSources.variant; the Loader's variant widget; `--variant`);
  2. `ernie_image.variant` in the DiT file's metadata, which every DiT file this pack writes records;
  3. the transformer config (a diffusers folder's, or the one beside a DiT file inside such a folder): the Turbo
     release's carries LoRA fields (`use_lora`, `lora_rank`) the base release's lacks (the two releases'
     model_index.json and scheduler configs are identical);
  4. the file or folder name: "turbo" in it is Turbo, "ernie" without "turbo" the base model;
  5. else the base model, saying that nothing told which.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Literal, Optional

from .errors import InvalidInputError, ModelFileError

Variant = Literal["base", "turbo"]
VARIANTS: tuple[Variant, ...] = ("base", "turbo")
AUTO = "auto"
METADATA_KEY = "ernie_image.variant"
VARIANT_SETTING = "variant"  # the name runtime lines use for the override; front ends show their own (cli/names.py)
TURBO_CONFIG_KEYS = ("use_lora", "lora_rank")

Source = Literal["set", "metadata", "config", "name", "default"]


@dataclass(frozen=True)
class VariantChoice:
    variant: Variant
    source: Source
    how: str  # "from the file's metadata", ...: the words after the variant's name

    @property
    def label(self) -> str:
        return "Turbo" if self.variant == "turbo" else "Base"

    @property
    def settings(self) -> tuple[str, ...]:
        """The settings `text()` names by their Python names (errors.worded swaps them for a front end's)."""
        return (VARIANT_SETTING,) if self.source in ("set", "default") else ()

    def text(self) -> str:
        """"Turbo, from the file name": the variant and how it was decided."""
        return f"{self.label}, {self.how}"


def set_by_user(variant: Variant) -> VariantChoice:
    return VariantChoice(variant, "set", f"set by {VARIANT_SETTING}")


def checked_variant_option(value: object) -> Optional[Variant]:
    """The variant override as given: None or "auto" (decided from the files), "base" or "turbo"."""
    if value is None or value == AUTO:
        return None
    if value in VARIANTS:
        return value  # type: ignore[return-value]
    raise InvalidInputError(f"{VARIANT_SETTING} {value!r} is not allowed: give 'base', 'turbo' or 'auto' (decided from "
                            "the files)").naming(VARIANT_SETTING)


def decide_variant(dit, set_to: Optional[Variant] = None) -> VariantChoice:
    """Base or Turbo for an opened DiT (formats.component_file.ComponentFile), and how that was decided."""
    if set_to is not None:
        return set_by_user(set_to)
    recorded = dit.metadata.get(METADATA_KEY)
    if recorded is not None:
        return VariantChoice(_recorded_variant(recorded, dit.path), "metadata", "from the file's metadata")
    if dit.config is not None:
        turbo = any(key in dit.config for key in TURBO_CONFIG_KEYS)
        return VariantChoice("turbo" if turbo else "base", "config", "from the transformer config")
    for name, what in _names(Path(dit.path)):
        if "turbo" in name.lower():
            return VariantChoice("turbo", "name", f"from the {what} name")
        if "ernie" in name.lower():
            return VariantChoice("base", "name", f"from the {what} name")
    return VariantChoice("base", "default", f"by default: nothing in the files says which (set {VARIANT_SETTING} "
                                            "if it is Turbo)")


def _recorded_variant(value: str, path: Path) -> Variant:
    if value in VARIANTS:
        return value  # type: ignore[return-value]
    raise ModelFileError(f"{Path(path).name} records {METADATA_KEY} {value!r} in its metadata, which is neither 'base' "
                         f"nor 'turbo': set {VARIANT_SETTING} to the right one, or write the file again"
                         ).naming(VARIANT_SETTING)


def _names(path: Path) -> list[tuple[str, str]]:
    """The names that may tell: a file's own; for a folder (diffusers transformer/), its name and its parent's."""
    if path.is_dir():
        return [(path.name, "folder"), (path.parent.name, "folder")]
    return [(path.name, "file")]


def settings_notice(model: VariantChoice, settings_for: Optional[str], steps: int, cfg: float) -> Optional[str]:
    """The notice for settings chosen for the other variant (a Turbo model under the base Sampler, or the base
    model under the Turbo Sampler); None when they are the model's own or nobody said whose they are. It names
    the variant setting once (VariantChoice.settings), for a front end to show its own name for it."""
    from .request import VARIANT_DEFAULTS

    if settings_for is None or settings_for == model.variant:
        return None
    own = VARIANT_DEFAULTS[model.variant]
    sampler = "Turbo Sampler" if model.variant == "turbo" else "Sampler"
    other = "Turbo" if settings_for == "turbo" else "the base model"
    override = "" if model.settings else f", or set {VARIANT_SETTING} if the model is not {model.label}"
    return (f"the model is {model.text()}, but these settings ({steps} step{'' if steps == 1 else 's'}, CFG {cfg:g}) "
            f"are meant for {other}: "
            f"{model.label} is made for {int(own['steps'])} steps at CFG {own['cfg']:g}: use its settings (in "
            f"ComfyUI: the {sampler}){override}")
