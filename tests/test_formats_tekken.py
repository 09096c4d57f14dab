"""The Tekken tokenizer embedded in ComfyUI's text-encoder files (`tekken_model`, the bytes of tekken.json) gives
the same ids as the reference tokenizer: BOS first, no EOS, byte-level BPE by tiktoken ranks, truncation at 2048."""
from __future__ import annotations

import json

import pytest
import regex
import torch
from safetensors.torch import save_file

from ernie_image.runtime.demo.comfy_files import tiny_tekken_bytes
from ernie_image.runtime.demo.tiny import BOS_ID, SPECIAL_TOKENS, save_tokenizer
from ernie_image.runtime.formats.tekken import (
    DEFAULT_PATTERN, byte_symbols, merges_from_ranks, parse_tekken, tekken_json_from_vocabulary,
    tokenizer_from_tekken_json, tokenizer_from_text_encoder_file,
)
from ernie_image.runtime.text.encoder import MAX_TOKENS, token_ids

PROMPTS = [
    "a red fox in snow",
    "An old STONE bridge, 1850s oil painting; soft light!",
    "ünïcødé — 狐狸在雪地里 🦊 ",
    "  leading and trailing spaces\n\tand tabs  ",
    "",
]


@pytest.fixture(scope="module")
def reference_tokenizer(tmp_path_factory):
    from transformers import AutoTokenizer

    folder = tmp_path_factory.mktemp("tokenizer")
    save_tokenizer(folder)
    return AutoTokenizer.from_pretrained(str(folder))


def test_byte_symbols_are_the_byte_level_alphabet():
    from tokenizers.pre_tokenizers import ByteLevel

    assert sorted(byte_symbols()) == sorted(ByteLevel.alphabet())


@pytest.mark.parametrize("prompt", PROMPTS)
def test_tiny_tekken_matches_the_tokenizer_json_path(prompt, reference_tokenizer):
    tekken = tokenizer_from_tekken_json(tiny_tekken_bytes())
    assert token_ids(tekken, prompt) == token_ids(reference_tokenizer, prompt)
    assert token_ids(tekken, prompt)[0] == BOS_ID


def test_empty_prompt_is_a_single_bos_token(reference_tokenizer):
    tekken = tokenizer_from_tekken_json(tiny_tekken_bytes())
    assert token_ids(tekken, "") == [BOS_ID] == token_ids(reference_tokenizer, "")


def test_truncation_at_2048_tokens_like_the_reference(reference_tokenizer):
    tekken = tokenizer_from_tekken_json(tiny_tekken_bytes())
    long_prompt = "stone " * 1000
    ours = token_ids(tekken, long_prompt)
    assert len(ours) == MAX_TOKENS
    assert ours == token_ids(reference_tokenizer, long_prompt)


def test_special_tokens_keep_their_ids():
    tekken = tokenizer_from_tekken_json(tiny_tekken_bytes())
    assert [tekken.convert_tokens_to_ids(t) for t in SPECIAL_TOKENS] == list(range(len(SPECIAL_TOKENS)))
    assert tekken.bos_token_id == 1 and tekken.eos_token_id == 2 and tekken.pad_token_id == 11


# A vocabulary with merges: bytes first, then multi-byte tokens; ranks beyond default_vocab_size are not usable.
MERGED = [b"st", b"on", b"ston", b"stone", b" s", b" stone", b"\xc3\xbc", b"re", b"red", b" red", b"ow"]
SPECIALS = list(SPECIAL_TOKENS)


def _merged_tekken(vocab_size=None) -> bytes:
    tokens = [bytes([b]) for b in range(256)] + MERGED
    return tekken_json_from_vocabulary(tokens, SPECIALS, DEFAULT_PATTERN, vocab_size=vocab_size)


def _tiktoken_reference(data: bytes, text: str) -> list[int]:
    """tiktoken's algorithm, written out: split by the pattern, then merge the lowest-ranked adjacent pair."""
    ranks, specials, pattern = parse_tekken(data)
    ids = [BOS_ID]
    for piece in regex.findall(pattern, text):
        parts = [bytes([b]) for b in piece.encode("utf-8")]
        while len(parts) > 1:
            candidates = [(ranks.get(parts[i] + parts[i + 1]), i) for i in range(len(parts) - 1)]
            candidates = [(rank, i) for rank, i in candidates if rank is not None]
            if not candidates:
                break
            _, i = min(candidates)
            parts[i:i + 2] = [parts[i] + parts[i + 1]]
        ids.extend(ranks[p] + len(specials) for p in parts)
    return ids


MERGE_PROMPTS = ["stone red stone", "a red stone, über snow", "restone  stones", "", "ü ü"]


@pytest.mark.parametrize("prompt", MERGE_PROMPTS)
def test_merges_follow_tiktoken_rank_order(prompt):
    data = _merged_tekken()
    assert token_ids(tokenizer_from_tekken_json(data), prompt) == _tiktoken_reference(data, prompt)


def test_ranks_beyond_the_default_vocab_size_are_not_used():
    cut = len(SPECIALS) + 256 + MERGED.index(b"stone")  # "stone" and everything ranked after it are out
    tokenizer = tokenizer_from_tekken_json(_merged_tekken(vocab_size=cut))
    ids = token_ids(tokenizer, "stone")
    assert max(ids) < cut
    assert len(ids) > 2


def test_merges_list_every_split_of_a_token_into_two_tokens():
    ranks = {b"a": 0, b"b": 1, b"c": 2, b"ab": 3, b"bc": 4, b"abc": 5}
    assert merges_from_ranks(ranks) == [("a", "b"), ("b", "c"), ("a", "bc"), ("ab", "c")]


@pytest.mark.parametrize("prompt", MERGE_PROMPTS + PROMPTS[:3])
def test_matches_mistral_common(prompt, tmp_path):
    from mistral_common.tokens.tokenizers import tekken as tekken_module  # in the test extra: never skipped

    path = tmp_path / "tekken.json"
    path.write_bytes(_merged_tekken())
    theirs = tekken_module.Tekkenizer.from_file(str(path)).encode(prompt, bos=True, eos=False)
    assert token_ids(tokenizer_from_tekken_json(path.read_bytes()), prompt) == theirs


def test_tokenizer_is_read_from_the_text_encoder_file(tmp_path, reference_tokenizer):
    path = tmp_path / "ministral-3-3b.safetensors"
    data = tiny_tekken_bytes()
    save_file({"model.embed_tokens.weight": torch.zeros(4, 4),
               "tekken_model": torch.frombuffer(bytearray(data), dtype=torch.uint8)}, str(path))
    tokenizer = tokenizer_from_text_encoder_file(path)
    assert token_ids(tokenizer, PROMPTS[2]) == token_ids(reference_tokenizer, PROMPTS[2])


def test_a_file_without_an_embedded_tokenizer_gives_none(tmp_path):
    path = tmp_path / "te.safetensors"
    save_file({"model.embed_tokens.weight": torch.zeros(4, 4)}, str(path))
    assert tokenizer_from_text_encoder_file(path) is None


def test_unreadable_tekken_json_is_a_clear_error():
    from ernie_image.runtime.core.errors import ModelFileError

    with pytest.raises(ModelFileError, match="Tekken tokenizer is unreadable"):
        tokenizer_from_tekken_json(json.dumps({"vocab": []}).encode())
