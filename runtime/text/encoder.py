"""Prompt -> text embeddings: each prompt tokenised alone (no padding, truncated at 2048), hidden_states[-2]."""
from __future__ import annotations

from typing import Sequence

import torch

MAX_TOKENS = 2048


def token_ids(tokenizer, prompt: str) -> list[int]:
    ids = tokenizer(prompt, add_special_tokens=True, truncation=True, max_length=MAX_TOKENS, padding=False)["input_ids"]
    if not ids:
        ids = [tokenizer.bos_token_id if tokenizer.bos_token_id is not None else 0]
    return list(ids)


@torch.no_grad()
def encode_prompts(tokenizer, tower, prompts: Sequence[str]) -> list[torch.Tensor]:
    """One [T_i, D] tensor per prompt. `tower` is the text model cut after the layer hidden_states[-2] reads."""
    device = tower.embed_tokens.weight.device
    embeddings = []
    for prompt in prompts:
        ids = torch.tensor([token_ids(tokenizer, prompt)], device=device)
        embeddings.append(tower(input_ids=ids).last_hidden_state[0])
    return embeddings


def pad_text(embeddings: Sequence[torch.Tensor], device, dtype) -> tuple[torch.Tensor, list[int]]:
    """Zero-pad to the longest prompt: [B, Tmax, D] plus the true lengths."""
    lengths = [int(e.shape[0]) for e in embeddings]
    text = torch.zeros((len(embeddings), max(lengths), embeddings[0].shape[-1]), device=device, dtype=dtype)
    for row, embedding in enumerate(embeddings):
        text[row, : embedding.shape[0]] = embedding.to(device=device, dtype=dtype)
    return text, lengths
