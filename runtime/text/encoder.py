"""Prompt -> text embeddings: each prompt tokenised alone (no padding, truncated at 2048), hidden_states[-2]."""
from __future__ import annotations

from typing import Callable, Optional, Sequence

import torch

from ..formats.tokenizer_fit import origin_of, refuse_ids_beyond, refuse_unfit

MAX_TOKENS = 2048
TOKENS_RANGE = (1, MAX_TOKENS)  # the tokens a padded prompt may hold


def token_ids(tokenizer, prompt: str) -> list[int]:
    return encoder_token_ids(tokenizer, prompt)[0]


def encoder_token_ids(tokenizer, prompt: str) -> tuple[list[int], int]:
    """The ids the text encoder sees (cut at MAX_TOKENS, as diffusers cuts) and the prompt's full token count."""
    # verbose=False: transformers would warn of "indexing errors" for a prompt over its 2048; it is cut here, and the
    # caller tells the user so in its own notice (cut_notice).
    ids = list(tokenizer(prompt, add_special_tokens=True, truncation=False, padding=False, verbose=False)["input_ids"])
    if not ids:
        ids = [tokenizer.bos_token_id if tokenizer.bos_token_id is not None else 0]
    return ids[:MAX_TOKENS], len(ids)


def cut_notice(prompt: str, tokens: int) -> str:
    return (f"prompt of {tokens} tokens cut to the text encoder's {MAX_TOKENS} (\"{' '.join(prompt.split())[:40]}...\"): "
            "the words after that do not reach the image; shorten the prompt")


def embedding_rows(tower) -> Optional[int]:
    """The rows of a text model's token embedding (None where it holds no table: released)."""
    weight = getattr(tower.embed_tokens, "weight", None)
    return int(weight.shape[0]) if weight is not None and weight.dim() == 2 and weight.shape[0] else None


@torch.no_grad()
def encode_prompts(tokenizer, tower, prompts: Sequence[str],
                   log: Optional[Callable[[str], None]] = None) -> list[torch.Tensor]:
    """One [T_i, D] tensor per prompt. `tower` is the text model cut after the layer hidden_states[-2] reads.

    A tokenizer with ids past the tower's embedding is refused before any prompt is encoded (tokenizer_fit.py).
    `log` is told of each prompt cut at MAX_TOKENS."""
    device = tower.embed_tokens.weight.device
    rows = embedding_rows(tower)
    encoder = origin_of(tokenizer).text_encoder
    if rows is not None:
        refuse_unfit(tokenizer, rows, "text encoder", encoder)
    embeddings = []
    for prompt in prompts:
        ids, tokens = encoder_token_ids(tokenizer, prompt)
        if rows is not None:
            refuse_ids_beyond(tokenizer, ids, prompt, rows, "text encoder", encoder)
        if tokens > MAX_TOKENS and log is not None:
            log(cut_notice(prompt, tokens))
        ids = torch.tensor([ids], device=device)
        embeddings.append(tower(input_ids=ids).last_hidden_state[0])
    return embeddings


def pad_text(embeddings: Sequence[torch.Tensor], device, dtype) -> tuple[torch.Tensor, list[int]]:
    """Zero-pad to the longest prompt: [B, Tmax, D] plus the true lengths."""
    lengths = [int(e.shape[0]) for e in embeddings]
    text = torch.zeros((len(embeddings), max(lengths), embeddings[0].shape[-1]), device=device, dtype=dtype)
    for row, embedding in enumerate(embeddings):
        text[row, : embedding.shape[0]] = embedding.to(device=device, dtype=dtype)
    return text, lengths
