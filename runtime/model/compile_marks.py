"""Whether this machine's torch.compile caches already hold the DiT's compiled blocks.

The pack leaves a mark in inductor's own cache folder once blocks of a weight format have compiled there on this GPU
with this torch: compiling them again then mostly loads from that cache (H200: 2.4-3.7 s against 7-20 s from empty
caches, docs/performance.md#the-first-image-after-a-restart). The mark lives beside what it vouches for, so a cache
that is wiped (a reboot clears /tmp, where inductor keeps it unless TORCHINDUCTOR_CACHE_DIR says otherwise) takes
the mark with it. A mark that cannot be read or written only makes the next process price a compile from empty caches.
"""
from __future__ import annotations

import getpass
import json
import os
import re
import tempfile
import time
from pathlib import Path

import torch

MARKS_FILE = "ernie_image_compiled.json"


def inductor_cache_folder() -> Path:
    """Where inductor keeps its cache, found as torch/_inductor/runtime/cache_dir_utils.py finds it
    (TORCHINDUCTOR_CACHE_DIR, else `torchinductor_<user>` in the temporary folder), without creating it: importing
    torch._inductor to ask it would import torch._dynamo, which makes the folder (dynamo_import.py)."""
    asked = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    if asked is None:
        try:
            user = getpass.getuser()
        except (KeyError, ModuleNotFoundError, OSError):
            getuid = getattr(os, "getuid", None)
            user = f"uid_{getuid()}" if callable(getuid) else "unknown_user"
        asked = os.path.join(tempfile.gettempdir(), "torchinductor_" + re.sub(r'[\\/:*?"<>|]', "_", user))
    return Path(os.path.abspath(asked))


def device_name(device: torch.device) -> str:
    return torch.cuda.get_device_name(device)


BLOCKS_VERSION = 2  # raised when the blocks' compiled graph changes (2: FP8 projections stacked on load)


def _key(weight_format: str, device: torch.device) -> str:
    return f"{weight_format} | {device_name(device)} | torch {torch.__version__} | blocks {BLOCKS_VERSION}"


def _marks(folder: Path) -> dict:
    try:
        marks = json.loads((folder / MARKS_FILE).read_text())
    except (OSError, ValueError, RecursionError):
        return {}
    return marks if isinstance(marks, dict) else {}


def caches_hold(weight_format: str, device: torch.device) -> bool:
    """Whether blocks of `weight_format` have compiled into this machine's inductor cache on this GPU and torch."""
    if torch.device(device).type != "cuda":  # blocks compile on CUDA only
        return False
    return _key(weight_format, device) in _marks(inductor_cache_folder())


def mark_compiled(weight_format: str, device: torch.device) -> None:
    """Record that blocks of `weight_format` compiled here (after a job ran them compiled)."""
    folder = inductor_cache_folder()
    if not folder.is_dir():
        return
    marks = _marks(folder)
    marks[_key(weight_format, device)] = time.strftime("%Y-%m-%d %H:%M:%S")
    scratch = folder / f".{MARKS_FILE}.{os.getpid()}"
    try:
        scratch.write_text(json.dumps(marks, indent=1))
        os.replace(scratch, folder / MARKS_FILE)
    except OSError:
        scratch.unlink(missing_ok=True)
