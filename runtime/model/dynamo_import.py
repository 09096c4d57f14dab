"""torch._dynamo imported without leaving inductor's cache folder behind in a process that compiles nothing.

Importing torch._dynamo creates inductor's cache folder (`$TMPDIR/torchinductor_<user>`, or TORCHINDUCTOR_CACHE_DIR)
in torch 2.13: torch/_dynamo/package.py builds its DynamoCache at import, through cache_dir(), which makes the folder
and sets TORCHINDUCTOR_CACHE_DIR. diffusers' and transformers' model classes import torch._dynamo, so an eager CPU
run would leave an empty folder in the temporary folder. libraries.py, the one module those classes are imported
through, calls `import_dynamo` before importing one: it imports torch._dynamo first and takes back what that import
made (the folders that were not there before, while they are empty, and the variable). A compile later makes the
folder again, as inductor makes it before every write.
"""
from __future__ import annotations

import os
import sys
from pathlib import Path

from .compile_marks import inductor_cache_folder


def import_dynamo() -> None:
    """Import torch._dynamo, leaving no cache folder or variable that the import alone made."""
    if "torch._dynamo" in sys.modules:
        return
    variable = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    missing = _missing_folders(inductor_cache_folder())  # found as inductor finds it, not made
    import torch._dynamo  # noqa: F401

    for made in missing:  # the deepest first; a folder something was written into stays
        try:
            made.rmdir()
        except OSError:
            break
    if variable is None:
        os.environ.pop("TORCHINDUCTOR_CACHE_DIR", None)


def _missing_folders(folder: Path) -> list[Path]:
    """`folder` and those of its parents that do not exist yet, the deepest first."""
    missing = []
    while not os.path.lexists(folder) and folder.parent != folder:
        missing.append(folder)
        folder = folder.parent
    return missing
