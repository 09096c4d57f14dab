"""The Tekken tokenizer that ComfyUI's text-encoder files carry inside them, as a transformers fast tokenizer.

Comfy-Org's `text_encoders/ministral-3-3b.safetensors` holds Mistral's `tekken.json` as the uint8 tensor
`tekken_model` (ComfyUI's sd.py hands it to the tokenizer as `tokenizer_data["tekken_model"]`). Tekken is a
tiktoken-style byte-level BPE: `vocab` lists byte strings by merge rank, `special_tokens` list the control tokens
by id. Ids: the `default_num_special_tokens` specials first, then each byte string at rank + that offset; only the
first `default_vocab_size - default_num_special_tokens` ranks are in the model's vocabulary.

The tokenizer built here behaves like the `tokenizer.json` of Baidu's diffusers folder: BOS prepended, no EOS,
control tokens matched as whole tokens, truncation at 2048.
"""
from __future__ import annotations

import base64
import json
from functools import lru_cache
from pathlib import Path
from typing import Optional, Union

import torch

from ..core.errors import ModelFileError

TEKKEN_KEY = "tekken_model"
MAX_LENGTH = 2048
# Tekken's own default split pattern (used when a tekken.json does not carry one).
DEFAULT_PATTERN = (
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+|"
    r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*|"
    r"\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)


@lru_cache(maxsize=1)
def byte_symbols() -> tuple[str, ...]:
    """GPT-2's reversible byte -> printable character table, as the `tokenizers` ByteLevel pre-tokenizer uses."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    table = {}
    extra = 0
    for byte in range(256):
        if byte in printable:
            table[byte] = chr(byte)
        else:
            table[byte] = chr(256 + extra)
            extra += 1
    return tuple(table[b] for b in range(256))


def _symbol(token: bytes) -> str:
    symbols = byte_symbols()
    return "".join(symbols[b] for b in token)


EMBEDDED = "the embedded Tekken tokenizer"
MAX_SPECIALS = 100_000  # Mistral's tekken.json reserves 1000; more is a damaged count, not a vocabulary
# What a damaged tekken.json raises while it is read: a wrong type, a missing entry, bad base64 (a ValueError).
_TEKKEN_ERRORS = (ValueError, KeyError, TypeError, AttributeError, IndexError, OverflowError)


def parse_tekken(data: Union[bytes, str], shown: str = EMBEDDED) -> tuple[dict[bytes, int], list[str], str]:
    """tekken.json -> (byte string -> rank for the usable vocabulary, special tokens by id, split pattern).
    A damaged one is one line naming it (`shown`)."""
    try:
        return _parse_tekken(data)
    except RecursionError:
        raise _unreadable(shown, "its JSON is nested too deep to read") from None
    except _TEKKEN_ERRORS as error:
        raise _unreadable(shown, _why(error)) from None


def _unreadable(shown: str, why: str) -> ModelFileError:
    fix = "re-download the text-encoder file" if shown == EMBEDDED else "the file is damaged: download it again"
    return ModelFileError(f"{shown} is unreadable ({why}): {fix}")


def _why(error: BaseException) -> str:
    if isinstance(error, KeyError):
        return f"it has no {error.args[0]!r} entry" if error.args else "an entry is missing"
    return " ".join(str(error).split())[:160] or "an entry is not what tekken.json holds"


def _parse_tekken(data: Union[bytes, str]) -> tuple[dict[bytes, int], list[str], str]:
    spec = json.loads(data)
    if not isinstance(spec, dict):
        raise ValueError(f"it holds a JSON {type(spec).__name__}, not the object of a tekken.json")
    config = spec["config"]
    entries = spec["vocab"]
    specials_listed = spec.get("special_tokens") or []
    num_special = int(config.get("default_num_special_tokens", len(specials_listed)))
    if not 0 <= num_special <= MAX_SPECIALS:
        raise ValueError(f"default_num_special_tokens {num_special} is not a count of special tokens")
    vocab_size = config.get("default_vocab_size")
    usable = int(vocab_size) - num_special if vocab_size is not None else len(entries)
    specials = [f"<SPECIAL_{i}>" for i in range(num_special)]
    for entry in specials_listed:
        if entry["rank"] < num_special:
            specials[entry["rank"]] = entry["token_str"]
    ranks = {}
    for entry in entries:
        if entry["rank"] < usable:
            ranks[base64.b64decode(entry["token_bytes"])] = int(entry["rank"])
    return ranks, specials, config.get("pattern") or DEFAULT_PATTERN


def merges_from_ranks(ranks: dict[bytes, int]) -> list[tuple[str, str]]:
    """BPE merges equivalent to tiktoken's rank-ordered merging: every way of splitting a token into two tokens,
    ordered by the merged token's rank (ties by the parts' ranks)."""
    found = []
    for token, rank in ranks.items():
        for cut in range(1, len(token)):
            left, right = token[:cut], token[cut:]
            if left in ranks and right in ranks:
                found.append((rank, ranks[left], ranks[right], left, right))
    found.sort(key=lambda item: item[:3])
    return [(_symbol(left), _symbol(right)) for *_, left, right in found]


def tokenizer_from_tekken_json(data: Union[bytes, str], max_length: int = MAX_LENGTH, shown: str = EMBEDDED):
    """The tokenizer a tekken.json describes; a damaged one is one line naming it (`shown`)."""
    ranks, specials, pattern = parse_tekken(data, shown)
    try:
        return _fast_tokenizer(ranks, specials, pattern, max_length)
    except MemoryError:
        raise
    except Exception as error:  # tokenizers refuses a bad split pattern or vocabulary as a bare Exception
        raise _unreadable(shown, _why(error)) from None


def _fast_tokenizer(ranks: dict[bytes, int], specials: list[str], pattern: str, max_length: int):
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    offset = len(specials)
    vocab = {token: index for index, token in enumerate(specials)}
    for token, rank in ranks.items():
        vocab[_symbol(token)] = rank + offset
    model = models.BPE(vocab=vocab, merges=merges_from_ranks(ranks), fuse_unk=False, byte_fallback=False,
                       ignore_merges=True, unk_token=specials[0] if specials else None)
    tokenizer = Tokenizer(model)
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(pattern), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens([AddedToken(token, special=True, normalized=False) for token in specials])
    bos = "<s>" if "<s>" in vocab else specials[1]
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{bos} $A", pair=f"{bos} $A $B", special_tokens=[(bos, vocab[bos])]
    )

    def named(name: str) -> Optional[str]:
        return name if name in vocab else None

    return PreTrainedTokenizerFast(
        tokenizer_object=tokenizer, bos_token=bos, eos_token=named("</s>"), unk_token=specials[0] if specials else None,
        pad_token=named("<pad>"), model_max_length=max_length, padding_side="right",
    )


def read_tekken_bytes(path: Path) -> Optional[bytes]:
    """The embedded tekken.json of a single-file text encoder, or None when the file carries none."""
    from .safetensors_reader import is_gguf, open_safetensors

    path = Path(path)
    if not path.is_file() or is_gguf(path):
        return None
    reader = open_safetensors(path)
    if TEKKEN_KEY not in reader:
        return None
    tensor = reader.tensor(TEKKEN_KEY)
    if tensor.dtype != torch.uint8:
        raise _unreadable(f"the Tekken tokenizer embedded in {path}", f"its {TEKKEN_KEY} tensor holds "
                          f"{str(tensor.dtype).removeprefix('torch.')} values, not the bytes of a tekken.json")
    return tensor.contiguous().numpy().tobytes()


def tokenizer_from_text_encoder_file(path: Path):
    """The tokenizer embedded in a text-encoder file (ComfyUI's ministral-3-3b), or None when there is none."""
    data = read_tekken_bytes(path)
    return None if data is None else tokenizer_from_tekken_json(data, shown=f"the Tekken tokenizer embedded in {path}")


def tekken_json_from_vocabulary(byte_tokens: list[bytes], specials: list[str], pattern: str = DEFAULT_PATTERN,
                                vocab_size: Optional[int] = None) -> bytes:
    """A tekken.json (Mistral's format) for a byte-level vocabulary in rank order; used to write test files."""
    spec = {
        "config": {"pattern": pattern, "num_vocab_tokens": len(byte_tokens),
                   "default_vocab_size": vocab_size or len(specials) + len(byte_tokens),
                   "default_num_special_tokens": len(specials), "version": "v7"},
        "vocab": [{"rank": rank, "token_bytes": base64.b64encode(token).decode("ascii"),
                   "token_str": token.decode("utf-8", errors="replace")} for rank, token in enumerate(byte_tokens)],
        "special_tokens": [{"rank": rank, "token_str": token, "is_control": True} for rank, token in enumerate(specials)],
    }
    return json.dumps(spec, ensure_ascii=False).encode("utf-8")
