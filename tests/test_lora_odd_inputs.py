"""LoRA inputs a careless or hostile user gives, each refused in one line before any work (never a traceback, never
a hang), or taken as meant: paths that cannot be followed, files that are not regular files, metadata numbers and
nesting that break parsers, Python-API entries of the wrong shape, the same file under two names, a file holding
two trainers' keys for one layer, metadata ranks the weights contradict, and file names with line breaks."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

import lora_files as lf
from ernie_image.runtime.cli.commands import main as cli_main
from ernie_image.runtime.core.errors import InvalidInputError, ModelFileError
from ernie_image.runtime.formats.sources import ModelSources
from ernie_image.runtime.local.options import LoadOptions
from ernie_image.runtime.local.pipe import LocalPipe
from ernie_image.runtime.lora import LoraStack
from ernie_image.runtime.lora.parsed import check_lora_file, load_lora

LAYER = "layers.0.self_attention.to_q"
pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def shapes(tiny_turbo_folder):
    return lf.linear_shapes(lf.dit_weights(tiny_turbo_folder))


@pytest.fixture(scope="module")
def good(shapes, tmp_path_factory) -> Path:
    return lf.write_ai_toolkit(tmp_path_factory.mktemp("odd-good") / "good.safetensors", lf.random_lora(shapes, 2, 1))


@pytest.fixture(scope="module")
def pipe(tiny_turbo_folder):
    return LocalPipe.load(ModelSources(model_dir=tiny_turbo_folder), LoadOptions(device="cpu", dtype="fp32"))


def one_line(error: pytest.ExceptionInfo) -> str:
    message = str(error.value)
    assert "\n" not in message and len(message) < 400
    return message


def test_a_symlink_loop_is_refused_in_one_line(tmp_path):
    (tmp_path / "a.safetensors").symlink_to(tmp_path / "b.safetensors")
    (tmp_path / "b.safetensors").symlink_to(tmp_path / "a.safetensors")
    with pytest.raises(InvalidInputError, match=r"^LoRA 'a.safetensors': its path cannot be followed \(.*\): give "
                                                r"the path of the .safetensors file itself$") as caught:
        LoraStack.of([tmp_path / "a.safetensors"])
    one_line(caught)


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="needs named pipes (POSIX)")
def test_a_named_pipe_given_as_the_lora_is_refused_at_once_not_read_for_ever(tmp_path, capsys):
    fifo = tmp_path / "fifo.safetensors"
    os.mkfifo(fifo)
    with pytest.raises(ModelFileError, match=r"is not a regular file \(a pipe, device or socket\): give the LoRA's "
                                             r"\.safetensors file$"):
        check_lora_file(fifo)
    done = subprocess.run([sys.executable, "-c", "import sys; sys.path.insert(0, 'tests'); import conftest; "
                           "from ernie_image.runtime.cli import main; "
                           f"sys.exit(main(['generate', '--lora', {str(fifo)!r}, '--out', {str(tmp_path / 'x.png')!r}]))"],
                          cwd=Path(__file__).resolve().parent.parent, capture_output=True, text=True, timeout=60)
    assert done.returncode == 2 and done.stderr.strip().splitlines()[-1].startswith("error: LoRA "), done.stderr
    assert not (tmp_path / "x.png").exists()


@pytest.mark.parametrize("metadata, match", [
    ('{"lora_alpha": 1' + "0" * 400 + ', "r": 2}', r"lora_alpha 1000.* is not a finite number"),
    ("[" * 100000 + "]" * 100000, r"lora_adapter_metadata is not valid JSON \(nested deeper than JSON is read\)"),
], ids=["integer alpha beyond float range", "JSON nested 100000 deep"])
def test_metadata_that_breaks_number_or_json_parsing_is_refused_in_one_line(shapes, tmp_path, metadata, match):
    path = tmp_path / "meta.safetensors"
    save_file(lf.peft_keys(lf.random_lora(shapes, 2, 3), "transformer."), str(path),
              metadata={"lora_adapter_metadata": metadata})
    with pytest.raises(ModelFileError, match=match) as caught:
        check_lora_file(path)
    assert len(str(caught.value)) < 600 and "\n" not in str(caught.value)


@pytest.mark.parametrize("entry", [None, 3, (None, 1.0), (b"/x.safetensors", 1.0), ("a.safetensors", 1.0, "merge", 1),
                                   ()], ids=["None", "int", "None path", "bytes path", "four items", "empty tuple"])
def test_a_python_api_entry_of_the_wrong_shape_is_refused_in_one_line(entry):
    with pytest.raises(InvalidInputError, match=r"is not a path, \(path, strength\) or \(path, strength, mode\): "
                                                r"give e\.g\. \('style\.safetensors', 0\.8\)$"):
        LoraStack.of([entry])


@pytest.mark.parametrize("strength, match", [(10**400, "is not allowed"), (True, "is not a number"),
                                             ("1", "'1' is not a number"), (b"0.5", "is not a number")])
def test_strengths_python_takes_as_numbers_but_nobody_means_are_refused(good, strength, match):
    with pytest.raises(InvalidInputError, match=match):
        LoraStack.of([(good, strength)])


def test_a_path_with_a_nul_character_is_refused_in_one_line():
    with pytest.raises(InvalidInputError, match=r"its path cannot be followed"):
        LoraStack.of(["bad\0name.safetensors"])


def test_a_mapping_of_paths_to_strengths_keeps_its_strengths(good):
    assert [entry.strength for entry in LoraStack.of({good: 0.5}).entries] == [0.5]


def test_the_same_file_under_a_hard_link_is_refused_as_given_twice(good, tmp_path):
    twin = tmp_path / "twin.safetensors"
    os.link(good, twin)
    with pytest.raises(InvalidInputError, match=r"^LoRA twin.safetensors is given twice \(strengths 0.5 and 0.3\)"):
        LoraStack.of([(good, 0.5), (twin, 0.3)])


def test_a_file_with_two_trainers_keys_for_one_layer_is_refused(shapes, tmp_path):
    down, up = lf.random_lora({LAYER: shapes[LAYER]}, 2, 4)[LAYER]
    path = tmp_path / "two.safetensors"
    save_file({f"transformer.{LAYER}.lora_A.weight": down, f"transformer.{LAYER}.lora_B.weight": up,
               f"lora_unet_{LAYER.replace('.', '_')}.lora_down.weight": down.clone(),
               f"lora_unet_{LAYER.replace('.', '_')}.lora_up.weight": up.clone(),
               f"lora_unet_{LAYER.replace('.', '_')}.alpha": torch.tensor(2.0)}, str(path))
    with pytest.raises(ModelFileError, match=rf"^LoRA two.safetensors holds two LoRAs for {LAYER} \(lora_A/lora_B and "
                                             r"lora_down/lora_up keys, two trainers' layouts\)"):
        check_lora_file(path)


def test_a_metadata_rank_the_weights_contradict_is_refused_when_the_pipe_parses_it(pipe, shapes, tmp_path):
    path = tmp_path / "rank8.safetensors"
    save_file(lf.peft_keys(lf.random_lora(shapes, 4, 5), "transformer."), str(path),
              metadata={"lora_adapter_metadata": json.dumps({"lora_alpha": 8, "r": 8})})
    with pytest.raises(ModelFileError, match=r"its lora_adapter_metadata gives rank 8 for .* but its weights have "
                                             r"rank 4: the file is damaged or its metadata belongs to another LoRA"):
        pipe.with_loras([(path, 1.0)])


def test_a_line_break_in_a_file_name_cannot_break_the_cli_error_into_lines(tmp_path, capsys):
    path = tmp_path / "evil\nerror: fake.safetensors"
    path.write_text("not a LoRA")
    assert cli_main(["generate", "--lora", str(path), "--out", str(tmp_path / "x.png")]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: LoRA ") and "evil\\nerror: fake" in lines[0], lines


def test_a_text_file_given_as_a_lora_is_named_as_a_lora(tmp_path):
    path = tmp_path / "notes.safetensors"
    path.write_text("just some notes")
    with pytest.raises(ModelFileError, match=r"^LoRA notes.safetensors is not a safetensors file \(its first bytes "
                                             r"are not a safetensors header\): it is damaged, or another kind of file "
                                             r"under that name: download it again$"):
        check_lora_file(path)


def test_a_rank_zero_lora_cannot_pass_as_applied(pipe, shapes, tmp_path):
    path = tmp_path / "empty.safetensors"
    save_file({f"transformer.{LAYER}.lora_A.weight": torch.zeros(0, shapes[LAYER][1]),
               f"transformer.{LAYER}.lora_B.weight": torch.zeros(shapes[LAYER][0], 0)}, str(path))
    with pytest.raises(ModelFileError, match=r"is empty \(shape \(0, \d+\), rank 0\)"):
        pipe.with_loras([(path, 1.0)])


def test_diffusers_older_lora_down_lora_up_spelling_reads_as_lora_down_lora_up(pipe, shapes, tmp_path):
    lora = lf.random_lora(shapes, 2, 6)
    older, current = tmp_path / "older.safetensors", tmp_path / "current.safetensors"
    save_file({f"transformer.{name}.lora.{side}.weight": tensor.contiguous() for name, (down, up) in lora.items()
               for side, tensor in (("down", down), ("up", up))}, str(older))
    save_file({f"transformer.{name}.lora_{side}.weight": tensor.contiguous() for name, (down, up) in lora.items()
               for side, tensor in (("down", down), ("up", up))}, str(current))
    config = pipe._lora.dit_config(pipe.sources)
    want = load_lora(current, config).adapters
    got = load_lora(older, config).adapters
    assert set(got) == set(want) == set(lora)
    assert all(torch.equal(got[n].down, want[n].down) and torch.equal(got[n].up, want[n].up) for n in want)


def rewritten_header(path: Path, edit) -> None:
    """Rewrite a safetensors file's JSON header in place through `edit(header)` (padded to its old length)."""
    raw = path.read_bytes()
    length = int.from_bytes(raw[:8], "little")
    header = json.loads(raw[8:8 + length])
    edit(header)
    text = json.dumps(header, separators=(",", ":")).encode()
    assert len(text) <= length
    path.write_bytes(raw[:8] + text.ljust(length) + raw[8 + length:])


def test_tensors_whose_bytes_overlap_or_a_file_longer_than_its_tensors_are_refused(good, tmp_path):
    overlap, tail = tmp_path / "overlap.safetensors", tmp_path / "tail.safetensors"
    overlap.write_bytes(good.read_bytes())
    tail.write_bytes(good.read_bytes() + b"\0" * 100)

    def overlap_first_two(header: dict) -> None:
        first, second = sorted((k for k in header if k != "__metadata__"), key=lambda k: header[k]["data_offsets"])[:2]
        begin = header[first]["data_offsets"][0]
        width = header[second]["data_offsets"][1] - header[second]["data_offsets"][0]
        header[second]["data_offsets"] = [begin, begin + width]

    rewritten_header(overlap, overlap_first_two)
    with pytest.raises(ModelFileError, match=r"tensors overlap or leave gaps"):
        check_lora_file(overlap)
    with pytest.raises(ModelFileError, match=r"^LoRA tail.safetensors has 100 bytes after its last tensor"):
        check_lora_file(tail)


@pytest.mark.parametrize("loras, match", [(42, r"^LoRAs 42 are not a list"), ([("", 1.0)], r"has an empty path"),
                                          ([""], r"has an empty path")], ids=["an int", "empty path in a tuple",
                                                                              "empty path"])
def test_loras_that_are_not_a_list_or_name_no_file_are_refused_in_one_line(pipe, loras, match):
    with pytest.raises(InvalidInputError, match=match):
        pipe.with_loras(loras)


def test_a_mode_that_is_not_known_is_refused_even_without_loras(pipe):
    with pytest.raises(InvalidInputError, match=r"LoRA mode 'nope' is not known"):
        pipe.with_loras(None, mode="nope")


def test_two_loras_of_one_file_name_are_told_apart_by_their_folders(tmp_path):
    from ernie_image.runtime.lora.stack import LoraEntry, LoraStack, describe_stack

    for folder in ("anime", "photo"):
        (tmp_path / folder).mkdir()
    stack = LoraStack((LoraEntry(tmp_path / "anime" / "style.safetensors", 0.5),
                       LoraEntry(tmp_path / "photo" / "style.safetensors", 0.7),
                       LoraEntry(tmp_path / "detail.safetensors", 1.0)))
    assert describe_stack(stack) == "LoRA: anime/style.safetensors (0.5), photo/style.safetensors (0.7), " \
                                    "detail.safetensors (1)"
    assert [item["name"] for item in stack.metadata()] == ["anime/style.safetensors", "photo/style.safetensors",
                                                           "detail.safetensors"]
