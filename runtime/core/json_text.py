"""Why `json.loads` refused a text, in words a one-line refusal can quote (never an exception's name, never Python's
own advice such as sys.set_int_max_str_digits); and objects that hold a key twice, refused rather than read as their
last copy."""
from __future__ import annotations

import json

# What json.loads raises on a text it cannot read: ValueError covers JSONDecodeError, UnicodeDecodeError and a
# number of more digits than int() reads; RecursionError, arrays or objects nested deeper than the parser goes.
JSON_ERRORS = (ValueError, RecursionError)


def json_fault(error: BaseException) -> str:
    """One of JSON_ERRORS in words: where the text stops being JSON, or what it holds that cannot be read."""
    if isinstance(error, RecursionError):
        return "nested deeper than JSON is read"
    if isinstance(error, RepeatedKey):
        return f"the key {error} appears twice in one object, so which value is meant is not known"
    if isinstance(error, UnicodeDecodeError):
        return f"not UTF-8 text at byte {error.start}"
    if isinstance(error, json.JSONDecodeError):
        return f"line {error.lineno}, column {error.colno}: {error.msg}"
    return "a number of more digits than can be read"


class RepeatedKey(ValueError):
    """A key a JSON object holds twice (which copy is meant is not known; json.loads would keep the last)."""

    def __init__(self, key: str) -> None:
        super().__init__(repr(key)[:80])
        self.key = key


def without_repeated_keys(pairs: list[tuple[str, object]]) -> dict:
    """json.loads' object_pairs_hook that raises RepeatedKey at a key given twice in one object."""
    held: dict = {}
    for key, value in pairs:
        if key in held:
            raise RepeatedKey(key)
        held[key] = value
    return held


def load_json(text: str | bytes) -> object:
    """json.loads, refusing an object that holds a key twice (RepeatedKey) rather than keeping its last copy."""
    return json.loads(text, object_pairs_hook=without_repeated_keys)


def json_trouble(error: BaseException) -> str:
    """One of JSON_ERRORS as what a file "is" or "holds", after its name: "is not valid JSON (line 1, column 7:
    ...)", or, for a key given twice, "holds the key 'x' twice in one object, so ..."."""
    if isinstance(error, RepeatedKey):
        return f"holds the key {error} twice in one object, so which value is meant is not known"
    return f"is not valid JSON ({json_fault(error)})"
