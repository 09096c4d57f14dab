"""Paths whose bytes are not UTF-8 (a folder named in Latin-1 or Shift-JIS on Linux, kept by Python as lone
surrogates): every line the CLI writes shows such a byte escaped (`\\xff`), never a UnicodeEncodeError traceback in
place of the message; a model folder the tokenizer library cannot open is named as that, not blamed on the
tokenizer's files; an output name that is not UTF-8 is refused before any work."""
from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from ernie_image.runtime.cli.commands import main
from ernie_image.runtime.cli.terminal_text import one_terminal_line, plain_terminal_lines

pytestmark = pytest.mark.skipif(os.name == "nt", reason="Windows file names are UTF-16: no undecodable bytes")


def _refused(capsys, *argv: str) -> str:
    assert main(list(argv)) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) >= 1 and lines[-1].startswith("error: "), lines
    return lines[-1]


def test_a_model_folder_whose_path_is_not_utf8_is_named_as_such_not_as_a_damaged_tokenizer(capsys, tmp_path,
                                                                                          tiny_turbo_folder):
    model = Path(shutil.copytree(tiny_turbo_folder, tmp_path / os.fsdecode(b"mod\xe8les")))
    out = tmp_path / "x.png"
    line = _refused(capsys, "generate", "--model-dir", str(model), "--steps", "1", "--device", "cpu", "--prompt",
                    "a fox", "--out", str(out))
    assert line == (f"error: the tokenizer in {tmp_path}/mod\\xe8les/tokenizer cannot be opened: its path holds bytes "
                    "that are not UTF-8 text, which the tokenizer library cannot open: rename the folders on its path "
                    "in UTF-8")
    assert not out.exists()


def test_an_output_name_that_is_not_utf8_is_refused_before_any_work(capsys, tmp_path):
    out = tmp_path / os.fsdecode(b"fox\xfe.png")
    line = _refused(capsys, "generate", "--steps", "1", "--device", "cpu", "--out", str(out))
    assert line == f"error: --out {tmp_path}/fox\\xfe.png holds the byte \\xfe, which is not UTF-8 text: give a name in UTF-8"
    assert list(tmp_path.iterdir()) == []


def test_an_error_naming_a_path_that_is_not_utf8_is_written_with_the_byte_escaped(capsys, tmp_path):
    missing = tmp_path / os.fsdecode(b"ernie\xff.safetensors")
    line = _refused(capsys, "generate", "--dit", str(missing), "--out", str(tmp_path / "x.png"))
    assert line == f"error: --dit {tmp_path}/ernie\\xff.safetensors does not exist: check the path"


@pytest.mark.parametrize("shown", [one_terminal_line, plain_terminal_lines])
def test_lone_surrogates_are_shown_as_the_bytes_they_stand_for_or_by_their_code(shown):
    assert shown(os.fsdecode(b"a\x80b\xffc") + "\ud800") == "a\\x80b\\xffc\\ud800"
    assert shown("caf\u00e9 \u732b") == "caf\u00e9 \u732b"  # UTF-8 text stays as it is
