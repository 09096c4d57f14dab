"""What a config field's value must be (a `Rule`), and a field whose value breaks its rule (a `Fault`) said in one
line naming the config, the field by its dotted path (`text_config.rope_parameters.factor`), the value and the fix."""
from __future__ import annotations

import json
import math
from dataclasses import dataclass
from typing import Any, Callable

from ..core.errors import ModelFileError, shown_shortly


def _whole(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


def _wholes(value: Any) -> bool:
    return isinstance(value, (list, tuple)) and bool(value) and all(_whole(item) for item in value)


def finite(value: Any) -> bool:
    """A JSON number (not a boolean, not NaN nor infinite)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _positive(value: Any) -> bool:
    return finite(value) and value > 0


@dataclass(frozen=True)
class Rule:
    wanted: str  # what the field must be, in a message
    accepts: Callable[[Any], bool]

    def or_null(self) -> "Rule":
        return Rule(f"{self.wanted} or null", lambda value: value is None or self.accepts(value))


SIZE = Rule("a positive whole number", _whole)
SIZES = Rule("a list of positive whole numbers", _wholes)
SIZE_OR_SIZES = Rule("a positive whole number or a list of them", lambda value: _whole(value) or _wholes(value))
SIZE_OR_NULL = SIZE.or_null()
# RoPE rotates channels in pairs: transformers refuses a rotated head size that is odd ("RoPE requires an even rotary
# dimension").
EVEN_SIZE = Rule("a positive even whole number (RoPE rotates channels in pairs)",
                 lambda value: _whole(value) and value % 2 == 0)
POSITIVE = Rule("a positive finite number", _positive)
POSITIVES = Rule("a list of positive finite numbers",
                 lambda value: isinstance(value, list) and bool(value) and all(_positive(item) for item in value))
AT_LEAST_ZERO = Rule("a finite number >= 0", lambda value: finite(value) and value >= 0)
# A RoPE base of 1 gives every rotary frequency the same value (no position information) and one below 1 reverses
# their order; YaRN divides by log(base).
ROPE_BASE = Rule("a finite number > 1", lambda value: finite(value) and value > 1)
FLAG = Rule("true or false", lambda value: isinstance(value, bool))
OBJECT_OR_NULL = Rule("a JSON object or null", lambda value: value is None or isinstance(value, dict))

MISSING = object()  # a Fault's value when the field is absent


@dataclass(frozen=True)
class Fault:
    """A field whose value (or absence: MISSING) its rule does not accept."""

    field: str  # dotted path from the config's top: text_config.rope_parameters.factor
    value: Any
    wanted: str
    reader: str = ""  # what reads the field, for one that is missing: 'rope_type "llama3"'
    broken: str = ""  # how the value breaks a rule between fields ("sums to 34, but ..."), said instead of `wanted`

    def error(self, origin: str, fix: str) -> ModelFileError:
        """The one-line refusal: `origin` names the config (config_json.origin_of), `fix` what to do."""
        if self.value is MISSING:
            return ModelFileError(f"{origin} has no {self.field}, which {self.reader} reads: it must be "
                                  f"{self.wanted}: {fix}")
        why = self.broken or f"is not {self.wanted}"
        return ModelFileError(f"{origin} says {self.field} {shown_shortly(json.dumps(self.value))}, which {why}: {fix}")
