"""How a JSON text that cannot be read is put in words (core/json_text.py): where it stops being JSON, or what it
holds that cannot be read, never an exception's name; and an object holding a key twice is refused, not read as its
last copy."""
from __future__ import annotations

import json

import pytest

from ernie_image.runtime.core.json_text import JSON_ERRORS, RepeatedKey, json_fault, without_repeated_keys


@pytest.mark.parametrize("text, says", [
    ('{"a": ', "line 1, column 7: Expecting value"),
    ("[" * 100_000 + "]" * 100_000, "nested deeper than JSON is read"),
    ("9" * 5000, "a number of more digits than can be read"),
    (b'{"a": "\xff"}', "not UTF-8 text at byte 7"),
    ('{"a": {"b": 1, "b": 2}}', "the key 'b' appears twice in one object, so which value is meant is not known"),
], ids=["cut short", "nested too deep", "a 5000-digit number", "not UTF-8", "a key twice"])
def test_each_unreadable_text_is_named_in_words(text, says):
    with pytest.raises(JSON_ERRORS) as refused:
        json.loads(text.decode("utf-8") if isinstance(text, bytes) else text, object_pairs_hook=without_repeated_keys)
    assert json_fault(refused.value) == says


def test_a_key_in_two_different_objects_is_no_repeat():
    assert json.loads('{"a": {"k": 1}, "b": {"k": 2}}', object_pairs_hook=without_repeated_keys) == {
        "a": {"k": 1}, "b": {"k": 2}}


def test_a_repeated_key_is_a_value_error_that_names_its_key():
    with pytest.raises(RepeatedKey) as refused:
        json.loads('{"x": 1, "x": 1}', object_pairs_hook=without_repeated_keys)
    assert isinstance(refused.value, ValueError) and refused.value.key == "x"
