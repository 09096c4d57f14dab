"""The CLI as a newcomer meets it: every argument checked before any work, one-line errors, exit codes, Ctrl-C,
`quantize`'s refusals and report, and the files each command leaves (or does not leave) behind."""
from __future__ import annotations

import os
import re
import signal
import stat
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Callable

import pytest
import torch
from safetensors.torch import load_file, save_file

from ernie_image.runtime.cli.commands import main
from ernie_image.runtime.core.request import SEED_MASK
from ernie_image.runtime.files.png_output import png_paths

from waiting import wait_until

REPO_ROOT = Path(__file__).resolve().parent.parent


PROGRESS_LINE = re.compile(r"(sampling|prompt enhancer)[^:]*: (step|token) \d+/\d+ ")


def _cli(capsys, *argv: str) -> str:
    """Run `ernie-image` in-process; return its one-line error after checking the exit code and the form."""
    assert main(list(argv)) == 2
    lines = [line for line in capsys.readouterr().err.strip().splitlines()
             if not PROGRESS_LINE.match(line) and not line.startswith("no --prompt given: the example prompt")]
    assert len(lines) == 1 and lines[0].startswith("error: "), lines
    return lines[0]


def _files(folder: Path) -> list[str]:
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*"))


@pytest.fixture
def empty_cache(tmp_path, monkeypatch) -> Path:
    cache = tmp_path / "cache"
    monkeypatch.setenv("ERNIE_IMAGE_CACHE", str(cache))
    return cache


# ------------------------------------------------------------------------------- one place checks every argument
def test_a_size_error_comes_before_a_file_error_and_before_the_demo_model_is_built(capsys, tmp_path, empty_cache):
    line = _cli(capsys, "generate", "--width", "100", "--dit", str(tmp_path / "missing.safetensors"),
                "--out", str(tmp_path / "missing-folder" / "x.png"))
    assert "width 100 is not allowed" in line
    assert "width 100 is not allowed" in _cli(capsys, "generate", "--width", "100", "--out", str(tmp_path / "x.png"))
    assert not empty_cache.exists()  # the demo model was not built for a run that could not start


def test_a_file_error_comes_before_the_output_error(capsys, tmp_path):
    line = _cli(capsys, "generate", "--dit", str(tmp_path / "missing.safetensors"),
                "--out", str(tmp_path / "missing-folder" / "x.png"))
    assert line.startswith("error: --dit ") and "does not exist: check the path" in line


@pytest.mark.parametrize("make, option, expected", [
    (lambda tmp: Path(os.devnull), "--dit", "is not a regular file or a folder (a device, pipe or socket)"),
    (lambda tmp: _fifo(tmp / "weights.fifo"), "--vae", "is not a regular file or a folder"),
    (lambda tmp: Path(os.devnull), "--model-dir", "is not a folder: give the folder itself"),
    (lambda tmp: _file(tmp / "model.safetensors"), "--model-dir", "is not a folder"),
    (lambda tmp: tmp / "nowhere", "--text-encoder", "does not exist: check the path"),
    (lambda tmp: _file(tmp / "a-file") / "below.safetensors", "--dit", "a-file is a file, not a folder"),
])
def test_inputs_that_are_not_a_regular_file_or_folder_are_one_line(capsys, tmp_path, make, option, expected):
    path = make(tmp_path)
    before = _files(tmp_path)
    line = _cli(capsys, "generate", option, str(path), "--out", str(tmp_path / "x.png"))
    assert f"{option} {path}" in line and expected in line, line
    assert _files(tmp_path) == before  # the FIFO was not opened (that would block), nothing was written


@pytest.mark.parametrize("character", ["\n", "\r", "\t", "\x1b", "\x07", "\x7f", "\x9b", "\u202e", "\u2066"],
                         ids=["line feed", "carriage return", "tab", "escape", "bell", "delete", "C1 CSI",
                              "right-to-left override", "left-to-right isolate"])
def test_a_control_character_in_a_name_is_shown_escaped_and_refused_in_an_output(capsys, tmp_path, character):
    """A name holding a control character cannot recolour the terminal or print a line of its own: an error quoting
    it shows it escaped, and an output name holding one is refused (the command prints the paths it wrote, one a
    line)."""
    folder = tmp_path / f"no{character}such[31mRED"
    line = _cli(capsys, "generate", "--model-dir", str(folder), "--out", str(tmp_path / "x.png"))
    assert line.startswith("error: --model-dir ") and "does not exist" in line, line
    assert character not in line
    assert all(ord(c) >= 0x20 and not 0x7F <= ord(c) < 0xA0 for c in line), repr(line)
    line = _cli(capsys, "generate", "--out", str(tmp_path / f"x{character}y.png"))
    assert line.startswith("error: --out ") and "holds a control character" in line, line
    assert "give a name without one" in line
    assert character not in line
    assert all(ord(c) >= 0x20 and not 0x7F <= ord(c) < 0xA0 for c in line), repr(line)
    assert _files(tmp_path) == []


def test_a_notice_quoting_a_name_shows_its_control_characters_escaped():
    import io

    from ernie_image.runtime.cli.console import Console, ConsoleHost

    stream = io.StringIO()
    ConsoleHost(console=Console(stream)).log("replaced a\x1b[2Jb\rc\x9bd\na table's next line")
    assert stream.getvalue() == "replaced a\\x1b[2Jb\\rc\\x9bd\na table's next line\n"


def _fifo(path: Path) -> Path:
    os.mkfifo(path)
    return path


def _file(path: Path) -> Path:
    path.write_bytes(b"x")
    return path


def test_an_output_that_cannot_be_written_is_refused_before_any_work(capsys, tmp_path, empty_cache):
    cases = {
        # folders nobody can create files in, root included, named for what they are
        "/proc/ernie.png": "--out /proc/ernie.png cannot be written: /proc is the kernel's proc file system, which "
                           "takes no files: pick a writable folder",
        "/sys/ernie.png": "/sys is the kernel's sysfs file system, which takes no files",
        str(tmp_path / "missing" / "x.png"): "the folder " + str(tmp_path / "missing") + " does not exist: create it",
        os.devnull: "is not a .png file name",
        str(tmp_path / ("b" * 252 + ".png")): "File name too long",  # 256 bytes
    }
    for out, expected in cases.items():
        assert expected in _cli(capsys, "generate", "--out", out), out
    batch = tmp_path / ("b" * 250 + ".png")  # fits alone, but not as a batch's name_63.png
    assert _cli(capsys, "generate", "--batch", "64", "--out", str(batch)) == (
        f"error: --out {batch} cannot be used: File name too long (a batch's _63.png): pick a shorter output path")
    assert not empty_cache.exists()


@pytest.mark.parametrize("batch", [1, 2])
def test_an_output_name_as_long_as_the_file_system_takes_is_written(capsys, tmp_path, tiny_turbo_folder, batch):
    """The hidden name it is written under first is cut to fit, with a hash of the whole name: the output's own
    name is not cut short by the hidden name's extra characters, and a batch's names need only their own room."""
    out = tmp_path / ("c" * (251 if batch == 1 else 249) + ".png")  # 255 bytes, or 253 + "_1"
    assert main(["generate", "--model-dir", str(tiny_turbo_folder), "--width", "256", "--height", "256", "--steps",
                 "1", "--batch", str(batch), "--out", str(out)]) == 0, capsys.readouterr().err
    assert _files(tmp_path) == [path.name for path in png_paths(out, batch)]


@pytest.mark.parametrize("argv, expected", [
    (["generate", "--seed", str(SEED_MASK + 1)], f"--seed {SEED_MASK + 1} is not allowed: use 0..{SEED_MASK}"),
    (["enhance", "--pe-url", "http://127.0.0.1:9", "--prompt", "x", "--seed", str(2**64)],
     f"--seed {2**64} is not allowed: use 0..{SEED_MASK}"),  # was sent on to the server
    (["enhance", "--pe-url", "http://127.0.0.1:9", "--prompt", "x", "--seed", "-1"], "--seed -1 is not allowed"),
    (["generate", "--budget", "nan"], "--budget 'nan' is not a number of GiB"),
    (["generate", "--budget", "0"], "--budget 0 is not a positive number of GiB up to 1e+06"),
    (["generate", "--steps", "1001"], "--steps 1001 is not allowed: use 1..1000"),
    (["generate", "--batch", "0"], "--batch 0 is not allowed: use 1..64"),
    (["generate", "--cfg", "inf"], "--cfg 'inf' is not a number: give a plain decimal"),
    (["generate", "--cfg", "101"], "--cfg 101.0 is not allowed: use 0..100"),
    (["check-remote", "http://127.0.0.1:9", "--connect-timeout", "nan"], "--connect-timeout 'nan' is not a number of seconds"),
    (["check-remote", "http://127.0.0.1:9", "--connect-timeout", "0"], "--connect-timeout 0 is not allowed"),
    (["check-remote", "http://127.0.0.1:9", "--read-timeout", "-5"], "--read-timeout -5 is not allowed"),
])
def test_numbers_out_of_range_are_refused_in_one_line(capsys, tmp_path, empty_cache, argv, expected):
    line = _cli(capsys, *argv, *(["--out", str(tmp_path / "x.png")] if argv[0] == "generate" else []))
    assert expected in line, line
    assert not empty_cache.exists()


def test_enhance_on_a_folder_without_an_enhancer_names_the_three_ways_to_give_one(capsys, tmp_path):
    """Not "turn the prompt enhancer off", the library's fix for a run that could go without it: this command is it."""
    line = _cli(capsys, "enhance", "--model-dir", str(tmp_path), "--prompt", "x")
    assert line.startswith(f"error: no prompt enhancer in --model-dir {tmp_path}: give a diffusers folder with pe/"), line
    assert "(--pe FILE)" in line and "(--pe-url URL)" in line and " off" not in line, line


def test_plan_refuses_a_copy_speed_of_zero_and_a_negative_token_count(capsys):
    assert "--pcie-gbps 0.0 is not allowed" in _cli(capsys, "plan", "--budget", "12", "--pcie-gbps", "0")  # was a
    assert "--text-tokens -5 is not allowed" in _cli(capsys, "plan", "--budget", "12", "--text-tokens", "-5")  # traceback


def test_cuda_asked_for_without_one_is_refused_before_the_demo_model_is_built(capsys, tmp_path, empty_cache):
    if torch.cuda.is_available():
        pytest.skip("this machine has a CUDA GPU")  # pragma: no cover
    line = _cli(capsys, "generate", "--device", "cuda", "--out", str(tmp_path / "x.png"))
    assert "--device cuda was asked for but PyTorch sees no CUDA GPU: choose cpu" in line and "damaged" not in line  # was "demo model damaged"
    assert not empty_cache.exists()


def test_a_budget_below_what_the_job_needs_is_refused_before_the_demo_model_is_built(capsys, tmp_path, empty_cache):
    line = _cli(capsys, "generate", "--budget", "0.001", "--out", str(tmp_path / "x.png"))
    assert line.startswith("error: a 256x256 batch-1 job (CFG 1, DiT fp32) needs at least 0.1 GiB of VRAM with "
                           "everything streamed; the budget is 0.001 GiB: raise the budget"), line  # no demo notice
    assert not empty_cache.exists() and not (tmp_path / "x.png").exists()


def test_the_demo_models_shapes_before_it_is_built_size_it_as_its_files_do(tmp_path):
    """The budget check before the demo model is built plans on its configs: the sizes its files give once built."""
    from ernie_image.runtime.demo.cached_model import demo_model_sources
    from ernie_image.runtime.demo.tiny import model_shapes
    from ernie_image.runtime.local.options import LoadOptions
    from ernie_image.runtime.local.pipe import LocalPipe

    sources = demo_model_sources("turbo", tmp_path)
    for options in (LoadOptions(device="cpu", vram_budget_gb=4), LoadOptions(device="cpu", dtype="bf16", quant="fp8")):
        memory = LocalPipe.load(sources, options).memory
        dit_config, text_config, vae_config, _ = model_shapes()
        assert memory.sizes_from_configs(dit_config, text_config, vae_config) == memory.sizes_for(sources, "turbo")


def test_a_batch_image_name_that_is_a_folder_is_refused_before_any_work(capsys, tmp_path, empty_cache):
    (tmp_path / "fox_1.png").mkdir()
    line = _cli(capsys, "generate", "--batch", "2", "--out", str(tmp_path / "fox.png"))
    assert "batch image " + str(tmp_path / "fox_1.png") + " is a folder" in line
    assert not empty_cache.exists()


def test_check_remote_advice_names_an_option_it_has(capsys):
    """A server that answers too slowly is told to raise the read timeout: check-remote has --read-timeout."""
    from ernie_image.runtime.cli.check_remote import main_check_remote

    with pytest.raises(SystemExit):
        main_check_remote(["--help"])
    assert "--read-timeout" in capsys.readouterr().out


def test_a_feature_adds_its_check_to_generate_in_one_place(capsys, tmp_path, monkeypatch, empty_cache):
    from ernie_image.runtime.cli import generate
    from ernie_image.runtime.core.errors import InvalidInputError

    seen = []

    def check_lora(args) -> None:
        seen.append(args.out)
        raise InvalidInputError("--lora x.safetensors does not exist: check the path")

    monkeypatch.setattr(generate, "FEATURE_CHECKS", (check_lora,))
    assert "--lora x.safetensors" in _cli(capsys, "generate", "--out", str(tmp_path / "x.png"))
    assert seen and not empty_cache.exists()  # run after the core checks, before the demo model
    assert "width 8 is not allowed" in _cli(capsys, "generate", "--width", "8", "--out", str(tmp_path / "x.png"))
    assert len(seen) == 1  # the core checks come first


# ------------------------------------------------------------------------------------------- quantize
@pytest.fixture(scope="module")
def bf16_dit(tmp_path_factory, tiny_turbo_folder) -> Path:
    return tiny_turbo_folder / "transformer"


def _quantize(capsys, *argv) -> tuple[int, str, str]:
    code = main(["quantize", *argv])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


@pytest.mark.parametrize("fmt, suffix", [("fp8", "safetensors"), ("nvfp4", "safetensors"), ("q8_0", "gguf")])
def test_quantize_refuses_an_already_quantised_input(capsys, tmp_path, bf16_dit, fmt, suffix):
    first = tmp_path / f"ernie-{fmt}.{suffix}"
    assert _quantize(capsys, "--dit", str(bf16_dit), "--format", fmt, "--out", str(first))[0] == 0
    for target, target_suffix in (("q8_0", "gguf"), ("fp8", "safetensors")):
        again = tmp_path / f"again-{target}.{target_suffix}"
        line = _cli(capsys, "quantize", "--dit", str(first), "--format", target, "--out", str(again))
        assert "already quantised" in line and "quantise from the bf16 DiT" in line, line
        assert not again.exists()


def test_quantize_refuses_a_gguf_renamed_to_safetensors(capsys, tmp_path, bf16_dit):
    gguf = tmp_path / "ernie-q8_0.gguf"
    assert _quantize(capsys, "--dit", str(bf16_dit), "--format", "q8_0", "--out", str(gguf))[0] == 0
    disguised = tmp_path / "ernie.safetensors"
    gguf.rename(disguised)
    line = _cli(capsys, "quantize", "--dit", str(disguised), "--format", "fp8", "--out", str(tmp_path / "o.safetensors"))
    assert "is a GGUF file, already quantised" in line


def test_quantize_refuses_an_out_that_is_the_file_it_reads(capsys, tmp_path, bf16_dit):
    import shutil

    folder = tmp_path / "transformer"
    shutil.copytree(bf16_dit, folder)
    weights = next(folder.glob("*.safetensors"))
    before = weights.read_bytes()
    line = _cli(capsys, "quantize", "--dit", str(weights), "--format", "fp8", "--out", str(weights))
    assert line == (f"error: --out {weights} is the file --dit {weights} reads: writing it would replace that "
                    "input; give another --out")
    twin = tmp_path / "twin.safetensors"
    os.link(weights, twin)
    line = _cli(capsys, "quantize", "--dit", str(twin), "--format", "fp8", "--out", str(weights))
    assert f"is the file --dit {twin} reads" in line
    assert weights.read_bytes() == before


def test_quantize_reports_what_it_packed_and_refuses_when_nothing_packs(capsys, tmp_path, bf16_dit):
    code, out, _ = _quantize(capsys, "--dit", str(bf16_dit), "--format", "q8_0", "--out", str(tmp_path / "q.gguf"))
    assert code == 0 and "weight matrices as q8_0" in out and ", 2 kept in high precision" in out, out
    line = _cli(capsys, "quantize", "--dit", str(bf16_dit), "--format", "q4_k", "--out", str(tmp_path / "q4.gguf"))
    assert "can be packed as q4_k (it needs in_features divisible by 256)" in line  # was "wrote (q4_k)"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["q.gguf"]


def test_quantize_checks_the_output_before_reading_the_input(capsys, tmp_path):
    line = _cli(capsys, "quantize", "--dit", str(tmp_path / "missing"), "--format", "fp8",
                "--out", str(tmp_path / "no-folder" / "q.safetensors"))
    assert "no-folder does not exist: create it first" in line
    assert "cannot be written: /proc" in _cli(capsys, "quantize", "--dit", str(tmp_path / "missing"),
                                               "--format", "fp8", "--out", "/proc/q.safetensors")
    assert "is a folder" in _cli(capsys, "quantize", "--dit", str(tmp_path / "missing"), "--format", "q8_0",
                                 "--out", str(_folder(tmp_path / "q.gguf")))


def _folder(path: Path) -> Path:
    path.mkdir()
    return path


@pytest.mark.parametrize("umask, mode", [(0o022, 0o644), (0o002, 0o664)])
def test_quantize_and_generate_both_replace_an_existing_file_with_normal_permissions(capsys, tmp_path, bf16_dit,
                                                                                     tiny_turbo_folder, umask, mode):
    """Every format quantize writes and the PNGs get the mode a new file gets under the umask (safetensors' writer
    made the fp8 and nvfp4 files 0600). quantize replaces only an earlier quantised DiT: each is written twice."""
    old_umask = os.umask(umask)
    try:
        outs = [tmp_path / "q.gguf", tmp_path / "fp8.safetensors", tmp_path / "nvfp4.safetensors"]
        for out, fmt in zip(outs, ("q8_0", "fp8", "nvfp4")):
            for _ in range(2):
                assert _quantize(capsys, "--dit", str(bf16_dit), "--format", fmt, "--out", str(out))[0] == 0
        png = tmp_path / "x.png"
        png.write_bytes(b"old")
        assert main(["generate", "--model-dir", str(tiny_turbo_folder), "--width", "256", "--height", "256",
                     "--steps", "1", "--out", str(png)]) == 0
    finally:
        os.umask(old_umask)
    assert png.read_bytes() != b"old"
    for path in (*outs, png):
        assert stat.S_IMODE(path.stat().st_mode) == mode, path
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(p.name for p in (*outs, png))  # no partial files


# ------------------------------------------------------------------------------------- non-finite DiT output
def test_a_dit_that_gives_nan_is_one_line_naming_the_file_not_a_black_image(capsys, tmp_path, tiny_turbo_folder):
    broken = tmp_path / "ernie-image-turbo-broken.safetensors"
    state = load_file(str(tiny_turbo_folder / "transformer" / "diffusion_pytorch_model.safetensors"))
    state["final_linear.weight"] = torch.full_like(state["final_linear.weight"], float("nan"))
    save_file(state, str(broken))
    out = tmp_path / "x.png"
    line = _cli(capsys, "generate", "--model-dir", str(tiny_turbo_folder), "--dit", str(broken), "--steps", "1",
                "--width", "256", "--height", "256", "--out", str(out))
    assert "the DiT produced" in line and "non-finite latent values (NaN/inf)" in line and str(broken) in line
    assert "damaged or mis-quantised" in line
    assert not out.exists()


# ------------------------------------------------------------------------------------ what a run reports
def test_the_summary_and_the_metadata_hold_the_settings_the_run_used(capsys, tmp_path, tiny_turbo_folder):
    from ernie_image.runtime.files.png_output import read_png_settings

    out = tmp_path / "x.png"
    assert main(["generate", "--model-dir", str(tiny_turbo_folder), "--width", "256", "--height", "272",
                 "--out", str(out)]) == 0
    err = capsys.readouterr().err
    assert "1 image 256x272, 8 steps, CFG 1, seed 0 in" in err, err  # Turbo's defaults, the size given
    settings = read_png_settings(out)
    assert (settings["width"], settings["height"], settings["steps"], settings["cfg"]) == (256, 272, 8, 1.0)
    assert (settings["dit_weights"], settings["dtype"]) == ("float32", "float32"), settings  # what made the pixels


def another_command_writes_while_it_generates(out: Path, pipe_class: type, monkeypatch) -> Callable:
    """`pipe_class.generate` made to write `out` as another command would, once the images are made; returns the
    original."""
    generate = pipe_class.generate

    def generate_then_another_command_writes(self, request, host):
        result = generate(self, request, host)
        out.write_bytes(b"another command's image")
        return result

    monkeypatch.setattr(pipe_class, "generate", generate_then_another_command_writes)
    return generate


def another_command_writes_while_its_pngs_are_written(out: Path, monkeypatch) -> Callable[[], None]:
    """The PNG encoder made to write `out` as another command would, while it writes this command's first file;
    returns what puts the encoder back."""
    from PIL import Image

    save = Image.Image.save
    written = []

    def save_while_another_command_writes(image, handle, *args, **kwargs):
        save(image, handle, *args, **kwargs)
        if not written:
            out.write_bytes(b"another command's image")
            written.append(out)

    monkeypatch.setattr(Image.Image, "save", save_while_another_command_writes)
    return lambda: monkeypatch.setattr(Image.Image, "save", save)


def another_command_writes(when: str, out: Path, pipe_class: type, monkeypatch) -> Callable[[], None]:
    """`out` written as another command would `when` this one has made its images or writes them; returns what
    stops it."""
    if when == "while its PNGs are written":
        return another_command_writes_while_its_pngs_are_written(out, monkeypatch)
    generate = another_command_writes_while_it_generates(out, pipe_class, monkeypatch)
    return lambda: monkeypatch.setattr(pipe_class, "generate", generate)


ANOTHER_COMMAND_WRITES = ["once the images are made", "while its PNGs are written"]


@pytest.mark.parametrize("when", ANOTHER_COMMAND_WRITES)
@pytest.mark.parametrize("before", ["absent", "present"])
def test_an_output_another_command_wrote_during_the_run_is_replaced_with_a_notice(capsys, tmp_path, tiny_turbo_folder,
                                                                                   monkeypatch, before, when):
    """Two commands given one --out: the one ending last wins, and says it replaced the other's file, also where the
    other ended while this one wrote its PNGs; a file that was there before the run is replaced as usual, without
    the notice."""
    from ernie_image.runtime.files.png_output import read_png_settings
    from ernie_image.runtime.local.pipe import LocalPipe

    out = tmp_path / "x.png"
    if before == "present":
        out.write_bytes(b"an earlier image")
    stop = another_command_writes(when, out, LocalPipe, monkeypatch)
    argv = ["generate", "--model-dir", str(tiny_turbo_folder), "--width", "256", "--height", "256", "--steps", "1",
            "--out", str(out)]
    assert main(argv) == 0
    err = capsys.readouterr().err
    assert f"{out} changed while this command ran (another command writing the same output?): this command's files " \
           "replace it; give each command its own output to keep both" in err, err
    assert read_png_settings(out)["steps"] == 1  # this run's image

    stop()
    assert main(argv) == 0
    assert "changed while this command ran" not in capsys.readouterr().err


def test_the_plan_printed_after_a_run_is_the_plan_of_the_job_that_ran(capsys, tmp_path, tiny_turbo_folder):
    """With a budget (the planner runs, on the CPU too) the run's own size and batch, not a default 1024x1024 job."""
    assert main(["generate", "--model-dir", str(tiny_turbo_folder), "--budget", "4", "--width", "256", "--height",
                 "272", "--batch", "2", "--steps", "1", "--out", str(tmp_path / "x.png")]) == 0
    err = capsys.readouterr().err
    assert "VRAM plan: budget 4.00 GiB on cpu; 256x272, batch 2, CFG 1" in err, err
    assert "1024x1024" not in err


def test_a_prompt_longer_than_the_text_encoder_takes_is_cut_with_a_notice(capsys, tmp_path, tiny_turbo_folder):
    long_prompt = "a red fox in fresh snow, " * 200  # 5,000 characters, one token each in the tiny tokenizer
    assert main(["generate", "--model-dir", str(tiny_turbo_folder), "--width", "256", "--height", "256",
                 "--steps", "1", "--prompt", long_prompt, "--out", str(tmp_path / "x.png")]) == 0
    err = capsys.readouterr().err
    assert "prompt of 5001 tokens cut to the text encoder's 2048" in err, err


@pytest.mark.parametrize("layout", ["diffusers", "comfy"])
def test_a_long_prompt_gets_the_packs_cut_notice_without_transformers_indexing_warning(capfd, tmp_path, layout):
    """transformers printed "Token indices sequence length is longer ... indexing errors" (on the process's stderr,
    whatever sys.stderr is) before the notice: the prompt is cut, so it says nothing true. Both tokenizer forms."""
    from ernie_image.runtime.demo.tiny import build_tiny_model

    sources = build_tiny_model(tmp_path / "model", layout=layout, variant="turbo")
    files = (["--model-dir", str(sources.model_dir)] if layout == "diffusers" else
             ["--dit", str(sources.dit), "--text-encoder", str(sources.text_encoder), "--vae", str(sources.vae)])
    assert main(["generate", *files, "--width", "256", "--height", "256", "--steps", "1",
                 "--prompt", "a red fox in fresh snow, " * 200, "--out", str(tmp_path / "x.png")]) == 0
    err = capfd.readouterr().err
    assert "prompt of 5001 tokens cut to the text encoder's 2048" in err, err
    assert "Token indices sequence length" not in err and "indexing errors" not in err, err


def test_a_negative_prompt_at_cfg_1_runs_with_a_notice_that_it_has_no_effect(capsys, tmp_path, tiny_turbo_folder):
    base = ["generate", "--model-dir", str(tiny_turbo_folder), "--width", "256", "--height", "256", "--steps", "1",
            "--negative", "blurry", "--out", str(tmp_path / "x.png")]
    assert main(base) == 0  # Turbo's CFG 1
    notice = ("the negative prompt has no effect at CFG 1 (only above CFG 1, e.g. ERNIE-Image's 4.0): raise CFG for "
              "it to act, or leave it out")
    assert notice in capsys.readouterr().err.splitlines()
    assert main([*base, "--cfg", "2"]) == 0
    assert "has no effect" not in capsys.readouterr().err
    assert main([*base[:-4], "--out", str(tmp_path / "x.png")]) == 0  # no negative prompt: nothing to say
    assert "negative prompt" not in capsys.readouterr().err


def test_the_python_api_tells_its_host_of_a_negative_prompt_at_cfg_1(tiny_turbo_folder):
    from ernie_image.runtime.core.host import NullHost
    from ernie_image.runtime.core.request import GenerationRequest
    from ernie_image.runtime.formats.sources import ModelSources
    from ernie_image.runtime.local.options import LoadOptions
    from ernie_image.runtime.local.pipe import LocalPipe

    pipe = LocalPipe.load(ModelSources(model_dir=tiny_turbo_folder), LoadOptions(device="cpu"))
    host = NullHost()
    pipe.generate(GenerationRequest(prompt="a fox", negative_prompt="blurry", width=256, height=256, steps=1), host)
    assert [m for m in host.messages if "negative prompt" in m] == [
        "the negative prompt has no effect at CFG 1 (only above CFG 1, e.g. ERNIE-Image's 4.0): raise CFG for it to "
        "act, or leave it out"]


def test_a_left_out_prompt_runs_the_example_prompt_with_a_notice(capsys, tmp_path, tiny_turbo_folder):
    from ernie_image.runtime.files.png_output import read_png_settings

    out = tmp_path / "x.png"
    assert main(["generate", "--model-dir", str(tiny_turbo_folder), "--width", "256", "--height", "256", "--steps",
                 "1", "--out", str(out)]) == 0
    assert "no --prompt given: the example prompt 'a red fox in fresh snow, morning light' is used" in \
        capsys.readouterr().err
    assert read_png_settings(out)["prompt"] == "a red fox in fresh snow, morning light"


def test_an_empty_prompt_runs_with_a_notice(capsys, tmp_path, tiny_turbo_folder):
    assert main(["generate", "--model-dir", str(tiny_turbo_folder), "--width", "256", "--height", "256",
                 "--steps", "1", "--prompt", "  ", "--out", str(tmp_path / "x.png")]) == 0
    assert "the prompt is empty: the image follows no text" in capsys.readouterr().err


def test_a_damaged_demo_cache_names_its_folder_and_the_fix(capsys, tmp_path, empty_cache):
    assert main(["generate", "--steps", "1", "--out", str(tmp_path / "a.png")]) == 0
    capsys.readouterr()
    folder = empty_cache / "tiny-turbo-v1"
    vae = folder / "vae" / "diffusion_pytorch_model.safetensors"
    vae.write_bytes(vae.read_bytes()[:-1000])  # a disk that filled up, an interrupted copy
    line = _cli(capsys, "generate", "--steps", "1", "--out", str(tmp_path / "b.png"))
    assert f"the demo model in {folder} is damaged" in line and "delete that folder and run again" in line, line


@pytest.mark.parametrize("images, steps, said", [(1, 1, "1 image 256x256, 1 step, CFG 1, seed 0 in 0.50 s"),
                                                 (2, 2, "2 images 256x256, 2 steps, CFG 1, seed 0 in 0.50 s"),
                                                 (1, 8, "1 image 256x256, 8 steps, CFG 1, seed 0 in 0.50 s")])
def test_the_run_line_counts_images_and_steps_in_words_that_read_right(images, steps, said):
    from ernie_image.runtime.cli.generate import run_line
    from ernie_image.runtime.core.request import GenerationRequest

    used = GenerationRequest(prompt="a fox", width=256, height=256, steps=steps, cfg=1.0, batch=images)
    assert run_line(images, used, 0.5) == said


# ---------------------------------------------------------------------------------------------- help
def test_top_level_help_is_on_stdout_with_exit_0(capsys):
    assert main(["--help"]) == 0
    captured = capsys.readouterr()
    assert captured.out.startswith("usage: ernie-image COMMAND") and captured.err == ""
    assert "quantize      write a quantised DiT file (fp8, nvfp4, q8_0, q4_k) once" in captured.out
    assert main([]) == 2 and "usage:" in capsys.readouterr().err


def test_help_lists_exactly_the_formats_the_commands_accept(capsys):
    from ernie_image.runtime.local.options import QUANT_CHOICES
    from ernie_image.runtime.quant.writer import WRITE_FORMATS

    assert main(["generate", "--help"]) == 0
    assert "--quant {" + ",".join(QUANT_CHOICES) + "}" in capsys.readouterr().out
    assert main(["quantize", "--help"]) == 0
    assert "--format {" + ",".join(WRITE_FORMATS) + "}" in capsys.readouterr().out


def test_an_in_process_call_gives_back_the_signal_handlers_it_found(capsys, tmp_path, tiny_turbo_folder, bf16_dit):
    """main(argv) from Python: after a command that wrote files (the commit hook ignores SIGINT and SIGTERM from the
    first rename) or one that failed, Ctrl-C works in the caller again (it was left ignored)."""
    def on_int(number, frame) -> None:
        raise KeyboardInterrupt

    def on_term(number, frame) -> None:
        raise SystemExit(143)

    before = signal.signal(signal.SIGINT, on_int), signal.signal(signal.SIGTERM, on_term), sys.unraisablehook
    try:
        runs = [(["generate", "--model-dir", str(tiny_turbo_folder), "--width", "256", "--height", "256", "--steps",
                  "1", "--out", str(tmp_path / "x.png")], 0),
                (["quantize", "--dit", str(bf16_dit), "--format", "q8_0", "--out", str(tmp_path / "q.gguf")], 0),
                (["generate", "--width", "100", "--out", str(tmp_path / "y.png")], 2)]
        for argv, code in runs:
            assert main(argv) == code
            assert signal.getsignal(signal.SIGINT) is on_int and signal.getsignal(signal.SIGTERM) is on_term, argv
            assert sys.unraisablehook is before[2]
    finally:
        signal.signal(signal.SIGINT, before[0])
        signal.signal(signal.SIGTERM, before[1])
    assert (tmp_path / "x.png").exists() and (tmp_path / "q.gguf").exists()


def test_the_commit_hook_runs_once_before_the_first_rename(tmp_path):
    from ernie_image.runtime.files.output_files import atomic_outputs, set_commit_hook

    seen: list[list[str]] = []
    targets = [tmp_path / "a.txt", tmp_path / "b.txt"]
    set_commit_hook(lambda: seen.append(sorted(p.name for p in tmp_path.iterdir() if not p.name.startswith("."))))
    try:
        with atomic_outputs(targets) as partials:
            for partial in partials:
                partial.write_text("x")
    finally:
        set_commit_hook(None)
    assert seen == [[]] and all(target.exists() for target in targets)


# --------------------------------------------------------------------- as a separate process: signals, races
def _env(cache: Path) -> dict[str, str]:
    package_root = cache.parent / "site"
    package_root.mkdir(exist_ok=True)
    link = package_root / "ernie_image"
    if not link.exists():
        link.symlink_to(REPO_ROOT, target_is_directory=True)  # `python -m ernie_image` runs this checkout
    return {**os.environ, "PYTHONPATH": str(package_root), "ERNIE_IMAGE_CACHE": str(cache),
            "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}


MODULE_ENTRY = ("-m", "ernie_image")
# What the `ernie-image` script pip installs runs (pyproject.toml's [project.scripts]).
SCRIPT_ENTRY = ("-c", "import sys; from ernie_image.runtime.cli import main; sys.exit(main())")


class _Run:
    """`python -m ernie_image ...` (or the installed script's `entry`) with its stderr collected as it arrives."""

    def __init__(self, argv: list[str], env: dict[str, str], cwd: Path, entry: tuple[str, ...] = MODULE_ENTRY) -> None:
        self.process = subprocess.Popen([sys.executable, *entry, *argv], env=env, cwd=cwd,
                                        stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        self.err = b""
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self) -> None:
        while chunk := self.process.stderr.read1(4096):
            self.err += chunk

    def wait_for(self, text: bytes, timeout: float = 120) -> None:
        """Until the run has written `text` to stderr (failing at once if it ended without)."""
        def written() -> bool:
            assert text in self.err or self.process.poll() is None, self.err.decode()
            return text in self.err

        wait_until(written, timeout, what=lambda: f"{text!r} on stderr: {self.err.decode()}")

    def finish(self, timeout: float = 60) -> tuple[int, list[str]]:
        code = self.process.wait(timeout)
        self.reader.join(5)
        return code, self.err.decode().replace("\r", "\n").strip().splitlines()


@pytest.fixture(scope="module")
def built_cache(tmp_path_factory) -> Path:
    """A demo cache already built, so a run starts sampling within seconds."""
    cache = tmp_path_factory.mktemp("signals") / "cache"
    run = _Run(["generate", "--steps", "1", "--out", str(cache.parent / "warm.png")], _env(cache), cache.parent)
    assert run.finish(180)[0] == 0
    (cache.parent / "warm.png").unlink()
    return cache


def _assert_cancelled(code: int, lines: list[str], out_dir: Path) -> None:
    assert code == 130, lines
    assert lines and lines[-1] == "cancelled", lines
    assert not any("Traceback" in line or "KeyboardInterrupt" in line for line in lines), lines
    assert list(out_dir.iterdir()) == [], list(out_dir.iterdir())  # no PNG, no partial file


@pytest.mark.slow
@pytest.mark.parametrize("moment", [b"ernie_image.runtime.core.errors\n", b"torch.nn\n", b"ernie_image.runtime.local.pipe\n"],
                         ids=["importing the CLI", "importing torch", "loading the model"])
def test_ctrl_c_while_starting_is_cancelled_with_nothing_written(tmp_path, built_cache, moment):
    """SIGINT sent as the interpreter reports an import done (-X importtime), at three moments of the start."""
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    env = {**_env(built_cache), "PYTHONPROFILEIMPORTTIME": "1"}
    run = _Run(["generate", "--out", str(out_dir / "x.png")], env, tmp_path)
    run.wait_for(moment)
    run.process.send_signal(signal.SIGINT)
    code, lines = run.finish()
    _assert_cancelled(code, [line for line in lines if not line.startswith("import time:")], out_dir)


@pytest.mark.slow
@pytest.mark.parametrize("entry", [MODULE_ENTRY, SCRIPT_ENTRY], ids=["python -m ernie_image", "ernie-image script"])
def test_ctrl_c_while_sampling_ends_the_process_within_a_second_with_nothing_written(tmp_path, built_cache, entry):
    """The process ends, not only the run: the interpreter's teardown, collecting a loaded model's objects, took
    another second after `cancelled` where the installed script returned from main()."""
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    run = _Run(["generate", "--steps", "1000", "--out", str(out_dir / "x.png")], _env(built_cache), tmp_path, entry)
    run.wait_for(b"sampling: step 1/1000")
    pressed = time.monotonic()
    run.process.send_signal(signal.SIGINT)
    code, lines = run.finish()
    assert time.monotonic() - pressed < 1.0
    _assert_cancelled(code, lines, out_dir)


def _ctrl_c_after(function, when=lambda *args: True):
    """`function`, then a real SIGINT to this process when `when(*its arguments)` holds."""
    def wrapper(*args, **kwargs):
        result = function(*args, **kwargs)
        if when(*args):
            os.kill(os.getpid(), signal.SIGINT)
        return result

    return wrapper


def _ctrl_c_before(function, when):
    def wrapper(*args, **kwargs):
        if when(*args):
            os.kill(os.getpid(), signal.SIGINT)
        return function(*args, **kwargs)

    return wrapper


def _at_the_write_check(monkeypatch):  # the output folder's scratch file has just been made
    monkeypatch.setattr(os, "open", _ctrl_c_after(os.open, lambda path, *_: str(path).endswith(".check")))


def _as_the_png_is_written(monkeypatch):  # the new PNG's partial file is complete, not yet renamed
    from PIL import Image

    monkeypatch.setattr(Image.Image, "save", _ctrl_c_after(Image.Image.save))


def _as_the_png_is_written_and_again_as_it_is_removed(monkeypatch):
    _as_the_png_is_written(monkeypatch)
    monkeypatch.setattr(Path, "unlink", _ctrl_c_before(Path.unlink, lambda path, *_: path.name.endswith(".partial")))


def _as_the_new_png_replaces_the_old(monkeypatch):  # complete: from here the run no longer takes a cancel
    from ernie_image.runtime.cli.interrupts import Interrupts

    monkeypatch.setattr(Interrupts, "outputs_written", _ctrl_c_after(Interrupts.outputs_written))


@pytest.mark.slow
@pytest.mark.parametrize("moment, cancelled", [(_at_the_write_check, True), (_as_the_png_is_written, True),
                                               (_as_the_png_is_written_and_again_as_it_is_removed, True),
                                               (_as_the_new_png_replaces_the_old, False)],
                         ids=lambda value: value.__name__.strip("_") if callable(value) else None)
def test_ctrl_c_as_the_png_is_written_is_a_clean_cancel_or_too_late_never_half_of_each(
        capsys, monkeypatch, tmp_path, built_cache, moment, cancelled):
    """A real SIGINT at each moment of writing the PNG: before the new file is complete the run is cancelled, the
    older file it would replace is untouched and no scratch or partial file is left; once it is complete the new
    file stands and the run exits 0 as if no key was pressed."""
    monkeypatch.setenv("ERNIE_IMAGE_CACHE", str(built_cache))
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    png = out_dir / "x.png"
    png.write_bytes(b"OLDFILE")
    moment(monkeypatch)
    code = main(["generate", "--steps", "1", "--device", "cpu", "--out", str(png)])
    monkeypatch.undo()
    lines = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert list(out_dir.iterdir()) == [png]  # no scratch or partial file either way
    if cancelled:
        assert code == 130 and lines[-1] == "cancelled" and png.read_bytes() == b"OLDFILE", (code, lines)
    else:
        assert code == 0 and png.read_bytes().startswith(b"\x89PNG") and "cancelled" not in lines, (code, lines)


@pytest.mark.slow
def test_ctrl_c_while_the_demo_model_is_built_leaves_no_half_built_cache(tmp_path):
    cache = tmp_path / "cache"
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    run = _Run(["generate", "--out", str(out_dir / "x.png")], _env(cache), tmp_path)
    wait_until(lambda: any(cache.glob(".tiny-turbo-v1.*.partial/transformer")), 60, poll_s=0.01,
               what=lambda: f"the demo build writing its DiT: {run.err.decode()}")  # the build is under way
    run.process.send_signal(signal.SIGINT)
    _assert_cancelled(*run.finish(), out_dir)
    assert list(cache.iterdir()) == []  # neither the model nor its partial build


@pytest.mark.slow
def test_sigterm_is_a_cancel_too(tmp_path, built_cache):
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    run = _Run(["generate", "--steps", "1000", "--out", str(out_dir / "x.png")], _env(built_cache), tmp_path)
    run.wait_for(b"sampling: step 1/1000")
    run.process.send_signal(signal.SIGTERM)
    code, lines = run.finish()
    assert code == 143 and lines[-1] == "cancelled" and list(out_dir.iterdir()) == []


@pytest.mark.slow
def test_two_first_runs_at_once_share_the_demo_cache_and_the_out_and_leave_one_whole_image(tmp_path):
    from ernie_image.runtime.files.png_output import read_png_settings

    cache = tmp_path / "cache"  # empty: both runs build the demo model at the same time
    out = tmp_path / "shared ñ 狐.png"  # unicode and a space in the name, too
    runs = [_Run(["generate", "--steps", "20", "--seed", str(seed), "--out", str(out)], _env(cache), tmp_path)
            for seed in (1, 2)]
    results = [run.finish(240) for run in runs]
    assert [code for code, _ in results] == [0, 0], results
    assert read_png_settings(out)["seed"] in (1, 2)  # a whole PNG from one of the runs
    assert sorted(p.name for p in tmp_path.iterdir() if not p.is_dir()) == [out.name]
    assert [p.name for p in cache.iterdir()] == ["tiny-turbo-v1"]  # one model, no partial build left


# ------------------------------------------------------------- settings named as the CLI names them
@pytest.mark.parametrize("argv, cli_line", [
    (["--width", "300"], "error: --width 300 is not allowed: ERNIE-Image needs a multiple of 16 between 256 and "
                         "4096; use 304"),
    (["--height", "5000"], "error: --height 5000 is not allowed"),
    (["--width", "300", "--height", "5000"], "error: --width 300 and --height 5000 are not allowed: ERNIE-Image needs "
                                             "multiples of 16 between 256 and 4096; use 304x4096"),
    (["--quant", "int3"], "error: --quant 'int3' is not supported: use one of none, auto"),
    (["--device", "tpu"], "error: --device 'tpu' is not supported: use auto, cpu, cuda or cuda:N"),
    (["--denoise", "0.5"], "error: --denoise 0.5 needs --init-image"),
])
def test_errors_name_the_cli_flags(capsys, empty_cache, tmp_path, argv, cli_line):
    line = _cli(capsys, "generate", "--out", str(tmp_path / "x.png"), *argv)
    assert line.startswith(cli_line), line
    assert not empty_cache.exists()


def test_the_python_api_keeps_its_field_names_and_the_cli_shows_flags_from_the_same_error(tmp_path):
    """One check, two vocabularies: the request names mask_grow (the API's and the node's word), the CLI --mask-grow."""
    from ernie_image.runtime.cli.names import cli_message
    from ernie_image.runtime.core.errors import InvalidInputError
    from ernie_image.runtime.core.request import GenerationRequest

    image, mask = torch.zeros(1, 256, 256, 3), torch.ones(1, 256, 256)
    with pytest.raises(InvalidInputError) as caught:
        GenerationRequest(prompt="", width=256, height=256, init_image=image, mask=mask, mask_grow=5000).validate()
    assert str(caught.value) == "mask_grow 5000 is not allowed: use 0..1024 pixels"
    assert cli_message(caught.value) == "--mask-grow 5000 is not allowed: use 0..1024 pixels"
    with pytest.raises(InvalidInputError) as caught:
        GenerationRequest(prompt="a \udcff fox").validate()
    assert cli_message(caught.value).startswith("--prompt is not valid UTF-8 text")
    assert cli_message(caught.value).endswith("save the prompt as UTF-8"), "prose after the name stays prose"


def test_a_prompt_that_is_not_utf8_is_refused_before_the_demo_model_is_built(capsys, empty_cache, tmp_path):
    undecodable = b"a fox \xff".decode("utf-8", "surrogateescape")
    line = _cli(capsys, "generate", "--prompt", undecodable, "--out", str(tmp_path / "x.png"))
    assert line.startswith("error: --prompt is not valid UTF-8 text")  # the one line: no demo notice before it
    assert not empty_cache.exists()


# ---------------------------------------------------------------------- flags that need another, or exclude one
@pytest.mark.parametrize("argv, expected", [
    (["generate", "--lora-mode", "branch"],
     "error: --lora-mode branch says how LoRAs run: give --lora PATH too, or leave it out"),
    (["generate", "--lora-mode", "merge"],  # the default's name given without a LoRA: refused the same way
     "error: --lora-mode merge says how LoRAs run: give --lora PATH too, or leave it out"),
    (["generate", "--no-composite"],
     "error: --no-composite keeps the sampler's pixels outside a mask: give --init-image and --mask too, or leave "
     "it out"),
    (["generate", "--server", "http://127.0.0.1:9", "--api-key-env", "HOME", "--api-key-file", "{key}"],
     "error: --api-key-env and --api-key-file both name the API key: give one of them"),
    (["generate", "--pe-url", "http://127.0.0.1:9", "--use-pe", "--pe-api-key-env", "HOME", "--pe-api-key-file",
      "{key}"],
     "error: --pe-api-key-env and --pe-api-key-file both name the API key: give one of them"),
    (["check-remote", "http://127.0.0.1:9", "--api-key-env", "HOME", "--api-key-file", "{key}"],
     "error: --api-key-env and --api-key-file both name the API key: give one of them"),
], ids=["lora-mode without lora", "lora-mode merge without lora", "no-composite without mask", "both server key sources", "both PE key sources",
        "check-remote: both key sources"])
def test_flags_that_cannot_work_together_are_refused_in_one_line_before_any_work(capsys, tmp_path, empty_cache,
                                                                                 argv, expected):
    key = tmp_path / "key.txt"
    key.write_text("sk-never-shown-3141\n")
    argv = [arg.format(key=key) for arg in argv]
    line = _cli(capsys, *argv, *(["--out", str(tmp_path / "x.png")] if argv[0] == "generate" else []))
    assert line == expected
    assert "sk-never" not in line and not empty_cache.exists() and not (tmp_path / "x.png").exists()


# ------------------------------------------------------------------------------ messages name what was given
def test_a_cuda_device_without_a_gpu_is_named_as_given(capsys, tmp_path, empty_cache):
    if torch.cuda.is_available():
        pytest.skip("this machine has a CUDA GPU")  # pragma: no cover
    line = _cli(capsys, "generate", "--device", "cuda:7", "--out", str(tmp_path / "x.png"))
    assert line == "error: --device cuda:7 was asked for but PyTorch sees no CUDA GPU: choose cpu"
    assert not empty_cache.exists()


@pytest.mark.parametrize("extra, expected", [
    (["--lora", "{lora}"], "error: --lora runs on the local model only: the SGLang backend takes no LoRA; leave out "
                           "--server or --lora"),
    (["--init-image", "{image}"], "error: --init-image runs on the local model only: the SGLang backend takes no "
                                  "init image; leave out --server or --init-image"),
    (["--lora", "{lora}", "--init-image", "{image}"],
     "error: --lora and --init-image run on the local model only: the SGLang backend takes neither; leave out "
     "--server, or leave out both"),
], ids=["lora", "init image", "both"])
def test_local_only_inputs_with_a_server_are_one_clear_line(capsys, tmp_path, empty_cache, extra, expected):
    from PIL import Image

    image = tmp_path / "in.png"
    Image.new("RGB", (256, 256), (20, 40, 60)).save(image)
    missing_lora = tmp_path / "style.safetensors"  # refused for --server before the file is looked at
    argv = [arg.format(lora=missing_lora, image=image) for arg in extra]
    line = _cli(capsys, "generate", "--server", "http://127.0.0.1:9", *argv, "--out", str(tmp_path / "x.png"))
    assert line == expected


@pytest.mark.parametrize("value", ["nokey.txt", "keys/api.key"])
def test_a_missing_key_file_is_shown_as_the_path_it_is(capsys, tmp_path, monkeypatch, value):
    monkeypatch.chdir(tmp_path)
    line = _cli(capsys, "generate", "--server", "http://127.0.0.1:9", "--api-key-file", value,
                "--out", str(tmp_path / "x.png"))
    assert line == f"error: --api-key-file {value} is not a file: give the path of a file holding only the key"


@pytest.mark.parametrize("value", ["", " "])
def test_an_empty_out_says_it_is_empty(capsys, tmp_path, empty_cache, value):
    assert _cli(capsys, "generate", f"--out={value}") == "error: --out is empty: give a .png path"
    assert not empty_cache.exists()


@pytest.mark.parametrize("dit", ["the folder", "its weights file"])
@pytest.mark.parametrize("out, place", [("fp8.safetensors", "is inside the --dit folder {folder}"),
                                        ("", "is the --dit folder")],
                         ids=["a new file there", "the folder itself"])
def test_quantize_refuses_an_out_inside_the_model_folder_dit_loads_from(capsys, tmp_path, bf16_dit, dit, out, place):
    """Whether --dit names a diffusers transformer folder or the weights file in it (beside its config.json), a
    quantised file written there would make the folder two models; a folder given as --out is refused as that, not
    sent to a file name inside it."""
    import shutil

    folder = tmp_path / "transformer"
    shutil.copytree(bf16_dit, folder)
    source = folder if dit == "the folder" else folder / "diffusion_pytorch_model.safetensors"
    line = _cli(capsys, "quantize", "--dit", str(source), "--format", "fp8", "--out", str(folder / out))
    assert line == (f"error: --out {folder / out} {place.format(folder=folder)}: a quantised file there would stop the "
                    "folder loading as the bf16 model; write it elsewhere")
    assert _files(folder) == ["config.json", "diffusion_pytorch_model.safetensors"]


@pytest.mark.parametrize("part, name", [("text_encoder", "model.safetensors"), ("vae", "fp8.safetensors"),
                                        ("tokenizer", "fp8.safetensors")])
def test_quantize_refuses_an_out_inside_another_part_of_the_model(capsys, tmp_path, tiny_turbo_folder, part, name):
    """The text encoder's folder beside the transformer is a model folder too: a quantised DiT there would replace
    its weights (model.safetensors) or join them."""
    import shutil

    model = Path(shutil.copytree(tiny_turbo_folder, tmp_path / "model"))
    before = {path: path.read_bytes() for path in (model / part).iterdir()}
    out = model / part / name
    line = _cli(capsys, "quantize", "--dit", str(model / "transformer"), "--format", "fp8", "--out", str(out))
    assert line == (f"error: --out {out} is inside the model folder {model / part}: a quantised file there would "
                    "replace or join the files of the model it holds; write it elsewhere")
    assert {path: path.read_bytes() for path in (model / part).iterdir()} == before


def _lora_file(path: Path) -> Path:
    from safetensors.torch import save_file

    save_file({"diffusion_model.layers.0.mlp.linear_fc2.lora_A.weight": torch.ones(2, 8),
               "diffusion_model.layers.0.mlp.linear_fc2.lora_B.weight": torch.ones(8, 2)}, str(path))
    return path


@pytest.mark.parametrize("part, held", [
    ("a file of other tensors", "no ERNIE-Image DiT"), ("notes named .safetensors", "no ERNIE-Image DiT this command"),
    ("text_encoder/model.safetensors", "a Mistral-style text model"),
    ("vae/diffusion_pytorch_model.safetensors", "the FLUX.2 VAE"),
    ("transformer/diffusion_pytorch_model.safetensors", "a DiT in full precision"),
    ("a LoRA", "a LoRA")])
def test_quantize_refuses_to_replace_another_models_file(capsys, tmp_path, tiny_turbo_folder, part, held):
    """ComfyUI's model folders hold single files of every kind: an --out naming anything but an earlier quantised DiT
    (a text encoder's, a VAE's or a LoRA's file, the bf16 DiT itself, a file of no model) would lose it. An earlier
    quantised DiT at --out is replaced, as any output is."""
    import shutil

    other = tmp_path / "ernie-image-other.safetensors"
    if part == "a LoRA":
        part = str(_lora_file(tmp_path / "lora.safetensors"))
    elif part == "a file of other tensors":
        from safetensors.torch import save_file

        part = str(tmp_path / "foo.safetensors")
        save_file({"foo": torch.ones(3, 3)}, part)
    elif part == "notes named .safetensors":
        part = str(tmp_path / "notes.txt")
        Path(part).write_text("my notes")
    shutil.copy(tiny_turbo_folder / part, other)
    line = _cli(capsys, "quantize", "--dit", str(tiny_turbo_folder / "transformer"), "--format", "fp8", "--out",
                str(other))
    assert line.startswith(f"error: --out {other} holds {held}") and line.endswith(
        ": the quantised DiT would replace it; give another name, or remove that file first"), line
    assert other.read_bytes() == (tiny_turbo_folder / part).read_bytes()
    earlier = tmp_path / "ernie-image-fp8.safetensors"
    for _ in range(2):
        code, _, err = _quantize(capsys, "--dit", str(tiny_turbo_folder / "transformer"), "--format", "fp8", "--out",
                                 str(earlier))
        assert code == 0, err


@pytest.mark.parametrize("first, then, told", [
    ("nvfp4", "fp8", "holds an earlier NVFP4 DiT: the FP8 one replaces it"),
    ("fp8", "nvfp4", "holds an earlier FP8 DiT: the NVFP4 one replaces it"),
    ("fp8", "fp8", None), ("q8_0", "q8_0", None)], ids=["NVFP4 by FP8", "FP8 by NVFP4", "FP8 by FP8", "Q8_0 by Q8_0"])
def test_quantize_says_when_it_replaces_an_earlier_quantised_dit_of_another_format(capsys, tmp_path, bf16_dit, first,
                                                                                  then, told):
    out = tmp_path / f"ernie-image.{'gguf' if first.startswith('q') else 'safetensors'}"
    assert _quantize(capsys, "--dit", str(bf16_dit), "--format", first, "--out", str(out))[0] == 0
    code, _, err = _quantize(capsys, "--dit", str(bf16_dit), "--format", then, "--out", str(out))
    assert code == 0, err
    said = [line for line in err.splitlines() if "replaces it" in line]
    assert said == ([f"--out {out} {told}"] if told else [])


def test_quantize_writes_beside_a_single_file_dit_in_a_folder_that_is_no_model(capsys, tmp_path, bf16_dit):
    """ComfyUI's diffusion_models/ holds single files and no config.json: the quantised file goes beside the bf16
    one, as users keep them."""
    import shutil

    models = tmp_path / "diffusion_models"
    models.mkdir()
    source = models / "ernie-image-turbo.safetensors"
    shutil.copy(bf16_dit / "diffusion_pytorch_model.safetensors", source)
    code, _, _ = _quantize(capsys, "--dit", str(source), "--format", "fp8", "--variant", "turbo",
                        "--out", str(models / "ernie-image-turbo-fp8.safetensors"))
    assert code == 0 and (models / "ernie-image-turbo-fp8.safetensors").is_file()


def test_quantize_refuses_an_out_inside_the_dit_folder_reached_through_a_link_to_it(capsys, tmp_path, bf16_dit):
    import shutil

    folder = tmp_path / "transformer"
    shutil.copytree(bf16_dit, folder)
    (tmp_path / "linked").symlink_to(folder)
    line = _cli(capsys, "quantize", "--dit", str(folder), "--format", "fp8",
                "--out", str(tmp_path / "linked" / "fp8.safetensors"))
    assert line == (f"error: --out {tmp_path / 'linked' / 'fp8.safetensors'} is inside the --dit folder {folder}: a "
                    "quantised file there would stop the folder loading as the bf16 model; write it elsewhere")
    assert _files(folder) == ["config.json", "diffusion_pytorch_model.safetensors"]


def test_quantize_replaces_a_link_at_out_into_the_dit_folder_and_leaves_the_folder_as_it_was(capsys, tmp_path,
                                                                                             bf16_dit):
    """The written file takes the link's place (a link at --out is replaced, never followed): the folder is not
    where it goes, so the output is not refused as inside it."""
    import shutil

    folder = tmp_path / "transformer"
    shutil.copytree(bf16_dit, folder)
    out = tmp_path / "fp8.safetensors"
    out.symlink_to(folder / "fp8.safetensors")
    assert _quantize(capsys, "--dit", str(folder), "--format", "fp8", "--out", str(out))[0] == 0
    assert out.is_file() and not out.is_symlink()
    assert _files(folder) == ["config.json", "diffusion_pytorch_model.safetensors"]
