"""A broken symbolic link where a run reads a file or folder (a download cut short into a cache of links such as
huggingface_hub's, whose files are links to blobs; a moved target) is named as a broken link in one line, with its
fix, before any part is built: never taken for a file that is simply absent (a config or tokenizer silently replaced
by another source), never "does not exist: check the path" for a path the user typed right."""
from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from ernie_image.runtime.cli.commands import main

BROKEN = "is a broken or looping symbolic link: "

IN_THE_FOLDER = [
    ("transformer/diffusion_pytorch_model.safetensors", "remove it, or give the .safetensors file"),
    ("transformer/config.json", "give the config.json file, or re-download it"),
    ("text_encoder/config.json", "give the config.json file, or re-download it"),
    ("vae/config.json", "give the config.json file, or re-download it"),
    ("tokenizer/tokenizer.json", "download the model's tokenizer/ folder again"),
    ("tokenizer/tokenizer_config.json", "download the model's tokenizer/ folder again"),
    ("transformer", "mend the link, or download it again"),
    ("tokenizer", "mend the link, or download it again"),
    ("pe", "mend the link, or download it again"),
]


@pytest.fixture
def model(tmp_path, tiny_turbo_folder) -> Path:
    return Path(shutil.copytree(tiny_turbo_folder, tmp_path / "model"))


def _broken_link(at: Path) -> None:
    """`at` replaced by a link to a blob that was never downloaded."""
    if at.is_dir():
        shutil.rmtree(at)
    elif at.exists():
        at.unlink()
    os.symlink(at.parent / ".blobs" / "5f3e9a", at)


def _refused(capsys, out: Path, *argv: str) -> str:
    assert main(["generate", "--steps", "1", "--device", "cpu", "--prompt", "a fox", "--out", str(out), *argv]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), lines
    assert not out.exists()
    return lines[0]


@pytest.mark.parametrize("where, fix", IN_THE_FOLDER, ids=[where for where, _ in IN_THE_FOLDER])
def test_a_broken_link_inside_the_model_folder_is_named_with_its_fix(capsys, tmp_path, model, where, fix):
    _broken_link(model / where)
    line = _refused(capsys, tmp_path / "x.png", "--model-dir", str(model))
    assert line.endswith(f"{BROKEN}{fix}") and where.split("/")[-1] in line, line


def test_a_broken_tokenizer_json_is_not_replaced_by_the_text_encoders_own_vocabulary(capsys, tmp_path, model):
    """With both of the folder's tokenizer files broken links, the folder is no tokenizer: it is not passed over."""
    _broken_link(model / "tokenizer" / "tokenizer.json")
    _broken_link(model / "tokenizer" / "tokenizer_config.json")
    line = _refused(capsys, tmp_path / "x.png", "--model-dir", str(model))
    assert BROKEN in line and "tokenizer" in line, line


@pytest.mark.parametrize("option", ["--model-dir", "--dit"])
def test_a_given_path_that_is_a_broken_link_is_not_called_missing(capsys, tmp_path, model, option):
    given = tmp_path / "given"
    os.symlink(tmp_path / ".blobs" / "5f3e9a", given)
    argv = ["--model-dir", str(given)] if option == "--model-dir" else ["--model-dir", str(model), "--dit", str(given)]
    line = _refused(capsys, tmp_path / "x.png", *argv)
    assert line == f"error: {option} {given} {BROKEN}mend the link, or download it again", line


def test_a_tokenizer_folder_found_in_the_model_folder_is_named_as_such_not_as_an_option_not_given(capsys, tmp_path,
                                                                                                  model):
    _broken_link(model / "tokenizer")
    line = _refused(capsys, tmp_path / "x.png", "--model-dir", str(model))
    assert line == f"error: the tokenizer folder {model / 'tokenizer'} {BROKEN}mend the link, or download it again"
    (model / "tokenizer").unlink()
    (model / "tokenizer").write_text("{}")
    line = _refused(capsys, tmp_path / "x.png", "--model-dir", str(model))
    assert line == (f"error: {model / 'tokenizer'} is a file, not the tokenizer folder: download the model's "
                    "tokenizer/ folder again")


def test_a_link_to_a_file_that_is_there_is_read_as_the_file(capsys, tmp_path, model):
    config = model / "vae" / "config.json"
    kept = tmp_path / "blob"
    shutil.move(config, kept)
    os.symlink(kept, config)
    assert main(["generate", "--steps", "1", "--device", "cpu", "--prompt", "a fox", "--model-dir", str(model),
                 "--out", str(tmp_path / "x.png")]) == 0
    assert (tmp_path / "x.png").is_file()
