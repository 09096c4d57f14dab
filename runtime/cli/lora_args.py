"""`--lora PATH[:STRENGTH]` (repeatable) and `--lora-mode merge|branch` for `ernie-image generate`: the files are
checked (existence, pickles, contents) before any model is built or any model file read."""
from __future__ import annotations

import argparse
from typing import Sequence

from ..lora.files import file_stamp
from ..lora.stack import LORA_MODES, LoraStack, parse_lora_argument


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


def lora_stack(values: Sequence[str]) -> LoraStack:
    """The stack the --lora options give; a bad strength, a missing file, a pickle, a file given twice or a file
    that is not an ERNIE-Image LoRA fails here in one line."""
    from ..lora.parsed import check_lora_files

    stack = LoraStack(tuple(parse_lora_argument(value) for value in values))
    for entry in stack.entries:
        file_stamp(entry.path)
    check_lora_files(stack)
    return stack
