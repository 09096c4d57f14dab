"""Lazy access to ComfyUI's modules.

Node modules must import without ComfyUI (tests read INPUT_TYPES, the CLI imports the package), so every
ComfyUI module is imported here, inside functions, and a missing ComfyUI gives empty file lists instead
of an ImportError.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Optional

from ..runtime.core.errors import ModelFileError

NONE_CHOICE = "(none)"
GGUF_FOLDER_KEY = "ernie_gguf"
GGUF_EXTENSIONS = {".gguf"}


def folder_paths_module() -> Optional[Any]:
    try:
        import folder_paths  # type: ignore[import-not-found]
    except ImportError:
        return None
    return folder_paths


def folder_list(key: str) -> list[str]:
    """The folders ComfyUI searches for `key`, or [] outside ComfyUI or for an unknown key."""
    fp = folder_paths_module()
    if fp is None or key not in fp.folder_names_and_paths:
        return []
    return list(fp.get_folder_paths(key))


def register_gguf_folder_key() -> None:
    """Let ComfyUI list .gguf files of the diffusion_models and text_encoders folders under a key of our own.

    ComfyUI's own keys only list its known extensions (no .gguf). Re-registered when the folders change
    (extra_model_paths.yaml or another pack may add folders after this pack is imported).
    """
    fp = folder_paths_module()
    if fp is None:
        return
    folders = list(dict.fromkeys(folder_list("diffusion_models") + folder_list("text_encoders")))
    current = fp.folder_names_and_paths.get(GGUF_FOLDER_KEY)
    if current is None or list(current[0]) != folders:
        fp.folder_names_and_paths[GGUF_FOLDER_KEY] = (folders, set(GGUF_EXTENSIONS))


def filenames(key: str) -> list[str]:
    fp = folder_paths_module()
    if fp is None:
        return []
    if key == GGUF_FOLDER_KEY:
        register_gguf_folder_key()
    if key not in fp.folder_names_and_paths:
        return []
    return list(fp.get_filename_list(key))


def gguf_files_under(key: str) -> list[str]:
    """The .gguf files (names relative to their folder) that lie in the folders of ComfyUI key `key`."""
    roots = [Path(folder).resolve() for folder in folder_list(key)]
    names = []
    for name in filenames(GGUF_FOLDER_KEY):
        full = full_path_or_none(GGUF_FOLDER_KEY, name)
        if full is not None and any(_is_within(full, root) for root in roots):
            names.append(name)
    return names


def model_choices(key: str, with_gguf: bool = False) -> list[str]:
    names = filenames(key)
    if with_gguf:
        names += [n for n in gguf_files_under(key) if n not in names]
    return [NONE_CHOICE] + sorted(names, key=str.lower)


def diffusers_folder_choices() -> list[str]:
    """Sub-folders of models/diffusers that hold a diffusers model (a model_index.json)."""
    names: list[str] = []
    for root in folder_list("diffusers"):
        if not os.path.isdir(root):
            continue
        for entry in sorted(os.listdir(root)):
            if (Path(root) / entry / "model_index.json").is_file() and entry not in names:
                names.append(entry)
    return [NONE_CHOICE] + names


def full_path_or_none(key: str, name: str) -> Optional[Path]:
    fp = folder_paths_module()
    if fp is None:
        return None
    path = fp.get_full_path(key, name)
    return Path(path) if path else None


def resolve_model_file(keys: tuple[str, ...], name: str, what: str) -> Optional[Path]:
    """Turn a dropdown choice into a path; (none) gives None; a vanished file is a clear error."""
    if not name or name == NONE_CHOICE:
        return None
    if GGUF_FOLDER_KEY in keys:
        register_gguf_folder_key()
    for key in keys:
        path = full_path_or_none(key, name)
        if path is not None:
            return path
    folders = [f for key in keys for f in folder_list(key)]
    raise ModelFileError(
        f"{what} file '{name}' was not found in {folders or 'any ComfyUI model folder'}; "
        f"put it there and press R in the editor to refresh the lists"
    )


def resolve_diffusers_folder(name: str) -> Optional[Path]:
    if not name or name == NONE_CHOICE:
        return None
    for root in folder_list("diffusers"):
        candidate = Path(root) / name
        if (candidate / "model_index.json").is_file():
            return candidate
    raise ModelFileError(
        f"diffusers folder '{name}' with a model_index.json was not found in {folder_list('diffusers')}; "
        f"download baidu/ERNIE-Image(-Turbo) there or pick single files instead"
    )


def _is_within(path: Path, root: Path) -> bool:
    try:
        path.resolve().relative_to(root)
    except ValueError:
        return False
    return True


def user_credentials() -> Any:
    """The user's API-key bindings (runtime/net/credentials.py), read now from the keys file, which inside
    ComfyUI lives in its user directory: <user>/ernie_image/keys.json, beside the per-user folders (never served
    over ComfyUI's /userdata routes)."""
    from ..runtime.net.credentials import load_credentials

    fp = folder_paths_module()
    user_dir = fp.get_user_directory() if fp is not None and hasattr(fp, "get_user_directory") else None
    return load_credentials(user_dir)
