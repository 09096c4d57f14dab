"""Where a model's parts are: a diffusers folder, single files, or both (a single file overrides the folder's part)."""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from ..core.errors import InvalidInputError, ModelFileError
from ..core.variant import Variant, checked_variant_option
from ..files.file_kind import not_there
from .config_json import config_there, describes_part, read_config

# What a component is called where a message asks for its file, and the setting that takes that file.
_FILE_WORDS = {"transformer": ("DiT", "dit"), "text_encoder": ("text encoder", "text_encoder"), "vae": ("VAE", "vae"),
               "pe": ("prompt enhancer", "pe")}


@dataclass
class ModelSources:
    """Any mix of a diffusers folder and single files; a single file overrides the folder's component."""

    model_dir: Optional[Path] = None
    dit: Optional[Path] = None
    text_encoder: Optional[Path] = None
    vae: Optional[Path] = None
    pe: Optional[Path] = None
    tokenizer: Optional[Path] = None  # a tokenizer folder or tokenizer.json; else found next to the weights
    variant: Optional[Variant] = None  # None or "auto": decided from the files (runtime/core/variant.py)

    def __post_init__(self) -> None:
        for name in ("model_dir", "dit", "text_encoder", "vae", "pe", "tokenizer"):
            value = getattr(self, name)
            if value is not None:
                if not isinstance(value, (str, os.PathLike)):
                    raise InvalidInputError(f"{name} {value!r} is not a path: give a str or pathlib.Path, or None"
                                            ).naming(name)
                if not os.fspath(value).strip():  # Path("") is the working folder: another part than meant
                    raise InvalidInputError(f"{name} is an empty path: give the file or folder, or None").naming(name)
                setattr(self, name, Path(value))
        self.variant = checked_variant_option(self.variant)

    def component(self, name: str) -> Path:
        """The file or folder holding one component ("transformer", "text_encoder", "vae", "pe")."""
        explicit = {"transformer": self.dit, "text_encoder": self.text_encoder, "vae": self.vae, "pe": self.pe}[name]
        if explicit is not None:
            if not explicit.exists():
                raise ModelFileError(f"{name} file {explicit} {not_there(explicit)}")
            if not explicit.is_file() and not explicit.is_dir():  # a FIFO would block the read for ever
                raise ModelFileError(f"{name} file {explicit} is not a regular file or a folder (a pipe, device or "
                                     f"socket): give the {_FILE_WORDS[name][0]}'s weights file or folder")
            return explicit
        part, setting = _FILE_WORDS[name]
        if self.model_dir is None:
            raise ModelFileError(f"no {part} given: pass a diffusers folder (model_dir) or the {part} file ({setting})"
                                 ).naming("model_dir", setting)
        if not self.model_dir.is_dir():
            if self.model_dir.is_symlink() and not self.model_dir.exists():
                raise ModelFileError(f"model folder {self.model_dir} {not_there(self.model_dir)}")
            what = "is a file, not a folder" if self.model_dir.exists() else "does not exist"
            hint = ("give the diffusers ERNIE-Image folder, or the file as the component it holds" if
                    self.model_dir.exists() else "check the path")
            raise ModelFileError(f"model folder {self.model_dir} {what}: {hint}")
        folder = self.model_dir / name
        if folder.is_symlink() and not folder.exists():
            raise ModelFileError(f"{self.model_dir}'s {name}/ {not_there(folder)}")
        if not folder.is_dir():
            raise ModelFileError(
                f"{self.model_dir} has no {name}/ folder: point model_dir at a diffusers ERNIE-Image folder "
                f"(model_index.json, transformer/, text_encoder/, tokenizer/, vae/) or give the {part} file ({setting})"
            ).naming("model_dir", setting)
        return folder

    def has_pe(self) -> bool:
        """Whether the model has a prompt enhancer: given, or its folder's pe/ (one that is a broken link is named,
        not taken for none)."""
        if self.pe is not None:
            return True
        if self.model_dir is None:
            return False
        folder = self.model_dir / "pe"
        if folder.is_symlink() and not folder.exists():
            raise ModelFileError(f"{self.model_dir}'s pe/ {not_there(folder)}")
        return folder.is_dir()


def component_folder(path: Path, kind: str) -> Optional[Path]:
    """The diffusers component folder of part `kind` ("dit", "text_encoder", "vae", "pe") given as that folder
    (`m/pe`) or as the file inside it (`m/pe/model.safetensors`): where its config.json and generation_config.json
    are and, beside it, its tokenizer folder. A file is inside its part's folder when the config.json beside it is
    that part's; None for a file elsewhere (ComfyUI's models/ folders hold no config.json)."""
    if path.is_dir():
        return path
    config = path.parent / "config.json"
    return path.parent if path.is_file() and config_there(config) and describes_part(read_config(config), kind) else None
