"""`--lora PATH[:STRENGTH]` for `ernie-image generate`: repeatable, checked before any weights are read."""
from __future__ import annotations

import argparse
from typing import Sequence

from .files import file_stamp
from .stack import LoraStack, parse_lora_argument


def add_lora_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--lora", action="append", default=[], metavar="PATH[:STRENGTH]",
                        help="a LoRA .safetensors and its strength (default 1.0, -10..10); repeat for a stack")


def lora_stack(values: Sequence[str]) -> LoraStack:
    """The stack the --lora options give; a bad strength, a missing file or a pickle fails here in one line."""
    stack = LoraStack(tuple(parse_lora_argument(value) for value in values))
    for entry in stack.entries:
        file_stamp(entry.path)
    return stack
