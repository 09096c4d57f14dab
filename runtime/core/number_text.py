"""Numbers typed as text (a command-line option, a step-cache setting): plain decimal forms only.

Python's int() and float() also take forms nobody types on purpose: `1_0` (10, where 1.0 was meant), ` 1 `,
`nan`, `inf`, `infinity` and digits of other scripts (`١٢`). Each is refused here, so a typo is an error, not
another number.
"""
from __future__ import annotations

import re
from typing import Optional

# The forms accepted, as refusals say them.
WHOLE_RULE = "digits only"
DECIMAL_RULE = "digits, one '.', an optional exponent; no '_', spaces, nan or inf"

_WHOLE = re.compile(r"[+-]?[0-9]+")
_DECIMAL = re.compile(r"[+-]?([0-9]+\.?[0-9]*|\.[0-9]+)([eE][+-]?[0-9]+)?")


def whole_from_text(text: str) -> Optional[int]:
    """`text` as a whole number when it is one in plain digits (a sign allowed), else None."""
    return int(text) if isinstance(text, str) and _WHOLE.fullmatch(text) else None


def decimal_from_text(text: str) -> Optional[float]:
    """`text` as a number when it is a plain decimal (`4`, `0.12`, `.5`, `1e-3`), else None. A value past float's
    range (`1e999`) is inf: the caller's range check refuses it."""
    return float(text) if isinstance(text, str) and _DECIMAL.fullmatch(text) else None
