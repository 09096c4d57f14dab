"""A tiny prompt enhancer in Baidu's folder layout, for tests and the no-weights demo.

`runtime/demo/tiny.py` builds the model and gives it weights whose next-token distribution depends on the prompt
(default init makes a tiny tied-embedding model echo its last token) and writes `pe/` + `pe_tokenizer/` the way
Baidu ships them: a tokenizer that does not add BOS by itself (the chat template writes it) and the chat template
with the fixed system text.
"""
from __future__ import annotations

from pathlib import Path
from typing import Optional

import torch

from ..files.output_files import give_usual_mode, safetensors_under
from ..text.pe_prompt import ERNIE_PE_CHAT_TEMPLATE
from .tiny import lively_prompt_enhancer, write_pe_tokenizer

__all__ = ["build_tiny_pe_folder", "lively_prompt_enhancer", "write_pe_tokenizer"]


def build_tiny_pe_folder(dest: Path, seed: int = 0, chat_template: str = ERNIE_PE_CHAT_TEMPLATE,
                         adds_bos: bool = False, max_length: int = 2048, model: Optional[torch.nn.Module] = None) -> Path:
    """Write `dest/pe/` and `dest/pe_tokenizer/`; returns `dest` (usable as ModelSources(model_dir=dest))."""
    dest = Path(dest)
    (model or lively_prompt_enhancer(seed=seed)).save_pretrained(dest / "pe")
    give_usual_mode(safetensors_under(dest / "pe"))
    write_pe_tokenizer(dest / "pe_tokenizer", chat_template, adds_bos, max_length)
    return dest
