"""A tiny prompt enhancer in Baidu's folder layout, for tests and the no-weights demo.

`runtime/tiny.py` builds the model; this gives it weights whose next-token distribution depends on the prompt
(default init makes a tiny tied-embedding model echo its last token) and writes `pe/` + `pe_tokenizer/` the way
Baidu ships them: a tokenizer that does not add BOS by itself (the chat template writes it) and the chat template
with the fixed system text.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

import torch

from ..tiny import TinySizes, build_prompt_enhancer, save_tokenizer
from .pe_prompt import ERNIE_PE_CHAT_TEMPLATE


def lively_prompt_enhancer(sizes: TinySizes = TinySizes(), seed: int = 0):
    model = build_prompt_enhancer(sizes, seed)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("embed_tokens.weight"):
                param.copy_(torch.randn(param.shape, generator=generator) * 0.05)
            elif param.ndim == 2:
                param.copy_(torch.randn(param.shape, generator=generator) * 0.3)
    return model


def write_pe_tokenizer(folder: Path, chat_template: str = ERNIE_PE_CHAT_TEMPLATE, adds_bos: bool = False,
                       max_length: int = 2048) -> None:
    save_tokenizer(folder, chat_template=chat_template, max_length=max_length)
    if not adds_bos:
        spec = json.loads((folder / "tokenizer.json").read_text())
        spec["post_processor"] = None
        (folder / "tokenizer.json").write_text(json.dumps(spec))
        config = json.loads((folder / "tokenizer_config.json").read_text())
        config["add_bos_token"] = False
        (folder / "tokenizer_config.json").write_text(json.dumps(config, indent=2))


def build_tiny_pe_folder(dest: Path, seed: int = 0, chat_template: str = ERNIE_PE_CHAT_TEMPLATE,
                         adds_bos: bool = False, max_length: int = 2048, model: Optional[torch.nn.Module] = None) -> Path:
    """Write `dest/pe/` and `dest/pe_tokenizer/`; returns `dest` (usable as ModelSources(model_dir=dest))."""
    dest = Path(dest)
    (model or lively_prompt_enhancer(seed=seed)).save_pretrained(dest / "pe")
    write_pe_tokenizer(dest / "pe_tokenizer", chat_template, adds_bos, max_length)
    return dest
