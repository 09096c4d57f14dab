"""The no-weights demo: a tiny random ERNIE-Image model built in code once, in a cache folder.

Its pixels are noise; it shows the whole path (files, text encoder, sampling, decode, PNG) working without a
download. `ERNIE_IMAGE_CACHE` moves the cache (default ~/.cache/ernie-image).
"""
from __future__ import annotations

import contextlib
import os
import shutil
from pathlib import Path
from typing import Iterator, Optional

from ..core.errors import ErnieImageError, ModelFileError
from ..core.variant import Variant
from ..files.output_files import error_number, full_disk
from ..files.uninterrupted import uninterrupted
from ..formats.sources import ModelSources

DEMO_VERSION = "v1"


def default_cache_dir() -> Path:
    root = os.environ.get("ERNIE_IMAGE_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "ernie-image")
    return Path(root)


def demo_model_folder(variant: Variant = "turbo", cache_dir: Optional[Path] = None) -> Path:
    return Path(cache_dir or default_cache_dir()) / f"tiny-{variant}-{DEMO_VERSION}"


def demo_model_sources(variant: Variant = "turbo", cache_dir: Optional[Path] = None) -> ModelSources:
    """The tiny demo model's files, built on first use.

    Built in a private folder and renamed into place when complete, so a Ctrl-C or a failure leaves no half-built
    model, and two first runs at once each build their own and the first rename wins."""
    folder = demo_model_folder(variant, cache_dir)
    if not (folder / ".complete").exists():
        _build(folder, variant)
    return ModelSources(model_dir=folder)


def _build(folder: Path, variant: Variant) -> None:
    from .tiny import build_tiny_model

    building = folder.with_name(f".{folder.name}.{os.getpid()}.partial")
    try:
        if folder.exists():  # an older build without its marker: incomplete, replaced
            shutil.rmtree(folder)
        with _quiet_transformers():
            build_tiny_model(building, layout="diffusers", variant=variant)
        (building / ".complete").write_text("ok")
        try:
            building.rename(folder)
        except OSError:
            if not (folder / ".complete").exists():  # not another run's finished build: a real failure
                raise
    except Exception as error:  # safetensors and tokenizers report a failed write as errors of their own
        if not isinstance(error, OSError) and error_number(error) is None:
            raise
        raise _build_error(folder, error) from None
    finally:
        # ours, when another run's build won or this one failed; a second Ctrl-C cannot stop it half way
        with uninterrupted():
            shutil.rmtree(building, ignore_errors=True)


def _build_error(folder: Path, error: Exception) -> ErnieImageError:
    full = full_disk(error)
    if full is not None:
        return ErnieImageError(f"cannot build the demo model in {folder}: {full}: free space on that disk, or set "
                               "ERNIE_IMAGE_CACHE to a folder on another disk, or give a real model (model_dir)"
                               ).naming("model_dir")
    reason = getattr(error, "strerror", None) or error
    return ErnieImageError(f"cannot build the demo model in {folder}: {reason}: set ERNIE_IMAGE_CACHE to a writable "
                           "folder, or give a real model (model_dir)").naming("model_dir")


@contextlib.contextmanager
def _quiet_transformers() -> Iterator[None]:
    """The tiny configs' warnings and the save progress bars say nothing to a user of the demo."""
    from transformers.utils import logging as hf_logging

    verbosity = hf_logging.get_verbosity()
    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        hf_logging.set_verbosity(verbosity)
        hf_logging.enable_progress_bar()


def check_demo_job(options, variant: Variant = "turbo", job=None) -> None:
    """What a LocalPipe checks from a model's file headers, checked on the demo model's shapes (its configs, built
    on the meta device: no weights) whether or not it is built yet: a quant format its DiT cannot be packed in, and
    for `job` (a GenerationRequest, or None) its settings with the demo variant's defaults (a step-cache schedule
    against the steps) and a VRAM budget below what it needs."""
    from ..local.checks import check_quant_packs
    from ..local.pipe import LocalPipe
    from .tiny import model_shapes

    if job is not None:
        job = job.with_defaults(variant)
        job.validate()
    dit_config, text_config, vae_config, dit_weights = model_shapes()
    check_quant_packs(options.quant, dit_weights)
    if job is not None:
        memory = LocalPipe(ModelSources(model_dir=demo_model_folder(variant)), options, variant).memory  # reads no file
        memory.check_job(job, memory.sizes_from_configs(dit_config, text_config, vae_config))


def load_demo_pipe(options=None, variant: Variant = "turbo", cache_dir: Optional[Path] = None, job=None):
    """A LocalPipe on the demo model. A damaged cache (a file cut short, edited or removed) is one line naming the
    folder and the fix: delete it and it is rebuilt. Options it cannot run with, and a `job` (the GenerationRequest
    it will run first, or None) it would refuse (a budget too small, a step-cache schedule of another length), are
    refused before it is built or read (check_demo_job)."""
    from ..local.options import LoadOptions, resolve_device
    from ..local.pipe import LocalPipe

    options = options or LoadOptions()
    options.validate()
    resolve_device(options.device)  # no CUDA for --device cuda is not a damaged demo model
    if job is not None or not (demo_model_folder(variant, cache_dir) / ".complete").exists():
        check_demo_job(options, variant, job)
    sources = demo_model_sources(variant, cache_dir)
    try:
        return LocalPipe.load(sources, options)
    except ModelFileError as error:
        raise ModelFileError(f"the demo model in {sources.model_dir} is damaged ({error}); delete that folder and "
                             "run again: it is rebuilt") from None
