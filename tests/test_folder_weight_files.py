"""A model part's folder (a diffusers folder's transformer/, text_encoder/, vae/) is read as its index places its
tensors, else each tensor from the one file that holds it.

A tensor held by two files of a folder without an index (an all-zero copy left beside the weights, whatever its name
sorts as) is refused by generate, quantize, the library and the ComfyUI Loader in one line naming the tensor, both
files and the fix, before any weight is read. Where the folder has an index (`*.safetensors.index.json`), the index
decides: each tensor is read from the file it names, and a file it does not name is not read. An index that names
a file not there, places a tensor in a file not holding it, or cannot be read is refused in one line.
"""
from __future__ import annotations

import contextlib
import json
import os
import shutil
import sys
import threading
from pathlib import Path
from typing import Callable

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from comfy_folders import fake_folder_paths
from ernie_image.nodes.loader import ErnieImageLoader
from ernie_image.runtime.cli.commands import main
from ernie_image.runtime.core.errors import ModelFileError
from ernie_image.runtime.formats import open_component
from ernie_image.runtime.formats.safetensors_reader import SafetensorsFile
from ernie_image.runtime.formats.sources import ModelSources
from ernie_image.runtime.local.options import LoadOptions
from ernie_image.runtime.local.pipe import LocalPipe

WEIGHTS = {"transformer": "diffusion_pytorch_model.safetensors", "text_encoder": "model.safetensors",
           "vae": "diffusion_pytorch_model.safetensors"}
INDEX = {"transformer": "diffusion_pytorch_model.safetensors.index.json",
         "text_encoder": "model.safetensors.index.json", "vae": "diffusion_pytorch_model.safetensors.index.json"}
NO_INDEX = "no *.safetensors.index.json says which to read: remove the stray file, or, for a sharded folder, " \
           "download its index again"


@pytest.fixture
def model(tmp_path, tiny_turbo_folder) -> Path:
    """A copy of the tiny Turbo diffusers folder where ComfyUI's Loader finds it (models/diffusers/)."""
    return Path(shutil.copytree(tiny_turbo_folder, tmp_path / "models" / "diffusers" / "ERNIE-Image-Turbo"))


@pytest.fixture
def weights_read(monkeypatch) -> list[str]:
    """Every tensor read from a mapped weight file."""
    read: list[str] = []
    tensor = SafetensorsFile.tensor

    def recorded(self, key):
        read.append(key)
        return tensor(self, key)

    monkeypatch.setattr(SafetensorsFile, "tensor", recorded)
    return read


def _stored(part_folder: Path, name: str) -> dict[str, torch.Tensor]:
    return load_file(str(part_folder / name))


def _zero_copy(part_folder: Path, name: str, keys: Callable[[list[str]], list[str]] = lambda keys: keys) -> None:
    """`name` beside the part's weights: an all-zero copy of the tensors `keys` picks, under their stored names."""
    tensors = _stored(part_folder, WEIGHTS[part_folder.name])
    save_file({key: torch.zeros_like(tensors[key]) for key in keys(sorted(tensors))}, str(part_folder / name))


def _index(part_folder: Path, placed: dict[str, str]) -> None:
    (part_folder / INDEX[part_folder.name]).write_text(json.dumps({"metadata": {}, "weight_map": placed}))


def _placed_in(part_folder: Path, name: str) -> dict[str, str]:
    with safe_open(str(part_folder / name), "pt") as handle:
        return dict.fromkeys(handle.keys(), name)


def _generate(model: Path, out: Path, *more: str) -> list[str]:
    return ["generate", "--model-dir", str(model), "--prompt", "a fox", "--width", "256", "--height", "256",
            "--steps", "1", "--seed", "3", "--device", "cpu", "--out", str(out), *more]


def _refused(capsys, argv: list[str]) -> str:
    """The CLI's one line for a refusal: exit code 2, nothing else on stderr."""
    assert main(argv) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), lines
    return lines[0].removeprefix("error: ")


def _pixels(path: Path) -> bytes:
    from PIL import Image

    with Image.open(path) as image:
        return image.tobytes()


# ------------------------------------------------------------------------------ a tensor two files of a folder hold
@pytest.mark.parametrize("stray", ["zzz.safetensors", "aaa.safetensors"], ids=["sorting after", "sorting before"])
@pytest.mark.parametrize("part", list(WEIGHTS))
def test_an_all_zero_copy_beside_a_parts_weights_is_refused_before_any_weight_is_read(
        capsys, tmp_path, model, weights_read, dit_steps, part, stray):
    _zero_copy(model / part, stray)
    first, second = sorted([WEIGHTS[part], stray])
    line = _refused(capsys, _generate(model, tmp_path / "x.png"))
    assert line.startswith(f"{part}/ holds ") and f" more tensors) in two files, {first} and {second}, and " \
                                                 f"{NO_INDEX}" in line, line
    assert str(tmp_path) not in line  # the folder by its name, as the files are
    assert weights_read == [] and dit_steps == [] and not (tmp_path / "x.png").exists()


@pytest.mark.parametrize("part", list(WEIGHTS))
def test_one_tensor_two_files_hold_is_named_with_both_files_by_every_front_end(
        capsys, tmp_path, model, weights_read, monkeypatch, part):
    key = sorted(_stored(model / part, WEIGHTS[part]))[-1]  # as the file names it
    _zero_copy(model / part, "zzz.safetensors", lambda keys: [key])
    says = f"{part}/ holds {key} in two files, {WEIGHTS[part]} and zzz.safetensors, and {NO_INDEX}"
    assert _refused(capsys, _generate(model, tmp_path / "x.png")) == says
    with pytest.raises(ModelFileError) as library:
        LocalPipe.load(ModelSources(model_dir=model), LoadOptions(device="cpu"))
    monkeypatch.setitem(sys.modules, "folder_paths", fake_folder_paths(model.parent.parent))
    with pytest.raises(ModelFileError) as loader:
        ErnieImageLoader().load(diffusers_folder=model.name, diffusion_model="(none)", text_encoder="(none)",
                                vae="(none)", prompt_enhancer="(none)", variant="auto", vram_budget_gb=0.0,
                                keep_loaded=False)
    assert str(library.value) == str(loader.value) == says
    assert weights_read == []


def test_quantize_refuses_a_transformer_folder_holding_a_tensor_twice_before_writing(capsys, tmp_path, model):
    _zero_copy(model / "transformer", "zzz.safetensors")
    out = tmp_path / "quantized" / "ernie-image-turbo-fp8.safetensors"
    out.parent.mkdir()
    line = _refused(capsys, ["quantize", "--dit", str(model / "transformer"), "--format", "fp8", "--out", str(out)])
    assert line.startswith("transformer/ holds ") and line.endswith(
        f"in two files, diffusion_pytorch_model.safetensors and zzz.safetensors, and {NO_INDEX}"), line
    assert list(out.parent.iterdir()) == []


@pytest.mark.parametrize("part, stored, prefix", [
    ("transformer", "", "model.diffusion_model."), ("transformer", "", "diffusion_model."),
    ("text_encoder", "language_model.model.", "model."), ("vae", "", "vae."), ("vae", "", "first_stage_model.")])
def test_a_prefixed_copy_beside_a_parts_weights_is_refused_naming_both_files(capsys, tmp_path, model, weights_read,
                                                                             part, stored, prefix):
    """A copy under another checkpoint prefix (a ComfyUI file left in the folder) does not collide with the
    weights' own names, yet names the same tensors: which copy was read would depend on the order prefixes are
    tried."""
    folder = model / part
    tensors = _stored(folder, WEIGHTS[part])
    save_file({prefix + key.removeprefix(stored): torch.zeros_like(value) for key, value in tensors.items()},
              str(folder / "comfy_copy.safetensors"))
    line = _refused(capsys, _generate(model, tmp_path / "x.png"))
    assert line.startswith(f"{part} holds its weights twice, as "), line
    copy, weights = f"as {prefix}", f"as {stored}"  # each tensor as stored in its file, the files named
    assert copy in line and weights in line and " in comfy_copy.safetensors" in line and f" in {WEIGHTS[part]}" in line
    assert line.endswith(": remove the stray copy, or keep the one file with the model"), line
    assert weights_read == [] and not (tmp_path / "x.png").exists()


# --------------------------------------------------------------------------------------- shards, with and without
def _sharded(part_folder: Path, twice: tuple[str, ...] = ()) -> dict[str, str]:
    """The part's weights split into two shards (the tensors `twice` in both, the second's copy zeros); where each
    tensor's first copy is."""
    tensors = _stored(part_folder, WEIGHTS[part_folder.name])
    (part_folder / WEIGHTS[part_folder.name]).unlink()
    keys = sorted(tensors)
    names = ("model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors")
    save_file({key: tensors[key] for key in keys[::2]}, str(part_folder / names[0]))
    save_file({key: tensors[key] if key not in twice else torch.zeros_like(tensors[key])
               for key in (*keys[1::2], *twice)}, str(part_folder / names[1]))
    return {key: names[index % 2] for index, key in enumerate(keys)}


@pytest.fixture
def picture(tmp_path, tiny_turbo_folder) -> bytes:
    """The tiny model's picture, as its released files make it."""
    out = tmp_path / "released.png"
    assert main(_generate(tiny_turbo_folder, out)) == 0
    return _pixels(out)


KINDS = {"transformer": "dit", "text_encoder": "text_encoder", "vae": "vae"}


def _read_as_released(model: Path, released: Path, part: str) -> bool:
    """Every tensor of the part, as read from `model`, is the released file's (shards' tensors sit elsewhere in their
    files, so a picture may differ in its last bit: the CPU's matrix kernels follow the data's alignment)."""
    read, expected = (open_component(folder / part, KINDS[part]) for folder in (model, released))
    return read.keys == expected.keys and all(torch.equal(read.tensor(key), expected.tensor(key))
                                              for key in expected.keys)


@pytest.mark.parametrize("part", ["transformer", "text_encoder"])
def test_shards_without_an_index_load_each_tensor_from_the_one_shard_holding_it(tmp_path, model, tiny_turbo_folder,
                                                                                 part):
    _sharded(model / part)
    assert main(_generate(model, tmp_path / "x.png")) == 0
    assert _read_as_released(model, tiny_turbo_folder, part)


@pytest.mark.parametrize("part", ["transformer", "text_encoder"])
def test_an_index_decides_which_shard_a_tensor_two_shards_hold_is_read_from(tmp_path, model, tiny_turbo_folder, part):
    folder = model / part
    first = sorted(_stored(folder, WEIGHTS[part]))[0]  # in the first shard, and as zeros in the second
    _index(folder, _sharded(folder, twice=(first,)))
    assert main(_generate(model, tmp_path / "x.png")) == 0
    assert _read_as_released(model, tiny_turbo_folder, part)


def _lora_beside(folder: Path) -> None:
    """A LoRA file left in the folder: tensors of other names, none of this model's."""
    key = next(key for key in sorted(_stored(folder, WEIGHTS[folder.name])) if key.endswith("linear_fc2.weight"))
    save_file({key.replace(".weight", ".lora_A.weight"): torch.ones(2, 8)}, str(folder / "my_lora.safetensors"))


UNREAD = ("transformer/zzz.safetensors is not read: transformer/diffusion_pytorch_model.safetensors.index.json names "
          "the files that are, as diffusers reads the folder; to run that file instead, give it as the part's file "
          "itself")


@pytest.mark.parametrize("stray, told", [
    (lambda folder: _zero_copy(folder, "zzz.safetensors"), UNREAD),
    (lambda folder: _complete_copy_beside_shards(folder), UNREAD),
    (lambda folder: _zero_copy(folder, "diffusion_pytorch_model.fp16.safetensors"), None),
    (lambda folder: (folder / "zzz.safetensors").write_bytes(b"not weights"), UNREAD),
    (lambda folder: save_file({"foo": torch.ones(2)}, str(folder / "zzz.safetensors")), UNREAD),
    (_lora_beside, UNREAD.replace("zzz", "my_lora")),
    (lambda folder: (folder / "zzz.gguf").write_bytes(b"GGUF" + bytes(60)), UNREAD.replace(".safetensors is", ".gguf is"))],
    ids=["a complete copy", "a complete copy beside shards", "a diffusers variant copy", "not a weight file at all",
         "another model's tensors", "a LoRA", "a GGUF file"])
def test_a_file_the_index_does_not_name_is_not_read_and_one_of_this_models_is_told_once(
        capsys, tmp_path, model, picture, monkeypatch, stray, told):
    """What diffusers reads, and no more; a file holding this model's tensors (the user may have meant it to be
    read) is told in one line, once a pipe, not at every job."""
    folder = model / "transformer"
    _index(folder, _placed_in(folder, WEIGHTS["transformer"]))
    stray(folder)
    pipe = LocalPipe.load(model, LoadOptions(device="cpu"))
    assert pipe.file_notices == ((told,) if told else ())
    assert main(_generate(model, tmp_path / "x.png")) == 0
    assert _pixels(tmp_path / "x.png") == picture
    said = [line for line in capsys.readouterr().err.splitlines() if "is not read" in line]
    assert said == ([told] if told else [])
    monkeypatch.setitem(sys.modules, "folder_paths", fake_folder_paths(model.parent.parent))
    shown = ErnieImageLoader().load(diffusers_folder=model.name, diffusion_model="(none)", text_encoder="(none)",
                                    vae="(none)", prompt_enhancer="(none)", variant="auto", vram_budget_gb=0.0,
                                    keep_loaded=False)
    assert ("is not read" in str(shown)) == bool(told) and (told or "") in str(shown)


def test_a_folder_holding_its_weights_only_as_a_diffusers_variant_reads_them_and_says_so(capsys, tmp_path, model,
                                                                                        picture):
    folder = model / "transformer"
    (folder / WEIGHTS["transformer"]).rename(folder / "diffusion_pytorch_model.fp16.safetensors")
    assert main(_generate(model, tmp_path / "x.png")) == 0
    assert _pixels(tmp_path / "x.png") == picture
    said = [line for line in capsys.readouterr().err.splitlines() if "variant" in line]
    assert said == ["transformer/ holds its weights only as a diffusers variant (diffusion_pytorch_model.fp16."
                    "safetensors): they are read, as diffusers reads them when that variant is asked for"]


def _complete_copy_beside_shards(folder: Path) -> None:
    _zero_copy(folder, "zzz.safetensors")
    _index(folder, _sharded(folder))


@pytest.mark.parametrize("stray", [lambda folder: _zero_copy(folder, "zzz.safetensors"),
                                   lambda folder: (folder / "junk.safetensors").write_text("hello")],
                         ids=["a zero copy", "no weights at all"])
def test_quantize_reads_each_tensor_from_the_file_the_index_names(tmp_path, model, stray):
    """As generate does: a file the index does not name is neither read nor judged."""
    folder = model / "transformer"
    written = []
    for name, strayed in (("released", False), ("with a stray file", True)):
        if strayed:
            _index(folder, _placed_in(folder, WEIGHTS["transformer"]))
            stray(folder)
        out = tmp_path / name / "ernie-image-turbo-fp8.safetensors"
        out.parent.mkdir()
        assert main(["quantize", "--dit", str(folder), "--format", "fp8", "--out", str(out)]) == 0
        written.append(load_file(str(out)))
    assert written[0].keys() == written[1].keys()
    assert all(torch.equal(written[0][key], written[1][key]) for key in written[0])


def _missing_shard(folder: Path) -> str:
    placed = _placed_in(folder, WEIGHTS[folder.name])
    _index(folder, {**placed, "extra.weight": "model-00002-of-00002.safetensors"})
    return (f"{folder.name}/{INDEX[folder.name]} names 'model-00002-of-00002.safetensors', which is not a file in "
            f"{folder.name}/: the download is incomplete: download the folder again")


def _misplaced(folder: Path) -> str:
    placed = _placed_in(folder, WEIGHTS[folder.name])
    key = sorted(placed)[0]
    _zero_copy(folder, "other.safetensors", lambda keys: keys[1:2])
    _index(folder, {**placed, key: "other.safetensors"})
    return (f"{folder.name}/{INDEX[folder.name]} places {key} in other.safetensors, which does not hold it: the folder "
            f"is incomplete or mixed: download it again")


def _not_json(folder: Path) -> str:
    (folder / INDEX[folder.name]).write_text('{"weight_map": ')
    return f"{folder.name}/{INDEX[folder.name]} is not valid JSON (line 1, column 16: Expecting value): download it again"


def _nested_too_deep(folder: Path) -> str:
    (folder / INDEX[folder.name]).write_text("[" * 100_000 + "]" * 100_000)
    return f"{folder.name}/{INDEX[folder.name]} is not valid JSON (nested deeper than JSON is read): download it again"


def _a_5000_digit_number(folder: Path) -> str:
    (folder / INDEX[folder.name]).write_text('{"metadata": {"total_size": ' + "9" * 5000 + '}, "weight_map": {}}')
    return (f"{folder.name}/{INDEX[folder.name]} is not valid JSON (a number of more digits than can be read): "
            "download it again")


def _no_weight_map(folder: Path) -> str:
    (folder / INDEX[folder.name]).write_text("[1, 2]")
    return f"{folder.name}/{INDEX[folder.name]} is not a safetensors index (it holds no weight_map): download it again"


def _a_key_placed_twice(folder: Path) -> str:
    """Two files for one key in the index's text: json.loads would keep the last and say nothing."""
    placed = _sharded(folder)
    key = sorted(placed)[0]
    weight_map = "{" + json.dumps(key) + ': "model-00002-of-00002.safetensors", ' + json.dumps(placed)[1:]
    (folder / INDEX[folder.name]).write_text('{"weight_map": ' + weight_map + "}")
    return (f"{folder.name}/{INDEX[folder.name]} holds the key {key!r} twice in one object, so which value is meant "
            "is not known: download it again")


def _weight_map_a_list(folder: Path) -> str:
    placed = _placed_in(folder, WEIGHTS[folder.name])
    (folder / INDEX[folder.name]).write_text(json.dumps({"weight_map": [list(item) for item in placed.items()]}))
    return (f"{folder.name}/{INDEX[folder.name]} is not a safetensors index (it has a weight_map that is not an object "
            f"of file names): download it again")


def _path_out_of_the_folder(folder: Path) -> str:
    placed = _placed_in(folder, WEIGHTS[folder.name])
    shutil.copy(folder / WEIGHTS[folder.name], folder.parent / "elsewhere.safetensors")
    _index(folder, {**placed, sorted(placed)[0]: "../elsewhere.safetensors"})
    return (f"{folder.name}/{INDEX[folder.name]} names '../elsewhere.safetensors', a path where an index names a file "
            f"beside it in {folder.name}/: download the folder's index again")


def _naming_itself(folder: Path) -> str:
    placed = _placed_in(folder, WEIGHTS[folder.name])
    _index(folder, {**placed, sorted(placed)[0]: INDEX[folder.name]})
    return (f"{folder.name}/{INDEX[folder.name]} names '{INDEX[folder.name]}' as a weight file, which is no "
            f".safetensors file: download the folder's index again")


def _shard_left_out(folder: Path) -> str:
    placed = _sharded(folder)
    _index(folder, {key: name for key, name in placed.items() if name == "model-00001-of-00002.safetensors"})
    return (f"{folder.name}/{INDEX[folder.name]} leaves out model-00002-of-00002.safetensors, which holds ")


def _left_out_twice(folder: Path) -> str:
    key = sorted(_stored(folder, WEIGHTS[folder.name]))[0]
    placed = _sharded(folder, twice=(key,))
    del placed[key]
    _index(folder, placed)
    return (f"{folder.name}/ holds {key} in two files, model-00001-of-00002.safetensors and "
            f"model-00002-of-00002.safetensors, and its index does not place it: remove the stray file, or download "
            f"the folder's index again")


@pytest.mark.parametrize("fault", [_missing_shard, _misplaced, _not_json, _nested_too_deep, _a_5000_digit_number,
                                   _no_weight_map, _a_key_placed_twice,
                                   _weight_map_a_list, _path_out_of_the_folder, _naming_itself, _shard_left_out,
                                   _left_out_twice],
                         ids=["naming a file not there", "placing a tensor in a file not holding it", "not JSON",
                              "nested deeper than JSON is read", "a 5000-digit number", "no weight_map",
                              "a key placed twice",
                              "a weight_map that is a list",
                              "naming a path out of the folder", "naming itself", "leaving out a shard",
                              "leaving out a tensor two shards hold"])
@pytest.mark.parametrize("part", ["transformer", "vae"])
def test_an_index_that_does_not_place_the_tensors_is_refused_in_one_line(capsys, tmp_path, model, weights_read, part,
                                                                         fault):
    says = fault(model / part)
    line = _refused(capsys, _generate(model, tmp_path / "x.png"))
    assert line.startswith(says), line
    assert "Error" not in line  # the cause in words, not an exception's name
    assert weights_read == [] and not (tmp_path / "x.png").exists()


# ------------------------------------------------------------------------------------------- what else a folder holds
@pytest.mark.parametrize("stray_from, into, described, role", [
    ("vae", "transformer", "the FLUX.2 VAE (diffusers names)", "VAE"),
    ("transformer", "text_encoder", "an ERNIE-Image transformer", "transformer (DiT)"),
    ("transformer", "vae", "an ERNIE-Image transformer", "transformer (DiT)")])
def test_another_parts_file_beside_a_parts_weights_is_named(capsys, tmp_path, model, weights_read, stray_from, into,
                                                             described, role):
    """Not blamed on the folder's config, nor the folder taken for the other part."""
    shutil.copy(model / stray_from / WEIGHTS[stray_from], model / into / "extra.safetensors")
    line = _refused(capsys, _generate(model, tmp_path / "x.png"))
    assert line.startswith(f"{into}/ holds extra.safetensors, {described}, beside the ERNIE-Image "), line
    assert line.endswith(f"'s weights: remove it, or give it as the {role}"), line
    assert weights_read == []


@pytest.mark.parametrize("companion", ["._diffusion_pytorch_model.safetensors",
                                       "diffusion_pytorch_model.fp16.safetensors"],
                         ids=["macOS's AppleDouble companion", "a diffusers variant copy"])
def test_files_diffusers_never_reads_beside_the_weights_are_not_read(tmp_path, model, picture, companion):
    """An AppleDouble file (`._name`, from a copy through exFAT) is no weights at all; a variant copy is read by
    diffusers only when that variant is asked for. Neither is read, nor refused as a stray copy."""
    folder = model / "vae"
    if companion.startswith("._"):
        (folder / companion).write_bytes(b"\x00\x05\x16\x07" + b"\x00" * 80)
    else:
        _zero_copy(folder, companion)
    assert main(_generate(model, tmp_path / "x.png")) == 0
    assert _pixels(tmp_path / "x.png") == picture


def test_a_shard_missing_from_a_folder_without_an_index_is_named(capsys, tmp_path, model, weights_read):
    folder = model / "transformer"
    _sharded(folder)
    (folder / "model-00002-of-00002.safetensors").unlink()
    line = _refused(capsys, _generate(model, tmp_path / "x.png"))
    assert line == ("transformer/ holds 1 of the 2 shards of model and not model-00002-of-00002.safetensors: the "
                    "download is incomplete: download the folder again")
    assert weights_read == []


# ------------------------------------------------------------------------------------------- what no reader should open
def _fifo(path: Path) -> Path:
    if path.exists():
        path.unlink()
    os.mkfifo(path)
    return path


@contextlib.contextmanager
def _unblocked_after(fifo: Path, seconds: float = 20.0):
    """A reader blocked on `fifo` (the fault under test) is let go after `seconds`: a test that fails, not one that
    hangs."""
    done = threading.Event()

    def release() -> None:
        if not done.wait(seconds):
            with contextlib.suppress(OSError):
                os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))

    watchdog = threading.Thread(target=release, daemon=True)
    watchdog.start()
    try:
        yield
    finally:
        done.set()
        watchdog.join()


@pytest.mark.skipif(not hasattr(os, "mkfifo"), reason="no named pipes on this system")
@pytest.mark.parametrize("where, named", [
    ("transformer/diffusion_pytorch_model.safetensors", "transformer/diffusion_pytorch_model.safetensors"),
    ("transformer/stray.safetensors", "transformer/stray.safetensors"),
    ("transformer/config.json", "{model}/transformer/config.json"),
    ("tokenizer/tokenizer.json", "{model}/tokenizer/tokenizer.json"),
    ("vae/diffusion_pytorch_model.safetensors.index.json", "vae/diffusion_pytorch_model.safetensors.index.json")])
def test_a_named_pipe_where_a_model_file_is_read_is_refused_without_waiting_on_it(capsys, tmp_path, model, where,
                                                                                  named):
    """A FIFO blocks a read until someone writes to it: a folder handed over with one would hang the run for ever."""
    fifo = _fifo(model / where)
    with _unblocked_after(fifo):
        line = _refused(capsys, _generate(model, tmp_path / "x.png"))
    assert line.startswith(f"{named.format(model=model)} is not a regular file (a pipe, device or socket): "), line


def test_a_variant_index_beside_the_plain_one_is_not_read(tmp_path, model, tiny_turbo_folder):
    """A full snapshot of a diffusers repository that ships fp16 variants: its plain index and shards are read, as
    diffusers reads them; the variant's index (and its zero shards here) are not."""
    folder = model / "transformer"
    _index(folder, _sharded(folder))
    zeros = {key: torch.zeros_like(value) for key, value in load_file(str(tiny_turbo_folder / "transformer" /
                                                                          WEIGHTS["transformer"])).items()}
    save_file(zeros, str(folder / "diffusion_pytorch_model.fp16-00001-of-00001.safetensors"))
    (folder / "diffusion_pytorch_model.fp16.safetensors.index.json").write_text(json.dumps(
        {"weight_map": dict.fromkeys(zeros, "diffusion_pytorch_model.fp16-00001-of-00001.safetensors")}))
    assert main(_generate(model, tmp_path / "x.png")) == 0
    assert _read_as_released(model, tiny_turbo_folder, "transformer")
