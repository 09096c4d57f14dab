"""`--lora PATH[:STRENGTH]` (repeatable) and `--lora-mode merge|branch` for `ernie-image generate`: the files are
checked (existence, pickles, contents) before any model is built or any model file read."""
from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import Sequence

from ..core.errors import InvalidInputError
from ..core.number_text import DECIMAL_RULE, decimal_from_text
from ..lora.files import file_stamp
from ..lora.stack import LORA_MODES, MAX_STRENGTH, LoraEntry, LoraStack, check_strength

DRIVE_LETTERS = os.name == "nt"  # where "C:" before a colon is a drive, not a file named C


def add_lora_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--lora", action="append", default=[], metavar="PATH[:STRENGTH]",
                        help="a LoRA .safetensors and its strength (default 1.0, -10..10); repeat for a stack. "
                             "The last colon starts the strength; on Windows a single letter before it, either "
                             "case, is a drive: c:0.5 is the file 0.5 on drive C:, C:\\loras\\x.safetensors:0.8 "
                             "that file at 0.8")
    parser.add_argument("--lora-mode", choices=LORA_MODES, default=None,  # None: not given (merge)
                        help="merge: add the LoRAs into the resident weights (no cost per step; the originals are "
                             "kept in host RAM); branch: run them beside the weights (a few %% per step, no host "
                             "copy). Streamed blocks, GGUF and NVFP4 weights always take the branch (default: merge)")


def parse_lora_argument(text: str) -> LoraEntry:
    """`PATH[:STRENGTH]` (the CLI's --lora): strength 1.0 when left out. The last colon starts the strength; on
    Windows a single letter before it, in either case, is a drive, part of the path (C:0.5 and c:0.5 are the file
    0.5 on that drive; C:\\x.safetensors:0.5 is x.safetensors at 0.5), elsewhere it is a file name (c:0.5 is the
    file c at 0.5). Nothing before the colon is an error. The strength is a plain decimal (core/number_text): a
    tail such as ` 0.5`, `1_0`, `nan` or other scripts' digits is no strength, refused after a .safetensors path."""
    path, sep, tail = text.rpartition(":")
    drive = DRIVE_LETTERS and len(path) == 1 and path.isalpha()
    strength = decimal_from_text(tail, f"LoRA {Path(path).name} strength", (-MAX_STRENGTH, MAX_STRENGTH))
    if sep and path and strength is not None and not drive:
        return LoraEntry(Path(path), check_strength(strength, Path(path).name))
    if not text:
        raise InvalidInputError("--lora needs a file: give --lora PATH or --lora PATH:STRENGTH")
    if sep and not path:
        fix = f"--lora PATH{text}" if strength is not None else "--lora PATH or --lora PATH:STRENGTH"
        raise InvalidInputError(f"--lora {text!r} names no file before the colon: give {fix} (PATH: the LoRA "
                                ".safetensors)")
    if sep and Path(path).suffix.lower() == ".safetensors":
        raise InvalidInputError(f"LoRA {Path(path).name} strength {tail!r} is not a number: give --lora "
                                f"{path}:0.8 ({DECIMAL_RULE}), or leave ':STRENGTH' out for 1.0")
    return LoraEntry(Path(text))


def lora_stack(values: Sequence[str]) -> LoraStack:
    """The stack the --lora options give; a bad strength, a missing file, a pickle, a file given twice or a file
    that is not an ERNIE-Image LoRA fails here in one line."""
    from ..lora.parsed import check_lora_files

    stack = LoraStack(tuple(parse_lora_argument(value) for value in values))
    for entry in stack.entries:
        file_stamp(entry.path)
    check_lora_files(stack)
    return stack
