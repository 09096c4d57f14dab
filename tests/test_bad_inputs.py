"""Every bad input fails early with one line that names the cause and the fix (ModelFileError / InvalidInputError)."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from ernie_image.runtime.core.errors import InvalidInputError, ModelFileError
from ernie_image.runtime.core.request import GenerationRequest, validate_size
from ernie_image.runtime.demo.comfy_files import tiny_tekken_bytes
from ernie_image.runtime.demo.tiny import BOS_ID, build_tiny_model
from ernie_image.runtime.formats import open_component
from ernie_image.runtime.formats.tekken import tokenizer_from_tekken_json
from ernie_image.runtime.text.encoder import token_ids


@pytest.fixture(scope="module")
def comfy(tmp_path_factory):
    return build_tiny_model(tmp_path_factory.mktemp("comfy"), layout="comfy", variant="base")


def _error(path, kind) -> str:
    with pytest.raises(ModelFileError) as caught:
        open_component(path, kind)
    message = str(caught.value)
    assert "\n" not in message and len(message) < 600
    return message


def _write(path: Path, tensors: dict[str, tuple[int, ...]]) -> Path:
    save_file({key: torch.zeros(shape) for key, shape in tensors.items()}, str(path))
    return path


@pytest.mark.parametrize("kind", ["dit", "text_encoder", "vae", "pe"])
def test_missing_file(kind, tmp_path):
    message = _error(tmp_path / "nowhere.safetensors", kind)
    assert "nowhere.safetensors does not exist" in message and "check the path" in message


def test_header_cut(comfy, tmp_path):
    cut = tmp_path / "cut.safetensors"
    cut.write_bytes(comfy.dit.read_bytes()[:100])
    message = _error(cut, "dit")
    assert "truncated inside its safetensors header" in message and "download it again" in message


def test_data_cut(comfy, tmp_path):
    data = comfy.dit.read_bytes()
    cut = tmp_path / "cut.safetensors"
    cut.write_bytes(data[: len(data) - 1000])
    message = _error(cut, "dit")
    assert "truncated" in message and "download it again" in message


def test_file_shorter_than_a_header(tmp_path):
    tiny = tmp_path / "tiny.safetensors"
    tiny.write_bytes(b"\x10\x00")
    assert "tiny.safetensors is truncated inside its safetensors header (2 bytes)" in _error(tiny, "vae")


@pytest.mark.parametrize("text", [b"hello\n", b"version https://git-lfs"[:7], (1 << 62).to_bytes(8, "little") + b"x"])
def test_a_file_whose_first_bytes_are_no_header_length_is_not_called_cut(tmp_path, text):
    """A length cut short still reads as a small number; text (a note, a pointer stub) or a length no header has
    does not. The fix is the file's, not "pick the .safetensors file itself": it is one, by its name."""
    note = tmp_path / "note.safetensors"
    note.write_bytes(text)
    message = _error(note, "vae")
    assert "note.safetensors is not a safetensors file (its first bytes are not a safetensors header)" in message
    assert message.endswith("download it again"), message


@pytest.mark.parametrize("kind", ["dit", "text_encoder", "vae"])
def test_a_file_holding_no_tensors_says_so(tmp_path, kind):
    message = _error(_write(tmp_path / "empty.safetensors", {}), kind)
    assert message.startswith("empty.safetensors is not an ") and ": it holds no tensors at all: " in message, message


def test_corrupt_header(comfy, tmp_path):
    data = bytearray(comfy.vae.read_bytes())
    data[8:20] = b"\x00garbage!!\xff\xfe"
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(bytes(data))
    assert "corrupt safetensors header" in _error(bad, "vae")


def test_a_header_nested_deeper_than_json_is_read_is_a_corrupt_header(tmp_path):
    header = b"[" * 100_000 + b"]" * 100_000
    bad = tmp_path / "nested.safetensors"
    bad.write_bytes(len(header).to_bytes(8, "little") + header)
    assert _error(bad, "vae") == ("nested.safetensors has a corrupt safetensors header (nested deeper than JSON is "
                                  "read): the file is damaged or was not fully downloaded: download it again")


@pytest.mark.parametrize("header, why", [
    (b'{"__metadata__": {"ernie_image.variant": "turbo"}, "__metadata__": {"ernie_image.variant": "base"}}',
     "the key '__metadata__' appears twice in one object, so which value is meant is not known"),
    (b'{"__metadata__": {"n": ' + b"9" * 5000 + b"}}", "a number of more digits than can be read")],
    ids=["a key twice", "a 5000-digit number"])
def test_a_header_json_cannot_hold_as_one_file_is_a_corrupt_header(tmp_path, header, why):
    bad = tmp_path / "odd.safetensors"
    bad.write_bytes(len(header).to_bytes(8, "little") + header)
    assert _error(bad, "dit") == (f"odd.safetensors has a corrupt safetensors header ({why}): the file is damaged or "
                                  "was not fully downloaded: download it again")


def test_not_a_safetensors_file_at_all(tmp_path):
    text = tmp_path / "notes.safetensors"
    text.write_text("these are not weights, just a text file that is long enough")
    message = _error(text, "dit")
    assert "not a safetensors file" in message


def test_pickle_checkpoints_are_refused(tmp_path):
    path = tmp_path / "model.safetensors"
    torch.save({"w": torch.zeros(2)}, path)  # a zip pickle, whatever its name says
    message = _error(path, "dit")
    assert "pickle" in message and "never loads" in message


def _opening_as(tensors: dict[str, torch.Tensor], magic: bytes) -> bytes:
    """A safetensors file of `tensors` whose first bytes (its header's length) are `magic`: metadata padded until
    the length's low bytes spell it."""
    from safetensors.torch import save

    length = int.from_bytes(save(tensors, metadata={"note": ""})[:8], "little")
    wanted = int.from_bytes(magic, "little")
    missing = (wanted - length) % (1 << 8 * len(magic))
    for pad in range(max(0, missing - 16), missing + 16):
        data = save(tensors, metadata={"note": "x" * pad})
        if data.startswith(magic):
            return data
    raise AssertionError(f"no padding gives a header length starting {magic!r}")


@pytest.mark.parametrize("protocol", [2, 3, 4, 5])
def test_a_safetensors_file_whose_header_length_starts_like_a_pickle_is_read_as_safetensors(comfy, tmp_path,
                                                                                             protocol):
    """A header length of 0x..0480 starts with the bytes of pickle protocol 4: about one file in 2,000. The header's
    "{" after the length tells it apart, for model files and LoRAs alike."""
    from safetensors.torch import load_file

    from ernie_image.runtime.lora.files import read_lora_tensors

    magic = bytes((0x80, protocol))
    dit = tmp_path / "ernie-image.safetensors"
    dit.write_bytes(_opening_as(load_file(str(comfy.dit)), magic))
    assert open_component(dit, "dit").keys == open_component(comfy.dit, "dit").keys
    lora = tmp_path / "lora.safetensors"
    pair = {"layers.0.self_attention.to_q.lora_A.weight": torch.ones(2, 8),
            "layers.0.self_attention.to_q.lora_B.weight": torch.ones(8, 2)}
    lora.write_bytes(_opening_as(pair, magic))
    assert sorted(read_lora_tensors(lora).tensors) == sorted(pair)


def test_flux_transformer_where_a_dit_is_expected(tmp_path):
    path = _write(tmp_path / "flux1-dev.safetensors", {
        "double_blocks.0.img_attn.qkv.weight": (6, 2), "double_blocks.0.img_attn.proj.weight": (2, 2),
        "img_in.weight": (2, 4), "final_layer.linear.weight": (4, 2)})
    message = _error(path, "dit")
    assert message.startswith("flux1-dev.safetensors is not an ERNIE-Image transformer: it looks like a FLUX.1 transformer")
    assert "found keys like double_blocks.0.img_attn.proj.weight" in message
    assert "diffusion_models/ernie-image.safetensors" in message


def test_sd_unet_where_a_dit_is_expected(tmp_path):
    path = _write(tmp_path / "sdxl.safetensors", {
        "model.diffusion_model.input_blocks.0.0.weight": (4, 4, 3, 3), "model.diffusion_model.out.2.weight": (4, 4)})
    assert "Stable Diffusion (SD1/SD2/SDXL) UNet" in _error(path, "dit")


def test_text_encoder_where_a_dit_is_expected(comfy):
    message = _error(comfy.text_encoder, "dit")
    assert "is not an ERNIE-Image transformer: it is the ERNIE-Image text encoder" in message
    assert "give it as the text encoder" in message


def test_dit_where_a_text_encoder_is_expected(comfy):
    message = _error(comfy.dit, "text_encoder")
    assert "is not an ERNIE-Image text encoder: it is the ERNIE-Image transformer (DiT)" in message


def test_vae_where_a_dit_is_expected(comfy):
    assert "it is the ERNIE-Image VAE (the FLUX.2 VAE (BFL names)" in _error(comfy.vae, "dit")


def test_flux1_vae_where_the_flux2_vae_is_expected(tmp_path):
    path = _write(tmp_path / "ae.safetensors", {"decoder.conv_in.weight": (512, 16, 3, 3),
                                                  "decoder.up.0.block.0.conv1.weight": (128, 256, 3, 3)})
    message = _error(path, "vae")
    assert "FLUX.1 / SD3 VAE" in message and "vae/flux2-vae.safetensors" in message


def test_flux2_text_encoder_where_ministral_is_expected(tmp_path):
    path = _write(tmp_path / "mistral_3_small.safetensors", {
        "model.embed_tokens.weight": (8, 5120), "model.layers.0.self_attn.q_proj.weight": (4, 5120)})
    message = _error(path, "text_encoder")
    assert "Mistral-Small 24B (FLUX.2's text encoder" in message and "ministral-3-3b" in message


def test_unknown_layout_lists_what_was_found(tmp_path):
    path = _write(tmp_path / "mystery.safetensors", {"alpha.weight": (2,), "beta.0.bias": (2,), "gamma": (1,)})
    message = _error(path, "dit")
    assert "layout is unknown (3 tensors, found keys like alpha.weight, beta.0.bias, gamma)" in message


def test_folder_without_weights(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    assert "holds no .safetensors weights (found config.json)" in _error(tmp_path, "vae")


def test_gguf_that_is_not_readable(tmp_path):
    path = tmp_path / "ernie-image-Q4_K_M.gguf"
    path.write_bytes(b"GGUF" + b"\x00" * 64)
    message = _error(path, "dit")
    assert message.startswith("ernie-image-Q4_K_M.gguf is not a readable GGUF file (") and "download it again" in message


@pytest.mark.parametrize("width,suggestion", [(1000, 1008), (250, 256), (5000, 4096),
                                              (1030, 1024), (1001, 1008)])
def test_size_not_allowed_suggests_the_nearest_valid_one(width, suggestion):
    with pytest.raises(InvalidInputError, match=f"width {width} is not allowed: .*; use {suggestion}$"):
        validate_size(width, 1024)
    with pytest.raises(InvalidInputError, match=f"use {suggestion}"):
        GenerationRequest(prompt="x", width=width).validate()


def test_empty_prompt_is_valid_and_is_one_bos_token():
    GenerationRequest(prompt="").validate()
    assert token_ids(tokenizer_from_tekken_json(tiny_tekken_bytes()), "") == [BOS_ID]


# ------------------------------------------------------------------ found by trying to break the CLI and the API
@pytest.fixture(scope="module")
def tiny_folder(tiny_turbo_folder) -> Path:
    return tiny_turbo_folder


def _cli(capsys, *argv: str) -> str:
    """Run `ernie-image` in-process; return its one-line error after checking the exit code and the form."""
    from ernie_image.runtime.cli.commands import main

    assert main(list(argv)) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), lines
    return lines[0]


@pytest.mark.parametrize("option,value,expected", [
    ("--width", "0", "width 0 is not allowed"),  # 0 used to mean "default" and ran at 256
    ("--height", "0", "height 0 is not allowed"),
    ("--steps", "0", "steps 0 is not allowed"),  # used to run the variant's default steps
    ("--cfg", "nan", "--cfg 'nan' is not a number: give a plain decimal"),  # NaN passed every range check
    ("--cfg", "101", "--cfg 101.0 is not allowed: use 0..100"),
    ("--shift", "nan", "--shift 'nan' is not a number"),
    ("--shift", "inf", "--shift 'inf' is not a number"),
    ("--shift", "0", "--shift 0.0 is not allowed: use 0.01..100"),
    ("--shift", "1e-30", "--shift 1e-30 is not allowed: use 0.01..100"),  # ran into NaN latents blamed on the weights
    ("--shift", "1e300", "--shift 1e+300 is not allowed: use 0.01..100"),  # ran silently
    ("--seed", str(2**64), "seed 18446744073709551616 is not allowed: use 0..9223372036854775807"),  # traceback
    ("--seed", "-1", "seed -1 is not allowed"),
    ("--budget", "abc", "--budget 'abc' is not a number of GiB"),  # traceback
    ("--device", "foo", "device 'foo' is not supported: use auto, cpu, cuda or cuda:N"),  # traceback
    ("--device", "mps", "device 'mps' is not supported"),
    ("--width", "abc", "--width 'abc' is not a whole number: give digits only, e.g. --width 1024"),  # a usage block
    ("--quant", "fp4", "quant 'fp4' is not supported: use one of none, auto, bf16, fp8"),  # was after text encoding
])
def test_cli_refuses_a_bad_setting_in_one_line(capsys, tiny_folder, tmp_path, option, value, expected):
    out = tmp_path / "out.png"
    line = _cli(capsys, "generate", "--model-dir", str(tiny_folder), "--width", "256", "--height", "256",
                "--out", str(out), option, value)
    assert expected in line
    assert list(tmp_path.iterdir()) == []


def test_cli_refuses_an_output_it_cannot_write_before_any_work(capsys, tiny_folder, tmp_path):
    (tmp_path / "taken.png").write_bytes(b"x")
    cases = {
        str(tmp_path / "picture.jpg"): "is not a .png file name",
        str(tmp_path / "noext"): "is not a .png file name",
        str(tmp_path): f"is a folder: give a file name inside it, e.g. --out {tmp_path / 'ernie.png'}",
        str(tmp_path / "folder.png"): "is a folder",
        str(tmp_path / "taken.png" / "x.png"): "taken.png is a file, not a folder",
        str(tmp_path / ("a" * 300 + ".png")): "cannot be used: File name too long",
    }
    (tmp_path / "folder.png").mkdir()
    for out, expected in cases.items():
        line = _cli(capsys, "generate", "--model-dir", str(tiny_folder), "--out", out)
        assert expected in line, line
    assert sorted(p.name for p in tmp_path.iterdir()) == ["folder.png", "taken.png"]


def test_cli_prompt_that_is_not_utf8_is_one_line(capsys, tiny_folder, tmp_path):
    undecodable = b"a fox \xff in snow".decode("utf-8", "surrogateescape")  # what Python makes of such argv bytes
    line = _cli(capsys, "generate", "--model-dir", str(tiny_folder), "--width", "256", "--height", "256",
                "--out", str(tmp_path / "x.png"), "--prompt", undecodable)
    assert "prompt is not valid UTF-8 text" in line and "save the prompt as UTF-8" in line


def test_a_failed_png_write_leaves_no_part_of_the_batch(tmp_path):
    from ernie_image.runtime.core.errors import ErnieImageError
    from ernie_image.runtime.files.png_output import save_pngs

    (tmp_path / "img_1.png").mkdir()  # the second image cannot be written
    with pytest.raises(ErnieImageError,
                       match=r"^out .*img\.png: img_1\.png cannot be written \(Is a directory\): give a path in a "
                             r"writable folder$"):
        save_pngs(torch.rand(2, 16, 16, 3), tmp_path / "img.png", {})
    assert [p.name for p in tmp_path.iterdir()] == ["img_1.png"]


@pytest.mark.parametrize("field,value,expected", [
    ("cfg", float("nan"), "cfg nan is not allowed"),
    ("shift", float("inf"), "shift inf is not allowed"),
    ("shift", 1e-30, "shift 1e-30 is not allowed: use 0.01..100"),
    ("shift", 1000.0, "shift 1000.0 is not allowed: use 0.01..100"),
    ("seed", 2**64, "seed 18446744073709551616 is not allowed"),
    ("seed", -5, "seed -5 is not allowed"),
    ("steps", 2.5, "steps 2.5 is not allowed: give a whole number"),  # was a TypeError deep in torch.linspace
    ("steps", True, "steps True is not allowed"),
    ("width", "256", "width '256' is not allowed: give a whole number"),
    ("batch", 2.0, "batch 2.0 is not allowed"),
    ("cfg", "4", "cfg '4' is not allowed: give a number"),
    ("prompt", None, "prompt None is not allowed: give text"),  # was an AttributeError mid-run
    ("negative_prompt", None, "negative_prompt None is not allowed"),
    ("prompt", "fox \udcff", "prompt is not valid UTF-8 text"),  # was a TypeError inside the tokenizer
    ("composite", "no", "composite 'no' is not allowed: give True or False"),  # was kept, and read as true
    ("use_pe", "false", "use_pe 'false' is not allowed: give True or False"),
    ("use_pe", 1, "use_pe 1 is not allowed: give True or False"),
    ("composite", None, "composite None is not allowed: give True or False"),
])
def test_request_refuses_bad_values_and_types(field, value, expected):
    request = GenerationRequest(**{"prompt": "x", "width": 256, "height": 256, field: value})
    with pytest.raises(InvalidInputError) as caught:
        request.validate()
    assert expected in str(caught.value) and "\n" not in str(caught.value)


def test_gguf_whose_metadata_is_garbage(tmp_path):
    path = tmp_path / "broken.gguf"
    path.write_bytes(b"GGUF\x03\x00\x00\x00" + b"garbagegarbagegarbage" * 10)  # raised IndexError from gguf's reader
    message = _error(path, "dit")
    assert message.startswith("broken.gguf is not a readable GGUF file (") and "download it again" in message


def test_an_explicit_tokenizer_without_one_is_refused_not_ignored(tiny_folder, tmp_path):
    from ernie_image.runtime.formats.sources import ModelSources
    from ernie_image.runtime.formats.tokenizer import load_tokenizer

    with pytest.raises(ModelFileError, match="tokenizer .*nowhere has no tokenizer.json"):
        load_tokenizer(ModelSources(model_dir=tiny_folder, tokenizer=tmp_path / "nowhere"))
    (tmp_path / "broken").mkdir()
    (tmp_path / "broken" / "tokenizer.json").write_text("{not json")
    with pytest.raises(ModelFileError, match=r"the tokenizer in .*broken cannot be read \(.*\): download"):
        load_tokenizer(ModelSources(model_dir=tiny_folder, tokenizer=tmp_path / "broken"))


def test_sampler_size_check_answers_a_message_for_text_in_width():
    from ernie_image.nodes.sampler import resolve_size

    with pytest.raises(InvalidInputError, match="must be whole numbers"):
        resolve_size("custom", "abc", 1024)


def test_cli_unknown_command_is_one_line(capsys):
    line = _cli(capsys, "genrate", "--width", "256")  # was the usage block with no error line
    assert line == "error: unknown command 'genrate': use one of generate, plan, quantize, enhance, check-remote " \
                   "(ernie-image --help)"


def test_cli_demo_model_in_an_unusable_cache_folder_is_one_line(capsys, tmp_path, monkeypatch):
    not_a_folder = tmp_path / "cache-is-a-file"
    not_a_folder.write_text("x")
    monkeypatch.setenv("ERNIE_IMAGE_CACHE", str(not_a_folder))  # was a NotADirectoryError traceback
    line = _cli(capsys, "generate", "--out", str(tmp_path / "x.png"))
    assert "cannot build the demo model in" in line and "set ERNIE_IMAGE_CACHE to a writable folder" in line
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cache-is-a-file"]


@pytest.mark.parametrize("argv,expected", [
    (["plan", "--budget", "12", "--width", "abc"], "--width 'abc' is not a whole number"),  # was a usage block
    (["plan", "--budget", "12", "--variant", "fast"], "argument --variant: invalid choice: 'fast'"),
    (["quantize", "--dit", "x.safetensors", "--format", "q9"], "argument --format: invalid choice: 'q9'"),
    (["check-remote"], "the following arguments are required"),
])
def test_every_command_reports_a_usage_error_in_one_line(capsys, argv, expected):
    assert expected in _cli(capsys, *argv)


def test_quantize_refuses_a_damaged_source_and_an_output_it_cannot_write(capsys, tmp_path):
    text = tmp_path / "notes.safetensors"
    text.write_text("this is not a safetensors file")
    assert "notes.safetensors is not a safetensors file" in _cli(
        capsys, "quantize", "--dit", str(text), "--format", "fp8", "--out", str(tmp_path / "q.safetensors"))
    source = tmp_path / "dit.safetensors"
    save_file({"x_embedder.proj.weight": torch.zeros(4, 4)}, str(source))
    for out, expected in [
        (tmp_path / "q.safetensors", "q.safetensors is not a .gguf file name: give e.g. --out"),  # wrote GGUF bytes
        (tmp_path / ".gguf", ".gguf is not a .gguf file name: give e.g. --out ernie-image-q8_0.gguf"),  # no stem
        (tmp_path / ("a" * 300 + ".gguf"), "File name too long"),  # was an OSError traceback
        (tmp_path / "missing" / "q.gguf", "does not exist: create it first"),  # was a FileNotFoundError traceback
    ]:
        assert expected in _cli(capsys, "quantize", "--dit", str(source), "--format", "q8_0", "--out", str(out))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["dit.safetensors", "notes.safetensors"]


@pytest.mark.parametrize("fmt, suffix", [("fp8", ".safetensors"), ("q8_0", ".gguf")])
def test_quantize_out_an_existing_folder_is_called_a_folder_with_a_file_inside_it(capsys, tmp_path, fmt, suffix):
    """Was "--out b6 does not end in .safetensors ... give e.g. --out b6.safetensors" for the folder b6."""
    source = tmp_path / "dit.safetensors"
    save_file({"x_embedder.proj.weight": torch.zeros(4, 4)}, str(source))
    folder = tmp_path / "b6"
    folder.mkdir()
    line = _cli(capsys, "quantize", "--dit", str(source), "--format", fmt, "--out", str(folder))
    assert line == (f"error: --out {folder} is a folder: give a file name inside it, e.g. "
                    f"--out {folder / ('ernie-image-' + fmt + suffix)}")
    assert list(folder.iterdir()) == []


def test_a_damaged_vae_fails_when_the_pipe_loads_not_after_sampling(tmp_path):
    from ernie_image.runtime.local.options import LoadOptions
    from ernie_image.runtime.local.pipe import LocalPipe

    sources = build_tiny_model(tmp_path, layout="diffusers", variant="turbo")
    vae_file = sources.model_dir / "vae" / "diffusion_pytorch_model.safetensors"
    data = vae_file.read_bytes()
    vae_file.write_bytes(data[: len(data) - 1000])  # an interrupted download
    with pytest.raises(ModelFileError, match="truncated.*download it again"):
        LocalPipe.load(sources, LoadOptions(device="cpu"))


@pytest.mark.parametrize("budget", [-1, 0, float("nan"), float("inf"), 1e300, "12", True])
def test_a_load_options_budget_that_is_not_a_positive_number_is_refused_at_load(budget):
    from ernie_image.runtime.local.options import LoadOptions

    with pytest.raises(InvalidInputError, match=r"^vram_budget_gb .* is not a positive number of GiB up to 1e\+06: "
                                                r"give the GiB the pipe may use, or None for free VRAM minus a reserve$"):
        LoadOptions(device="cpu", vram_budget_gb=budget).validate()


@pytest.mark.parametrize("budget", ["1e300", "2e6"])
def test_a_budget_beyond_any_device_is_refused_by_the_planner_in_one_line(budget):
    from ernie_image.runtime.core.errors import MemoryBudgetError
    from ernie_image.runtime.offload.planner import budget_bytes

    with pytest.raises(MemoryBudgetError, match=r"^VRAM budget .* GiB is more than any device holds \(at most 1e\+06\): "
                                                r"give e.g. 12 or 'auto'$"):
        budget_bytes(budget)


@pytest.mark.parametrize("dtype", ["fp64", "float32", ""])
def test_a_dtype_the_pipe_does_not_run_in_is_a_bad_input_not_a_model_file_error(tiny_folder, dtype):
    """A dtype is the user's choice: InvalidInputError when the options are checked (was ModelFileError)."""
    from ernie_image.runtime.formats.sources import ModelSources
    from ernie_image.runtime.local.options import LoadOptions, resolve_dtype
    from ernie_image.runtime.local.pipe import LocalPipe

    expected = f"dtype {dtype!r} is not supported: use auto, bf16, fp16, fp32"
    with pytest.raises(InvalidInputError) as caught:
        LoadOptions(dtype=dtype).validate()
    assert str(caught.value) == expected and not isinstance(caught.value, ModelFileError)
    with pytest.raises(InvalidInputError, match="is not supported: use auto, bf16, fp16, fp32"):
        LocalPipe.load(ModelSources(model_dir=tiny_folder), LoadOptions(device="cpu", dtype=dtype))
    with pytest.raises(InvalidInputError):
        resolve_dtype(dtype, torch.device("cpu"))


def test_the_cli_refuses_a_bad_dtype_in_one_line(capsys, tiny_folder, tmp_path):
    line = _cli(capsys, "generate", "--model-dir", str(tiny_folder), "--dtype", "fp64", "--out", str(tmp_path / "x.png"))
    assert line.startswith("error: argument --dtype: invalid choice: 'fp64'") and list(tmp_path.iterdir()) == []


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks a machine without a CUDA GPU")
@pytest.mark.parametrize("device", ["cuda", "cuda:3", "cuda:" + "9" * 20])
def test_a_cuda_device_asked_for_without_one_is_the_users_input_not_a_model_file(device):
    from ernie_image.runtime.local.options import resolve_device

    with pytest.raises(InvalidInputError, match=rf"device {device} was asked for but PyTorch sees no CUDA GPU: "
                                                r"choose cpu"):
        resolve_device(device)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks a machine without a CUDA GPU")
def test_a_pipe_whose_making_failed_leaves_no_finaliser_error(tiny_folder, monkeypatch):
    import gc

    from ernie_image.runtime.formats.sources import ModelSources
    from ernie_image.runtime.local.options import LoadOptions
    from ernie_image.runtime.local.pipe import LocalPipe

    unraisable = []
    monkeypatch.setattr(sys, "unraisablehook", unraisable.append)
    with pytest.raises(InvalidInputError, match="PyTorch sees no CUDA GPU"):
        LocalPipe.load(ModelSources(model_dir=tiny_folder), LoadOptions(device="cuda"))
    gc.collect()
    assert unraisable == []  # was "Exception ignored in: LocalPipe.__del__ ... no attribute 'memory'"


@pytest.mark.parametrize("device", ["cuda:", "cuda:\u0663", "cuda:+0", "cuda:0x1", "cuda:-1", "gpu"])
def test_a_device_string_torch_cannot_read_is_refused_as_the_setting_not_as_a_missing_gpu(device):
    from ernie_image.runtime.local.options import LoadOptions

    with pytest.raises(InvalidInputError, match=r"is not supported: use auto, cpu, cuda or cuda:N$"):
        LoadOptions(device=device).validate()


@pytest.mark.parametrize("device", [0, torch.device("cpu"), None])
def test_a_device_that_is_not_text_is_refused_as_the_setting(device):
    from ernie_image.runtime.local.options import LoadOptions

    with pytest.raises(InvalidInputError, match=r"is not supported: use 'auto', 'cpu', 'cuda' or 'cuda:N' "
                                                r"\(str\(device\) for a torch.device\)$"):
        LoadOptions(device=device).validate()


@pytest.mark.parametrize("field", ["model_dir", "dit", "text_encoder", "vae", "pe", "tokenizer"])
@pytest.mark.parametrize("value", [5, 2.0, ["a"], b"/x"])
def test_a_model_source_that_is_not_a_path_is_refused_naming_it(field, value):
    from ernie_image.runtime.formats.sources import ModelSources

    with pytest.raises(InvalidInputError, match=rf"^{field} .* is not a path: give a str or pathlib.Path, or None$"):
        ModelSources(**{field: value})


@pytest.mark.parametrize("field", ["model_dir", "dit", "text_encoder", "vae", "pe", "tokenizer"])
@pytest.mark.parametrize("value", ["", "  "], ids=["empty", "spaces"])  # Path("") is Path("."): meant, or not
def test_an_empty_path_is_refused_not_taken_for_the_working_folder(field, value):
    from ernie_image.runtime.formats.sources import ModelSources

    with pytest.raises(InvalidInputError, match=rf"^{field} is an empty path: give the file or folder, or None$"):
        ModelSources(**{field: value})


@pytest.mark.skipif(not os.access("/proc/self/mem", os.R_OK), reason="needs Linux's /proc/self/mem")
def test_a_file_the_system_lists_but_cannot_read_is_named_in_one_line(tiny_folder):
    from ernie_image.runtime.formats.sources import ModelSources
    from ernie_image.runtime.local.options import LoadOptions
    from ernie_image.runtime.local.pipe import LocalPipe

    with pytest.raises(ModelFileError, match=r"^mem cannot be read \(Input/output error\): check the file and the "
                                             r"disk it is on, or give another$"):
        LocalPipe.load(ModelSources(model_dir=tiny_folder, vae="/proc/self/mem"), LoadOptions(device="cpu"))


@pytest.mark.parametrize("field, part, named", [("dit", "DiT", "transformer"), ("vae", "VAE", "vae"),
                                                ("text_encoder", "text encoder", "text_encoder"),
                                                ("pe", "prompt enhancer", "pe")])
def test_a_device_or_pipe_given_as_a_part_is_refused_before_anything_reads_it(tiny_folder, tmp_path, field, part,
                                                                              named):
    from ernie_image.runtime.formats.sources import ModelSources
    from ernie_image.runtime.local.options import LoadOptions
    from ernie_image.runtime.local.pipe import LocalPipe

    fifo = tmp_path / "weights.safetensors"
    os.mkfifo(fifo)
    for special in (Path("/dev/zero"), fifo):  # a read of either would never end or never stop
        with pytest.raises(ModelFileError, match=rf"^{named} file {special} is not a regular file or a folder \(a "
                                                 rf"pipe, device or socket\): give the {part}'s weights file or "
                                                 r"folder$"):
            LocalPipe.load(ModelSources(model_dir=tiny_folder, **{field: special}), LoadOptions(device="cpu"))


@pytest.mark.parametrize("index", ["1", "9" * 20])  # 20 digits: past what torch.device can parse
def test_a_gpu_index_the_machine_lacks_names_the_gpus_it_has(monkeypatch, index):
    from ernie_image.runtime.local.options import resolve_device

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    with pytest.raises(InvalidInputError, match=rf"^device cuda:{index} was asked for but PyTorch sees 1 CUDA GPU\(s\): "
                                                r"choose cuda:0$"):
        resolve_device(f"cuda:{index}")


def test_the_cli_refuses_a_budget_beyond_any_device_in_its_own_words(tmp_path):
    site = tmp_path / "site"  # `python -m ernie_image` runs this checkout, not whichever one is installed
    site.mkdir()
    (site / "ernie_image").symlink_to(Path(__file__).resolve().parent.parent, target_is_directory=True)
    done = subprocess.run([sys.executable, "-m", "ernie_image", "generate", "--prompt", "x", "--width", "256",
                           "--height", "256", "--budget", "1e300", "--out", "never.png"],
                          capture_output=True, text=True, timeout=300, cwd=tmp_path,
                          env={**os.environ, "PYTHONPATH": str(site), "ERNIE_IMAGE_CACHE": str(tmp_path / "cache")})
    line = done.stderr.strip().splitlines()[-1]
    assert done.returncode == 2 and line.startswith("error: --budget 1e300 is not a positive number of GiB"), line
    assert line.endswith("or auto (free VRAM minus a reserve)") and "None" not in line, line
