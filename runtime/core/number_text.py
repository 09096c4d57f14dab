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
_NON_ZERO_DIGIT = re.compile(r"[1-9]")

Range = tuple[float, float]  # the lowest and the highest value a setting takes, both allowed

_MOST_DIGITS = 40  # more digits than any setting's range allows (and past int()'s 4300, an error of its own)


def range_text(allowed: Range) -> str:
    """`allowed` as refusals and help say it: `0.01..100`, `1..1000` (a whole bound in all its digits)."""
    return "..".join(str(bound) if isinstance(bound, int) else f"{bound:g}" for bound in allowed)


def not_allowed(name: str, shown: str, allowed: Range, hint: str = "") -> InvalidInputError:
    """The one refusal of a number outside its range: `name`, the value as `shown`, the range, then `hint`."""
    return InvalidInputError(f"{name} {shown} is not allowed: use {range_text(allowed)}{hint}")


def whole_from_text(text: str, name: str = "the number", allowed: Optional[Range] = None) -> Optional[int]:
    """`text` as a whole number when it is one in plain digits (a sign allowed), else None. One of more than 40
    digits is refused quoting `text` under `name` (the option or setting it was typed for): as outside `allowed`
    where given, else as too large."""
    if not isinstance(text, str) or not _WHOLE.fullmatch(text):
        return None
    sign, digits = text[:len(text) - len(text.lstrip("+-"))], text.lstrip("+-").lstrip("0")
    if len(digits) > _MOST_DIGITS:
        raise _too_large(name, text, allowed)
    return int(sign + (digits or "0"))  # leading zeros left out: int() counts them against its 4300 digits


def decimal_from_text(text: str, name: str = "the number", allowed: Optional[Range] = None) -> Optional[float]:
    """`text` as a number when it is a plain decimal (`4`, `0.12`, `.5`, `1e-3`), else None. `-0` reads as 0 (a
    message shows 0, not -0). A value past float's range (`1e999`) is refused quoting `text` under `name` (the
    option or setting it was typed for): as outside `allowed` where given, else as too large; float would read it
    as inf. One too close to 0 for float (`1e-400`) reads as 0 where `allowed` holds 0 or is not given, and is
    refused quoting `text` where it does not (the range check would quote 0.0)."""
    if not isinstance(text, str) or not _DECIMAL.fullmatch(text):
        return None
    number = float(text)
    if not math.isfinite(number):
        raise _too_large(name, text, allowed)
    if allowed is not None and _underflows(text, number) and not allowed[0] <= 0 <= allowed[1]:
        raise not_allowed(name, quoted_shortly(text), allowed)
    return number + 0.0  # -0.0 + 0.0 is 0.0


def _underflows(text: str, number: float) -> bool:
    """`text` is a number other than 0 that float reads as 0."""
    mantissa = text.lower().partition("e")[0]
    return number == 0 and _NON_ZERO_DIGIT.search(mantissa) is not None


def _too_large(name: str, text: str, allowed: Optional[Range]) -> InvalidInputError:
    if allowed is not None:
        return not_allowed(name, quoted_shortly(text), allowed)
    return InvalidInputError(f"{name} {quoted_shortly(text)} is too large: give a number within the range {name} "
                             "allows")
