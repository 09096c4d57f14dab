"""Phrases the library's messages use where each front end has words of its own (nodes/comfy_names.py,
runtime/cli/names.py map them): kept here, light to import, so a front end can map them without loading models. And
`counted`, a number with its noun as any message says it; `pe_work`, what a prompt enhancer's run cost."""
from __future__ import annotations

from typing import Any, Mapping

AUTO_BUDGET = "None for free VRAM minus a reserve"  # LoadOptions.vram_budget_gb's automatic budget
RUN_CHECKS_ITS_SIZE = "generate() checks each request's own size before it starts"


def counted(number: int, noun: str) -> str:
    """`number` `noun`s: "1 step", "8 steps", "0 images"."""
    return f"{number} {noun}{'' if number == 1 else 's'}"


def pe_work(info: Mapping[str, Any]) -> str:
    """A prompt enhancer's work as a user reads it (RevisedPrompts.info's fields): tokens, seconds and tokens per
    second; the seconds alone where no token was counted (a chat server that reports no usage)."""
    if not info.get("pe_tokens"):
        return f"{info.get('pe_s', 0.0):.2f} s (no token count reported)"
    return f"{info['pe_tokens']} tokens in {info.get('pe_s', 0.0):.2f} s, {info.get('pe_tokens_per_s', 0.0)} tokens/s"
