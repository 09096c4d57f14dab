"""Phrases the library's messages use where each front end has words of its own (nodes/comfy_names.py,
runtime/cli/names.py map them): kept here, light to import, so a front end can map them without loading models. And
`counted`, a number with its noun as any message says it."""
from __future__ import annotations

AUTO_BUDGET = "None for free VRAM minus a reserve"  # LoadOptions.vram_budget_gb's automatic budget
RUN_CHECKS_ITS_SIZE = "generate() checks each request's own size before it starts"


def counted(number: int, noun: str) -> str:
    """`number` `noun`s: "1 step", "8 steps", "0 images"."""
    return f"{number} {noun}{'' if number == 1 else 's'}"
