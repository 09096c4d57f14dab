"""Whether a tokenizer fits the model whose token embedding reads its ids: a tokenizer of another model (a --tokenizer
or tokenizer/ folder that came with something else) gives ids the embedding has no row for, which torch reports as
an IndexError deep inside the embedding. Refused in one line naming both, before any prompt is encoded.

The check is on the tokenizer as a whole (its vocabulary and added tokens, and the ids its template adds such as
BOS), held against the embedding's rows once, when the two first meet, so every prompt is refused alike, not only
those that hit an id past the end. A tokenizer smaller than the embedding is fine: the released embeddings have
rows no token uses. ERNIE-Image's released tokenizers use exactly the ids of its Ministral-3 embeddings (131072),
so a tokenizer with an id past them is never the one released with the model. `refuse_ids_beyond` is the last
guard for an id the vocabulary does not list (a post-processor's own id), per prompt."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, Sequence

from ..core.errors import ModelFileError, quoted_shortly

_ORIGIN = "_ernie_image_origin"
_LARGEST = "_ernie_image_largest_id"


@dataclass(frozen=True)
class TokenizerOrigin:
    """Where a tokenizer came from, as a refusal names it."""

    shown: str  # "the tokenizer in /m/tokenizer", "tokenizer /t" (one given explicitly)
    fix: str  # how to get the right one; "{part}" is the model it must fit ("text encoder", "prompt enhancer")
    settings: tuple[str, ...] = ()  # the settings `shown` and `fix` name (ModelFileError.naming)
    text_encoder: Optional[str] = None  # the text encoder it was found for, where one was given


UNKNOWN = TokenizerOrigin("the tokenizer", "give the tokenizer released with this {part}")


def folder_origin(folder: object, released: str, text_encoder: Optional[str] = None) -> TokenizerOrigin:
    """A model folder's tokenizer (`released`: its folder's name there, "tokenizer" or "pe_tokenizer")."""
    return TokenizerOrigin(f"the tokenizer in {folder}", "give the tokenizer released with this {part}: download "
                           f"the model's {released}/ folder again", (), text_encoder)


def given_origin(path: object, text_encoder: Optional[str] = None) -> TokenizerOrigin:
    """A tokenizer the user gave explicitly (the `tokenizer` setting)."""
    return TokenizerOrigin(f"tokenizer {path}", "give the tokenizer released with this {part} (the tokenizer/ folder "
                           "of its diffusers download), or leave the tokenizer out", ("tokenizer",), text_encoder)


def embedded_origin(path: object, text_encoder: Optional[str] = None) -> TokenizerOrigin:
    """The Tekken tokenizer a single file embeds."""
    return TokenizerOrigin(f"the tokenizer embedded in {path}", "give the tokenizer released with this {part}: the "
                           "file may be damaged: download it again", (), text_encoder)


def remember_origin(tokenizer: Any, origin: TokenizerOrigin) -> Any:
    """`tokenizer`, recording where it came from for a later refusal (returned, to use in one expression)."""
    setattr(tokenizer, _ORIGIN, origin)
    return tokenizer


def origin_of(tokenizer: Any) -> TokenizerOrigin:
    return getattr(tokenizer, _ORIGIN, None) or UNKNOWN


def largest_token_id(tokenizer: Any) -> int:
    """The largest id `tokenizer` gives: of its vocabulary with its added tokens, and of what its template adds to a
    prompt (BOS). Computed once a tokenizer (the vocabulary is a dict of 131072 entries)."""
    largest = getattr(tokenizer, _LARGEST, None)
    if largest is None:
        ids = list(tokenizer.get_vocab().values())
        ids += list(getattr(tokenizer, "added_tokens_decoder", None) or ())
        ids += list(tokenizer("", add_special_tokens=True)["input_ids"])
        largest = max((int(i) for i in ids), default=-1)
        setattr(tokenizer, _LARGEST, largest)
    return largest


def _model(part: str, weights: Optional[object]) -> str:
    return f"the {part} {weights}" if weights is not None else f"the {part}"


def _rows(rows: int) -> str:
    return f"{rows} rows (ids 0 to {rows - 1})"


def refuse_unfit(tokenizer: Any, rows: int, part: str, weights: Optional[object]) -> None:
    """One line when `tokenizer` has an id past the `rows` of the embedding of `part` (its `weights`, when known)."""
    largest = largest_token_id(tokenizer)
    if largest >= rows:
        raise _refusal(tokenizer, part, f"does not fit {_model(part, weights)}: the tokenizer has token ids up to "
                                        f"{largest} but the {part}'s embedding has {_rows(rows)}")


def refuse_ids_beyond(tokenizer: Any, ids: Sequence[int], prompt: str, rows: int, part: str,
                      weights: Optional[object]) -> None:
    """One line when the ids of `prompt` hold one past the `rows` of the embedding of `part`."""
    beyond = max(ids, default=-1)
    if beyond >= rows:
        raise _refusal(tokenizer, part, f"gives token id {beyond} for the prompt {quoted_shortly(prompt)} but "
                                        f"{_model(part, weights)} has an embedding of {_rows(rows)}: the tokenizer "
                                        "does not fit it")


def _refusal(tokenizer: Any, part: str, says: str) -> ModelFileError:
    """The tokenizer, as where it came from names it, `says`, then the fix for where it came from."""
    origin = origin_of(tokenizer)
    return ModelFileError(f"{origin.shown} {says}: {origin.fix.format(part=part)}").naming(*origin.settings)
