"""Numbers typed as text (a command-line option, a step-cache setting): plain decimal forms only.

Python's int() and float() also take forms nobody types on purpose: `1_0` (10, where 1.0 was meant), ` 1 `,
`nan`, `inf`, `infinity` and digits of other scripts (`١٢`). Each is refused here, so a typo is an error, not
another number.
"""
from __future__ import annotations

import math
import re
from typing import Optional

from .errors import InvalidInputError, quoted_shortly

# The forms accepted, as refusals say them.
WHOLE_RULE = "digits only"
DECIMAL_RULE = "an optional sign, digits, one '.', an optional exponent; no '_', spaces, nan or inf"

_WHOLE = re.compile(r"[+-]?[0-9]+")
_DECIMAL = re.compile(r"[+-]?([0-9]+\.?[0-9]*|\.[0-9]+)([eE][+-]?[0-9]+)?")


_MOST_DIGITS = 40  # more digits than any setting's range allows (and past int()'s 4300, an error of its own)


def whole_from_text(text: str, name: str = "the number") -> Optional[int]:
    """`text` as a whole number when it is one in plain digits (a sign allowed), else None. One of more than 40
    digits is refused as too large, quoting `text` under `name` (the option or setting it was typed for)."""
    if not isinstance(text, str) or not _WHOLE.fullmatch(text):
        return None
    if len(text.lstrip("+-").lstrip("0")) > _MOST_DIGITS:
        raise _too_large(name, text)
    return int(text)


def decimal_from_text(text: str, name: str = "the number") -> Optional[float]:
    """`text` as a number when it is a plain decimal (`4`, `0.12`, `.5`, `1e-3`), else None. `-0` reads as 0 (a
    message shows 0, not -0). A value past float's range (`1e999`) is refused as too large, quoting `text` under
    `name` (the option or setting it was typed for): float would read it as inf."""
    if not isinstance(text, str) or not _DECIMAL.fullmatch(text):
        return None
    number = float(text)
    if not math.isfinite(number):
        raise _too_large(name, text)
    return number + 0.0  # -0.0 + 0.0 is 0.0


def _too_large(name: str, text: str) -> InvalidInputError:
    return InvalidInputError(f"{name} {quoted_shortly(text)} is too large: give a number within the range {name} allows")
