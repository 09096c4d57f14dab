"""A model's config.json files, read and checked in one line each: damaged JSON, or JSON that is not a config,
names the file and the fix (re-download it) instead of a JSONDecodeError or AttributeError traceback. The released
models' configs ship in configs/: a part whose file carries no config is built from them."""
from __future__ import annotations

import contextlib
import json
import re
from pathlib import Path
from typing import Any, Iterator, Optional

from ..core.errors import ErnieImageError, ModelFileError, one_line
from ..core.json_text import JSON_ERRORS, RepeatedKey, json_trouble, load_json
from ..core.variant import Variant
from ..files.cut_files import empty_file
from ..files.file_kind import is_there, refuse_special_file

CONFIG_ROOT = Path(__file__).parent / "configs"
CONFIG_ERRORS = (TypeError, ValueError, KeyError, AttributeError, IndexError, ZeroDivisionError, OverflowError)


def _config_errors() -> tuple[type[BaseException], ...]:
    """CONFIG_ERRORS, and transformers' own refusal of a field of the wrong type (huggingface_hub's strict
    dataclasses raise an Exception of their own)."""
    try:
        from huggingface_hub.errors import StrictDataclassError
    except ImportError:  # an older huggingface_hub: its configs raise TypeError or ValueError
        return CONFIG_ERRORS
    return (*CONFIG_ERRORS, StrictDataclassError)


CONFIG_FIX = "give the config.json file, or re-download it"


class RepeatedConfigKey(ModelFileError):
    """A config file holding a key twice (which value is meant is not known)."""


def config_there(path: Path) -> bool:
    """Whether a config file (config.json, generation_config.json) is at `path` to be read: False only where nothing
    is; a broken link (a download cut short into a cache of links) is refused, not taken for no config."""
    return is_there(path, str(path), CONFIG_FIX)


def read_config(path: Path) -> dict[str, Any]:
    """The JSON object in `path` (config.json, generation_config.json)."""
    path = Path(path)
    refuse_special_file(path, str(path), CONFIG_FIX)
    try:
        data = path.read_bytes()
        if not data:
            raise ModelFileError(empty_file(str(path), "JSON"))
        if data.startswith(b"\xef\xbb\xbf"):  # JSON has no byte-order mark, and diffusers' reader refuses one
            raise ModelFileError(f"{path} starts with a byte-order mark (an editor saved it as 'UTF-8 with BOM'): "
                                 "save it as plain UTF-8, or re-download it")
        config = load_json(data.decode("utf-8"))
    except OSError as error:
        raise ModelFileError(f"{path} cannot be read ({error.strerror or error}): check its permissions, or "
                             "re-download it") from None
    except JSON_ERRORS as error:
        cut = " or cut short" if isinstance(error, json.JSONDecodeError) else ""
        refusal = RepeatedConfigKey if isinstance(error, RepeatedKey) else ModelFileError
        raise refusal(f"{path} {json_trouble(error)}: the file is damaged{cut}: re-download it") from None
    if not isinstance(config, dict):
        raise ModelFileError(f"{path} holds a JSON {type(config).__name__}, not a config (a JSON object): the file "
                             "is damaged: re-download it")
    return config


# What names a part's config: the classes diffusers/transformers write into it (`_class_name`, `architectures`,
# `model_type`), or, in a config that names none, the fields only that part's config has.
PART_CLASSES: dict[str, tuple[str, ...]] = {
    "dit": ("ErnieImageTransformer2DModel",),
    "vae": ("AutoencoderKLFlux2",),
    "text_encoder": ("Mistral3Model", "Mistral3ForConditionalGeneration", "mistral3"),
    "pe": ("Ministral3ForCausalLM", "ministral3"),
}
PART_FIELDS: dict[str, tuple[str, ...]] = {
    "dit": ("num_layers", "hidden_size", "text_in_dim"),
    "vae": ("block_out_channels", "latent_channels"),
    "text_encoder": ("text_config",),
    "pe": ("num_hidden_layers", "hidden_size", "vocab_size"),
}


def describes_part(config: dict[str, Any], kind: str) -> bool:
    """Whether `config` is the config of part `kind` ("dit", "text_encoder", "vae", "pe"): the class it names is
    that part's, or it names none and has that part's fields."""
    named = [config.get("_class_name"), config.get("model_type"), *(config.get("architectures") or [])]
    named = [name for name in named if isinstance(name, str)]
    if named:
        return any(name in PART_CLASSES[kind] for name in named)
    return all(name in config for name in PART_FIELDS[kind])


def config_origin(component) -> tuple[str, str]:
    """Where a component's config came from, and how to restore it: (its name in a message, the fix)."""
    return origin_of(Path(component.path), getattr(component, "config_file", None),
                     "config" in getattr(component, "metadata", {}))


def origin_of(path: Path, config_file: Optional[Path], in_metadata: bool) -> tuple[str, str]:
    """`config_origin` of the weights at `path` whose config was read from `config_file`, else from the file's
    metadata (`in_metadata`), else inferred."""
    if config_file is not None:
        return str(config_file), "fix it or re-download it"
    if in_metadata:
        return f"the config in {path.name}'s metadata", "re-export or re-download the file"
    return f"the config inferred for {path} (it has no config.json)", "put the model's config.json there"


@contextlib.contextmanager
def config_named(component, part: str) -> Iterator[None]:
    """A config that does not build `part` (a value of the wrong type, out of range, missing) as one line naming
    the config and the fix."""
    try:
        yield
    except ErnieImageError:
        raise
    except _config_errors() as error:
        origin, fix = config_origin(component)
        raise ModelFileError(f"{origin} does not describe an ERNIE-Image {part} ({library_detail(error)}): "
                             f"{fix}") from None


def library_detail(error: BaseException, limit: int = 200) -> str:
    """A library's refusal of a config as one line: huggingface_hub's strict-dataclass wrapper ("Class validation
    error for validator 'validate_rope':") left out for the error it wraps, which names the field; backticks
    dropped and a long text cut at a word, so no quote is left open."""
    text = " ".join(one_line(error, 10_000).replace("`", "").split())
    text = re.sub(r"^StrictDataclass\w*Error: (Class validation error for validator|Validation error for field) "
                  r"'[^']*': ", "", text)
    if len(text) <= limit:
        return text
    return text[:limit].rsplit(" ", 1)[0] + " ..."


def released_config_folder(variant: Variant) -> Path:
    """The released model's folder of configs (transformer/, text_encoder/, vae/, scheduler/, ...)."""
    return CONFIG_ROOT / ("ERNIE-Image-Turbo" if variant == "turbo" else "ERNIE-Image")


def load_config(variant: Variant, component: str) -> dict:
    """The released model's config of one component ("transformer", "text_encoder", "vae", "pe")."""
    return json.loads((released_config_folder(variant) / component / "config.json").read_text())
