"""A missing or damaged config.json (transformer/, text_encoder/, vae/ of a diffusers folder, and of the demo model's
cache) is one line naming the file and the fix, before any work starts: never a JSONDecodeError, AttributeError or
TypeError traceback."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from ernie_image.runtime.cli.commands import main


def _cli(capsys, *argv: str) -> str:
    assert main(list(argv)) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), lines  # no notice, no step: nothing ran
    return lines[0]


def _cut_short(config: Path) -> None:
    config.write_text(config.read_text()[:40])


def _nested_too_deep(config: Path) -> None:
    config.write_text("[" * 100_000 + "]" * 100_000)


def _not_utf8(config: Path) -> None:
    config.write_bytes(b'{"num_layers": "\xff"}')


def _a_5000_digit_number(config: Path) -> None:
    config.write_text('{"num_layers": ' + "9" * 5000 + "}")


def _with_a_bom(config: Path) -> None:
    config.write_bytes(b"\xef\xbb\xbf" + config.read_bytes())


def _a_key_twice(config: Path) -> None:
    """The same field twice, as a hand edit leaves it: json.loads would keep the last and say nothing."""
    config.write_text('{"layers_per_block": 2, ' + config.read_text().lstrip()[1:])


def _a_list(config: Path) -> None:
    config.write_text("[1, 2]")


def _wrong_type(key: str):
    def damage(config: Path) -> None:
        values = json.loads(config.read_text())
        section = values.get("text_config", values)
        section[key] = "two"
        config.write_text(json.dumps(values))
    damage.__name__ = f"{key}_two"
    return damage


DAMAGES = [
    ("transformer", _cut_short, "is not valid JSON (line "),
    ("transformer", _a_list, "holds a JSON list, not a config (a JSON object)"),
    ("transformer", _wrong_type("num_layers"), 'says num_layers "two", which is not a positive whole number'),
    ("text_encoder", _cut_short, "is not valid JSON (line "),
    ("text_encoder", _a_list, "holds a JSON list, not a config (a JSON object)"),
    ("text_encoder", _wrong_type("hidden_size"), 'says text_config.hidden_size "two", which is not a positive whole'),
    ("vae", _cut_short, "is not valid JSON (line "),
    ("vae", _a_list, "holds a JSON list, not a config (a JSON object)"),
    ("vae", _wrong_type("layers_per_block"), 'says layers_per_block "two", which is not a positive whole number'),
    ("transformer", _nested_too_deep, "is not valid JSON (nested deeper than JSON is read): the file is damaged: "
                                      "re-download it"),
    ("vae", _not_utf8, "is not valid JSON (not UTF-8 text at byte 16): the file is damaged: re-download it"),
    ("transformer", _a_5000_digit_number, "is not valid JSON (a number of more digits than can be read): the file "
                                          "is damaged: re-download it"),
    ("vae", _a_key_twice, "holds the key 'layers_per_block' twice in one object, so which value is meant is not "
                          "known: the file is damaged: re-download it"),
    ("text_encoder", _with_a_bom, "starts with a byte-order mark (an editor saved it as 'UTF-8 with BOM'): save it "
                                  "as plain UTF-8, or re-download it"),
]
IDS = [f"{component} {damage.__name__.strip('_').replace('_', ' ')}" for component, damage, _ in DAMAGES]


@pytest.fixture
def model(tmp_path, tiny_turbo_folder) -> Path:
    return Path(shutil.copytree(tiny_turbo_folder, tmp_path / "model"))


@pytest.mark.parametrize("component, damage, says", DAMAGES, ids=IDS)
def test_a_damaged_config_is_one_line_naming_the_file(capsys, tmp_path, model, component, damage, says):
    config = model / component / "config.json"
    damage(config)
    out = tmp_path / "x.png"
    line = _cli(capsys, "generate", "--model-dir", str(model), "--steps", "1", "--device", "cpu", "--out", str(out))
    assert line.startswith(f"error: {config} ") and says in line and line.endswith("re-download it"), line
    assert not out.exists()


# Values no ERNIE-Image part is built from: a size that is not a positive whole number, an epsilon that is not a
# positive finite number, a RoPE base not above 1 (a negative eps ran to NaN and was blamed on the weights). The RoPE
# parameters of the text configs: tests/test_config_rope_values.py.
BAD_VALUES = [
    ("transformer", "eps", -1, "a positive finite number"),
    ("transformer", "eps", 0, "a positive finite number"),
    ("transformer", "eps", "1e-6", "a positive finite number"),
    ("transformer", "rope_theta", float("nan"), "a finite number > 1"),
    ("transformer", "num_attention_heads", 0, "a positive whole number"),
    ("transformer", "num_layers", -2, "a positive whole number"),
    ("transformer", "hidden_size", 64.5, "a positive whole number"),
    ("transformer", "ffn_hidden_size", [128], "a positive whole number"),
    ("transformer", "in_channels", True, "a positive whole number"),
    ("transformer", "rope_axes_dim", [8, 0, 24], "a list of three positive even whole numbers"),
    ("vae", "layers_per_block", 0, "a positive whole number"),
    ("vae", "norm_num_groups", -4, "a positive whole number"),
    ("vae", "block_out_channels", [8, -16, 16, 32], "a list of positive whole numbers"),
    ("vae", "block_out_channels", [], "a list of positive whole numbers"),
    ("vae", "batch_norm_eps", -0.0001, "a positive finite number"),
    ("vae", "sample_size", 0, "a positive whole number or a list of them"),
    ("text_encoder", "rms_norm_eps", -1e-05, "a positive finite number"),
    ("text_encoder", "rms_norm_eps", float("inf"), "a positive finite number"),
    ("text_encoder", "num_attention_heads", 0, "a positive whole number"),
    ("text_encoder", "head_dim", 0, "a positive even whole number (RoPE rotates channels in pairs) or null"),
    ("text_encoder", "num_key_value_heads", -2, "a positive whole number or null"),
    ("text_encoder", "vocab_size", "270", "a positive whole number"),
]


@pytest.mark.parametrize("component, field, value, wanted", BAD_VALUES,
                         ids=[f"{component} {field} {value!r}" for component, field, value, _ in BAD_VALUES])
def test_a_config_value_no_part_is_built_from_is_one_line_naming_it_before_any_weight_is_read(
        capsys, tmp_path, model, monkeypatch, component, field, value, wanted):
    from ernie_image.runtime.formats.safetensors_reader import SafetensorsFile

    config = model / component / "config.json"
    _setting(field, value)(config)
    monkeypatch.setattr(SafetensorsFile, "tensor", lambda *a, **k: pytest.fail("a weight was read"))
    out = tmp_path / "x.png"
    line = _cli(capsys, "generate", "--model-dir", str(model), "--steps", "1", "--device", "cpu", "--out", str(out))
    name = f"text_config.{field}" if component == "text_encoder" else field
    assert line == f"error: {config} says {name} {json.dumps(value)}, which is not {wanted}: fix it or re-download it"
    assert not out.exists()


@pytest.mark.parametrize("component, field", [("transformer", "rope_axes_dim"), ("vae", "block_out_channels"),
                                              ("transformer", "num_layers"), ("text_encoder", "vocab_size")])
def test_a_long_value_is_shown_by_its_ends_in_a_short_line(capsys, tmp_path, model, component, field):
    """A list of 100,000 numbers where a field wants three (or one number): the refusal shows its first and last
    items, not 700 KB."""
    _setting(field, list(range(100_000)))(model / component / "config.json")
    line = _cli(capsys, "generate", "--model-dir", str(model), "--steps", "1", "--device", "cpu",
                "--out", str(tmp_path / "x.png"))
    assert len(line) < 400 and "[0, 1, 2, " in line and " ... " in line and ", 99999]" in line, line


def test_a_bad_value_in_a_config_embedded_in_a_single_file_is_named_with_the_fix_re_export(tmp_path, monkeypatch):
    from safetensors import safe_open
    from safetensors.torch import save_file

    from ernie_image.runtime.core.errors import ModelFileError
    from ernie_image.runtime.demo.tiny import build_tiny_model
    from ernie_image.runtime.formats.safetensors_reader import SafetensorsFile
    from ernie_image.runtime.local.options import LoadOptions
    from ernie_image.runtime.local.pipe import LocalPipe

    sources = build_tiny_model(tmp_path / "comfy", layout="comfy", variant="turbo")
    with safe_open(str(sources.text_encoder), "pt") as handle:
        tensors, metadata = {key: handle.get_tensor(key) for key in handle.keys()}, handle.metadata()
    config = json.loads(metadata["config"])
    config["rms_norm_eps"] = -1e-05
    save_file(tensors, str(sources.text_encoder), metadata={**metadata, "config": json.dumps(config)})
    monkeypatch.setattr(SafetensorsFile, "tensor", lambda *a, **k: pytest.fail("a weight was read"))
    with pytest.raises(ModelFileError) as refused:
        LocalPipe.load(sources, LoadOptions(device="cpu"))
    assert str(refused.value) == (f"the config in {sources.text_encoder.name}'s metadata says rms_norm_eps -1e-05, "
                                  "which is not a positive finite number: re-export or re-download the file")


def test_a_missing_vae_config_the_shapes_cannot_replace_is_named(capsys, tmp_path, model):
    (model / "vae" / "config.json").unlink()
    line = _cli(capsys, "generate", "--model-dir", str(model), "--device", "cpu", "--out", str(tmp_path / "x.png"))
    assert line.startswith(f"error: the config inferred for {model / 'vae'} (it has no config.json) does not "
                           "describe an ERNIE-Image VAE (") and line.endswith("put the model's config.json there")


@pytest.mark.parametrize("component, damage, says", DAMAGES[::3] + [("text_encoder", "missing", "text encoder width")],
                         ids=[*IDS[::3], "text_encoder missing"])
def test_a_damaged_demo_cache_says_delete_it_and_it_is_rebuilt(capsys, tmp_path, monkeypatch, tiny_turbo_folder,
                                                               component, damage, says):
    from ernie_image.runtime.demo.cached_model import demo_model_folder

    monkeypatch.setenv("ERNIE_IMAGE_CACHE", str(tmp_path / "cache"))
    cached = Path(shutil.copytree(tiny_turbo_folder, demo_model_folder("turbo")))  # what the demo builds
    (cached / ".complete").write_text("ok")
    config = cached / component / "config.json"
    config.unlink() if damage == "missing" else damage(config)
    line = _cli(capsys, "generate", "--device", "cpu", "--out", str(tmp_path / "x.png"))
    assert line.startswith(f"error: the demo model in {cached} is damaged (") and says in line, line
    assert line.endswith("delete that folder and run again: it is rebuilt"), line


@pytest.mark.parametrize("cut, unseen", [("x_embedder.proj.weight", "hidden_size, in_channels, num_attention_heads"),
                                         ("layers.0.self_attention.norm_q.weight", "num_attention_heads"),
                                         ("layers.0.mlp.gate_proj.weight", "ffn_hidden_size")],
                         ids=["no patch embedding", "no q norm", "no feed-forward"])
def test_a_dit_without_a_config_whose_tensors_do_not_show_its_fields_is_named(capsys, tmp_path, model, cut, unseen):
    """Without a config.json the DiT is built from its tensors' shapes: weights lacking one of those tensors are one
    line naming the fields they do not show."""
    from safetensors import safe_open

    folder = model / "transformer"
    weights = folder / "diffusion_pytorch_model.safetensors"
    with safe_open(weights, "pt") as opened:
        shapes = {key: tuple(opened.get_slice(key).get_shape()) for key in opened.keys() if key != cut}
    weights.unlink()
    (folder / "config.json").unlink()
    sparse_safetensors(weights, shapes)
    line = _cli(capsys, "generate", "--model-dir", str(model), "--device", "cpu", "--out", str(tmp_path / "x.png"))
    assert line == (f"error: {folder} has no config and its tensors do not show the transformer's {unseen}: its "
                    "weights are incomplete: re-download them")


def test_each_part_given_as_the_file_inside_its_folder_is_built_from_the_config_beside_it(tiny_turbo_folder):
    """--dit/--text-encoder/--vae naming the weights inside a diffusers folder's transformer/, text_encoder/ and vae/:
    each part is built from its own config.json there (the tiny VAE's norm groups and the tiny text encoder's
    width are in no released config), and the image is the folder's."""
    from ernie_image.runtime.core.host import NullHost
    from ernie_image.runtime.core.request import GenerationRequest
    from ernie_image.runtime.formats.sources import ModelSources
    from ernie_image.runtime.local.options import LoadOptions
    from ernie_image.runtime.local.pipe import LocalPipe

    files = ModelSources(dit=tiny_turbo_folder / "transformer" / "diffusion_pytorch_model.safetensors",
                         text_encoder=tiny_turbo_folder / "text_encoder" / "model.safetensors",
                         vae=tiny_turbo_folder / "vae" / "diffusion_pytorch_model.safetensors",
                         tokenizer=tiny_turbo_folder / "tokenizer")
    request = GenerationRequest(prompt="a fox", width=256, height=256, steps=1, seed=3)
    options = LoadOptions(device="cpu")
    from_files = LocalPipe.load(files, options).generate(request, NullHost()).images
    folder = ModelSources(model_dir=tiny_turbo_folder)
    from_folder = LocalPipe.load(folder, options).generate(request, NullHost()).images
    assert torch.equal(from_files, from_folder)


# ------------------------------------------------------------------------------------------- config against weights
def _setting(key: str, value):
    def change(config: Path) -> None:
        values = json.loads(config.read_text())
        section = values.get("text_config", values)
        if value is None:
            section.pop(key)
        else:
            section[key] = value
        config.write_text(json.dumps(values))
    return change


def _emptied(config: Path) -> None:
    config.write_text("{}")


# The tiny model: DiT 2 layers of width 64 (2 heads of 32), MLP 128; text encoder 4 layers of width 48, MLP 96;
# VAE channels [8, 16, 16, 32], one resnet a block (two in the decoder's).
MISFITS = [
    ("transformer", _setting("num_layers", 1), "says num_layers 1 but the weights hold 2 layers"),
    ("transformer", _setting("num_layers", 3), "says num_layers 3 but the weights hold 2 layers"),
    ("transformer", _setting("hidden_size", 128), "says hidden_size 128 but the weights hold 64 (x_embedder.proj"),
    ("transformer", _setting("ffn_hidden_size", 64), "says ffn_hidden_size 64 but the weights hold 128 ("),
    ("transformer", _setting("num_layers", None), "has no num_layers, and the weights hold 2 layers"),
    ("transformer", _emptied, "has no hidden_size, and the weights hold 64 (x_embedder.proj"),
    ("text_encoder", _setting("num_hidden_layers", 3), "says text_config.num_hidden_layers 3 but the weights hold 4 "
                                                       "layers"),
    ("text_encoder", _setting("intermediate_size", 48), "says text_config.intermediate_size 48 but the weights hold "
                                                        "96 ("),
    ("text_encoder", _setting("hidden_size", None), "has no text_config.hidden_size, and the weights hold 48 ("),
    ("text_encoder", _emptied, "has no hidden_size, and the weights hold 48 ("),
    ("vae", _setting("block_out_channels", [8, 16, 32, 32]), "says block_out_channels [8, 16, 32, 32] but the weights "
                                                             "hold [8, 16, 16, 32]"),
    ("vae", _setting("layers_per_block", 2), "says layers_per_block 2 but the weights hold 1"),
    ("vae", _setting("latent_channels", 16), "says latent_channels 16 but the weights hold 32"),
    ("vae", _emptied, "has no block_out_channels, and the weights hold [8, 16, 16, 32]"),
]
MISFIT_IDS = [f"{component} {says.split(' but')[0].split(',')[0]}" for component, _, says in MISFITS]


@pytest.mark.parametrize("component, change, says", MISFITS, ids=MISFIT_IDS)
def test_a_config_that_does_not_fit_the_weights_is_named_with_the_field_and_what_the_weights_hold(
        capsys, tmp_path, model, component, change, says):
    config = model / component / "config.json"
    change(config)
    out = tmp_path / "x.png"
    line = _cli(capsys, "generate", "--model-dir", str(model), "--steps", "1", "--device", "cpu", "--out", str(out))
    assert line.startswith(f"error: {config} {says}") and line.endswith(": fix it or re-download it"), line
    assert not out.exists()


def test_a_config_embedded_in_a_single_file_that_does_not_fit_is_named_with_the_fix_re_export(tmp_path):
    from safetensors import safe_open
    from safetensors.torch import save_file

    from ernie_image.runtime.core.errors import ModelFileError
    from ernie_image.runtime.demo.tiny import build_tiny_model
    from ernie_image.runtime.local.options import LoadOptions
    from ernie_image.runtime.local.pipe import LocalPipe

    sources = build_tiny_model(tmp_path / "comfy", layout="comfy", variant="turbo")
    with safe_open(str(sources.text_encoder), "pt") as handle:
        tensors, metadata = {key: handle.get_tensor(key) for key in handle.keys()}, handle.metadata()
    config = json.loads(metadata["config"])
    config["num_hidden_layers"] = 2
    save_file(tensors, str(sources.text_encoder), metadata={**metadata, "config": json.dumps(config)})
    with pytest.raises(ModelFileError) as refused:
        LocalPipe.load(sources, LoadOptions(device="cpu"))
    assert str(refused.value) == (f"the config in {sources.text_encoder.name}'s metadata says num_hidden_layers 2 but "
                                  "the weights hold 4 layers: re-export or re-download the file")


def test_a_prompt_enhancer_config_that_does_not_fit_is_refused_at_load(capsys, tmp_path, tiny_turbo_with_pe):
    model = Path(shutil.copytree(tiny_turbo_with_pe, tmp_path / "model"))
    config = model / "pe" / "config.json"
    _setting("num_hidden_layers", 2)(config)
    line = _cli(capsys, "generate", "--model-dir", str(model), "--steps", "1", "--device", "cpu",
                "--out", str(tmp_path / "x.png"))
    assert line == f"error: {config} says num_hidden_layers 2 but the weights hold 4 layers: fix it or re-download it"


def sparse_safetensors(path: Path, shapes: dict[str, tuple[int, ...]]) -> Path:
    """A bf16 safetensors file of these shapes whose data is a hole (no disk used): only its header is ever read."""
    header, offset = {}, 0
    for key, shape in shapes.items():
        size = 2 * int(torch.tensor(shape).prod()) if shape else 2
        header[key] = {"dtype": "BF16", "shape": list(shape), "data_offsets": [offset, offset + size]}
        offset += size
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    with open(path, "wb") as handle:
        handle.write(len(text).to_bytes(8, "little") + text)
        handle.truncate(8 + len(text) + offset)
    return path


@pytest.mark.parametrize("groups, refused", [(32, False), (16, True)])
def test_a_field_the_weights_cannot_show_must_be_the_released_ones_when_the_weights_are_the_released_vaes(
        tmp_path, tiny_turbo_folder, groups, refused):
    """GroupNorm's group count is in no tensor's shape: beside the released FLUX.2 VAE's weights, a config with
    another count is refused (any count dividing the channels would build and run, to another picture)."""
    from diffusers import AutoencoderKLFlux2

    from ernie_image.runtime.core.errors import ModelFileError
    from ernie_image.runtime.formats.config_json import load_config
    from ernie_image.runtime.formats.sources import ModelSources
    from ernie_image.runtime.local.options import LoadOptions
    from ernie_image.runtime.local.pipe import LocalPipe

    released = {key: value for key, value in load_config("turbo", "vae").items() if key != "force_upcast"}
    with torch.device("meta"):
        shapes = {key: tuple(t.shape) for key, t in AutoencoderKLFlux2.from_config(released).state_dict().items()}
    vae = tmp_path / "vae"
    vae.mkdir()
    sparse_safetensors(vae / "diffusion_pytorch_model.safetensors", shapes)
    (vae / "config.json").write_text(json.dumps({**released, "norm_num_groups": groups}))
    sources = ModelSources(model_dir=tiny_turbo_folder, vae=vae)
    if not refused:
        assert LocalPipe.load(sources, LoadOptions(device="cpu")).variant == "turbo"
        return
    with pytest.raises(ModelFileError) as refusal:
        LocalPipe.load(sources, LoadOptions(device="cpu"))
    assert str(refusal.value) == (f"{vae / 'config.json'} says norm_num_groups 16 but the weights are the released "
                                  "ERNIE-Image VAE's, whose norm_num_groups is 32: fix it or re-download it")
