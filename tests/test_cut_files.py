"""An empty or cut model file is one line naming it as the kind of file it is (safetensors, GGUF, JSON), its size and
what its header promised: never another kind's words ("too short for a safetensors file" for a .gguf), and never a
reader's reshape, dtype-view or index error."""
from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from ernie_image.runtime.cli.commands import main
from ernie_image.runtime.core.errors import ModelFileError
from ernie_image.runtime.demo.tiny import build_tiny_model
from ernie_image.runtime.formats import open_component

pytest.importorskip("gguf")

FIX = ": the file is damaged or was not fully downloaded: download it again"


@pytest.fixture(scope="module")
def whole_files(tmp_path_factory) -> dict[str, Path]:
    """A whole file of each kind a DiT comes in: a safetensors file and the GGUF `ernie-image quantize` writes."""
    folder = tmp_path_factory.mktemp("whole")
    sources = build_tiny_model(folder / "model", layout="comfy", variant="turbo")
    gguf = folder / "ernie-image-turbo-Q8_0.gguf"
    assert main(["quantize", "--dit", str(sources.dit), "--format", "q8_0", "--out", str(gguf)]) == 0
    return {"safetensors": sources.dit, "GGUF": gguf}


def cut(source: Path, keep: int, target: Path) -> Path:
    target.write_bytes(source.read_bytes()[:keep])
    return target


def refusal(path: Path) -> str:
    with pytest.raises(ModelFileError) as refused:
        open_component(path, "dit")
    message = str(refused.value)
    assert "\n" not in message and message.endswith(FIX), message
    return message


KINDS = [("safetensors", ".safetensors"), ("GGUF", ".gguf")]


@pytest.mark.parametrize("kind, suffix", KINDS)
def test_an_empty_file_is_named_as_an_empty_file_of_its_kind(tmp_path, kind, suffix):
    empty = tmp_path / f"ernie-image{suffix}"
    empty.write_bytes(b"")
    assert refusal(empty) == f"ernie-image{suffix} is an empty {kind} file (0 bytes){FIX}"


@pytest.mark.parametrize("kind, suffix", KINDS)
@pytest.mark.parametrize("keep", [3, 6, 100])
def test_a_file_cut_inside_its_header_says_so_with_its_size(tmp_path, whole_files, kind, suffix, keep):
    short = cut(whole_files[kind], keep, tmp_path / f"cut{suffix}")
    assert refusal(short).startswith(f"cut{suffix} is truncated inside its {kind} header ({keep} bytes")


@pytest.mark.parametrize("kind, suffix", KINDS)
@pytest.mark.parametrize("share", [0.5, 0.99])
def test_a_file_cut_inside_its_data_says_how_much_of_it_is_there(tmp_path, whole_files, kind, suffix, share):
    whole = whole_files[kind].stat().st_size
    keep = int(whole * share)
    short = cut(whole_files[kind], keep, tmp_path / f"cut{suffix}")
    assert refusal(short).startswith(f"cut{suffix} is truncated: its {kind} header describes {whole} bytes but the "
                                     f"file has {keep} ({100 * keep // whole}%)")


# Bytes of other kinds a download can leave under a model's name: noise, an image, an error page, a JSON document, a
# length prefix promising more than the file holds, and a safetensors-like length before bytes that are no JSON.
OTHER_BYTES = {
    "random bytes": bytes((index * 151 + 7) % 256 for index in range(4096)),
    "a PNG image": b"\x89PNG\r\n\x1a\n" + bytes(2000),
    "an HTML error page": b"<html><body>404 Not Found</body></html>\n" * 40,
    "a JSON document": b'{"error": "not found"}' * 50,
    "a length past the end": (100).to_bytes(8, "little") + b"x" * 50,
    "a length before no JSON": (20).to_bytes(8, "little") + b"these are no JSON...." + bytes(100),
}


@pytest.mark.parametrize("content", OTHER_BYTES.values(), ids=OTHER_BYTES.keys())
def test_other_bytes_named_gguf_are_named_as_not_a_gguf_file_never_in_safetensors_words(tmp_path, content):
    named = tmp_path / "garbage.gguf"
    named.write_bytes(content)
    assert refusal(named) == f"garbage.gguf is not a GGUF file (it does not start with GGUF's magic bytes){FIX}"


@pytest.mark.parametrize("content", OTHER_BYTES.values(), ids=OTHER_BYTES.keys())
def test_other_bytes_named_safetensors_are_named_in_safetensors_words(tmp_path, content):
    named = tmp_path / "garbage.safetensors"
    named.write_bytes(content)
    with pytest.raises(ModelFileError) as refused:
        open_component(named, "dit")
    message = str(refused.value)
    assert "\n" not in message and message.startswith("garbage.safetensors ") and "safetensors" in message[20:], message
    assert "GGUF" not in message


def test_a_file_is_read_as_what_its_bytes_are_whatever_its_name_says(tmp_path, whole_files):
    safetensors_named_gguf = Path(shutil.copy(whole_files["safetensors"], tmp_path / "dit.gguf"))
    assert open_component(safetensors_named_gguf, "dit").layout == "single-file"
    gguf_named_safetensors = Path(shutil.copy(whole_files["GGUF"], tmp_path / "dit.safetensors"))
    assert open_component(gguf_named_safetensors, "dit").layout == "gguf"


def test_a_cut_gguf_dit_is_one_line_on_the_command_line_and_nothing_runs(capsys, tmp_path, whole_files,
                                                                         tiny_turbo_folder):
    short = cut(whole_files["GGUF"], whole_files["GGUF"].stat().st_size // 2, tmp_path / "dit.gguf")
    out = tmp_path / "x.png"
    assert main(["generate", "--model-dir", str(tiny_turbo_folder), "--dit", str(short), "--steps", "1",
                 "--device", "cpu", "--out", str(out)]) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: dit.gguf is truncated: its GGUF header describes "), lines
    assert not out.exists()


def test_an_empty_config_is_named_as_an_empty_json_file(capsys, tmp_path, tiny_turbo_folder):
    model = Path(shutil.copytree(tiny_turbo_folder, tmp_path / "model"))
    config = model / "transformer" / "config.json"
    config.write_bytes(b"")
    assert main(["generate", "--model-dir", str(model), "--steps", "1", "--device", "cpu",
                 "--out", str(tmp_path / "x.png")]) == 2
    assert capsys.readouterr().err.strip() == f"error: {config} is an empty JSON file (0 bytes){FIX}"


def test_a_diffusers_folders_part_is_named_with_its_folder(tmp_path, whole_files):
    """vae/ and transformer/ both hold diffusion_pytorch_model.safetensors: the folder tells which one is cut."""
    part = tmp_path / "ERNIE-Image" / "vae"
    part.mkdir(parents=True)
    message = refusal(cut(whole_files["safetensors"], 100, part / "diffusion_pytorch_model.safetensors"))
    assert message.startswith("vae/diffusion_pytorch_model.safetensors is truncated") and str(tmp_path) not in message


# ------------------------------------------------------------------ a GGUF header at odds with its data
def _edited(source: Path, target: Path, edit) -> Path:
    """A copy of `source` whose tensor infos `edit(tensors)` changed in place (gguf's reader maps the copy writable;
    each tensor's `field.parts` are views of its header bytes: ..., its type, its data offset)."""
    import gguf

    shutil.copy(source, target)
    edit([tensor.field for tensor in gguf.GGUFReader(str(target), "r+").tensors])
    return target


def _relabel_first_q8_0_as_q4_0(fields) -> str:
    field = next(field for field in fields if int(field.parts[-2][0]) == 8)  # GGML type 8: Q8_0
    field.parts[-2][0] = 2  # Q4_0: the same blocks in fewer bytes, so the bytes after it belong to no tensor
    return field.name


def test_a_tensor_relabelled_to_a_smaller_type_is_refused_before_anything_reads_it(tmp_path, whole_files):
    """Read as Q4_0, Q8_0 bytes are other numbers: the image was NaN after a whole sampling run."""
    names = []
    edited = _edited(whole_files["GGUF"], tmp_path / "relabelled.gguf",
                     lambda fields: names.append(_relabel_first_q8_0_as_q4_0(fields)))
    message = refusal(edited)
    assert message.startswith("relabelled.gguf is not a readable GGUF file (")
    assert f"bytes after tensor {names[0]} belong to no tensor" in message, message
    assert "a type, shape or offset in the header does not match the data" in message


def test_a_tensor_whose_data_runs_into_the_next_is_refused(tmp_path, whole_files):
    def overlap(fields) -> None:
        ordered = sorted(fields, key=lambda field: int(field.parts[-1][0]))
        ordered[1].parts[-1][0] = int(ordered[0].parts[-1][0])  # the second tensor's data where the first's is
    message = refusal(_edited(whole_files["GGUF"], tmp_path / "overlapping.gguf", overlap))
    assert "run into" in message and "its type or shape does not match its data" in message


def test_a_tensor_off_the_alignment_is_refused(tmp_path, whole_files):
    def misalign(fields) -> None:
        last = max(fields, key=lambda field: int(field.parts[-1][0]))
        last.parts[-1][0] = int(last.parts[-1][0]) + 1
    message = refusal(_edited(whole_files["GGUF"], tmp_path / "misaligned.gguf", misalign))
    assert "off the file's alignment of 32" in message


def test_a_tensor_moved_far_past_its_place_is_refused_naming_the_tensors_around_the_hole(tmp_path, whole_files):
    around = []

    def move(fields) -> None:
        ordered = sorted(fields, key=lambda field: int(field.parts[-1][0]))
        ordered[3].parts[-1][0] = int(ordered[3].parts[-1][0]) + (1 << 20)
        around.extend((ordered[2].name, ordered[4].name))  # the hole it leaves is between these two
    message = refusal(_edited(whole_files["GGUF"], tmp_path / "moved.gguf", move))
    assert f"bytes after tensor {around[0]} belong to no tensor (the next, {around[1]}, starts at byte " in message


def test_a_type_this_gguf_does_not_know_is_left_to_its_reader_and_no_neighbour_is_blamed(tmp_path, whole_files):
    def unknown_type(fields) -> None:
        fields[0].parts[-2][0] = 99
    message = refusal(_edited(whole_files["GGUF"], tmp_path / "unknown.gguf", unknown_type))
    assert "belong to no tensor" not in message and "run into" not in message, message
