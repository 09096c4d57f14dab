"""The no-weights demo: a tiny random ERNIE-Image model built in code once, in a cache folder.

Its pixels are noise; it shows the whole path (files, text encoder, sampling, decode, PNG) working without a
download. `ERNIE_IMAGE_CACHE` moves the cache (default ~/.cache/ernie-image).
"""
from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Optional

from .errors import ErnieImageError, ModelFileError
from .model_files import ModelSources, Variant

DEMO_NOTICE = (
    "no model given: using a tiny random ERNIE-Image model built in code at {path}. "
    "Its pixels are noise from a demo model, not a real image; pass --model-dir or --dit/--text-encoder/--vae."
)
DEMO_VERSION = "v1"


def default_cache_dir() -> Path:
    root = os.environ.get("ERNIE_IMAGE_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "ernie-image")
    return Path(root)


def demo_model_folder(variant: Variant = "turbo", cache_dir: Optional[Path] = None) -> Path:
    return Path(cache_dir or default_cache_dir()) / f"tiny-{variant}-{DEMO_VERSION}"


def demo_model_sources(variant: Variant = "turbo", cache_dir: Optional[Path] = None) -> ModelSources:
    """The tiny demo model's files, built on first use (a marker file says the folder is complete)."""
    folder = demo_model_folder(variant, cache_dir)
    if (folder / ".complete").exists():
        return ModelSources(model_dir=folder)
    from .tiny import build_tiny_model

    shutil.rmtree(folder, ignore_errors=True)
    try:
        sources = build_tiny_model(folder, layout="diffusers", variant=variant)
        (folder / ".complete").write_text("ok")
    except BaseException as error:
        shutil.rmtree(folder, ignore_errors=True)  # no half-built demo model left behind (Ctrl-C too)
        if isinstance(error, OSError):
            raise ErnieImageError(f"cannot build the demo model in {folder}: {error.strerror or error}: set "
                                  "ERNIE_IMAGE_CACHE to a writable folder, or pass --model-dir") from None
        raise
    return sources


def load_demo_pipe(options=None, variant: Variant = "turbo", cache_dir: Optional[Path] = None):
    """A LocalPipe on the demo model. A damaged cache (a file cut short, edited or removed) is one line naming the
    folder and the fix: delete it and it is rebuilt."""
    from .local_pipe import LocalPipe

    sources = demo_model_sources(variant, cache_dir)
    try:
        return LocalPipe.load(sources, options)
    except ModelFileError as error:
        raise ModelFileError(f"the demo model in {sources.model_dir} is damaged ({error}); delete that folder and "
                             "run again: it is rebuilt") from None
