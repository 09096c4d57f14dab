"""An error names a setting the way the program the user runs calls it: the Python name in the library, the flag in
the CLI (runtime/cli/names.py), the Loader's widget in ComfyUI (nodes/comfy_names.py): a ComfyUI user is never told
to "point --model-dir at" a folder."""
from __future__ import annotations

import io
import re
import shutil
import sys
from pathlib import Path

import pytest

import torch

from comfy_folders import fake_folder_paths
from ernie_image.nodes.comfy_names import comfy_words
from ernie_image.nodes.loader import ErnieImageLoader
from ernie_image.runtime.cli.commands import main
from ernie_image.runtime.cli.names import cli_message
from ernie_image.runtime.core.errors import ErnieImageError, InvalidInputError, ModelFileError, worded
from ernie_image.runtime.core.host import NullHost
from ernie_image.runtime.core.request import GenerationRequest
from ernie_image.runtime.files.image_files import read_image, read_mask
from ernie_image.runtime.formats.sources import ModelSources
from ernie_image.runtime.formats.tokenizer import load_tokenizer
from ernie_image.runtime.local.options import LoadOptions
from ernie_image.runtime.local.pipe import LocalPipe
from ernie_image.runtime.net.urls import normalize_base_url
from ernie_image.runtime.remote.backend import RemotePipe
from ernie_image.runtime.step_cache.view import with_step_cache

pytestmark = pytest.mark.usefixtures("no_comfy_modules_left_behind")

FOLDER_WORDS = ("{folder} has no transformer/ folder: point {setting} at a diffusers ERNIE-Image folder "
                "(model_index.json, transformer/, text_encoder/, tokenizer/, vae/) or give the DiT file ({dit})")


@pytest.fixture
def half_folder(tmp_path, tiny_turbo_folder) -> Path:
    """A diffusers folder under ComfyUI's models/diffusers/ whose transformer/ is missing (a download cut short)."""
    folder = tmp_path / "models" / "diffusers" / "ERNIE-Image-Turbo"
    shutil.copytree(tiny_turbo_folder, folder, ignore=shutil.ignore_patterns("transformer"))
    return folder


def test_a_folder_without_its_dit_names_the_loaders_widgets_in_comfyui(half_folder, monkeypatch):
    monkeypatch.setitem(sys.modules, "folder_paths", fake_folder_paths(half_folder.parent.parent))
    with pytest.raises(ModelFileError) as refused:
        ErnieImageLoader().load(diffusers_folder=half_folder.name, diffusion_model="(none)", text_encoder="(none)",
                                vae="(none)", prompt_enhancer="(none)", variant="auto", vram_budget_gb=0.0,
                                keep_loaded=False)
    assert str(refused.value) == FOLDER_WORDS.format(folder=half_folder, setting="the Loader's diffusers_folder",
                                                     dit="the Loader's diffusion_model")


def test_the_same_error_names_the_flags_in_the_cli(half_folder, capsys, tmp_path):
    assert main(["generate", "--model-dir", str(half_folder), "--device", "cpu", "--out", str(tmp_path / "x.png")]) == 2
    assert capsys.readouterr().err.strip() == "error: " + FOLDER_WORDS.format(folder=half_folder,
                                                                              setting="--model-dir", dit="--dit")


def test_the_same_error_names_the_python_names_in_the_library(half_folder):
    with pytest.raises(ModelFileError) as refused:
        LocalPipe.load(ModelSources(model_dir=half_folder), LoadOptions(device="cpu"))
    assert str(refused.value) == FOLDER_WORDS.format(folder=half_folder, setting="model_dir", dit="dit")


@pytest.mark.parametrize("budget", [float("nan"), float("inf"), float("-inf"), -1.0])
def test_a_budget_that_is_no_number_of_gb_names_the_loaders_widget_and_its_auto(tiny_turbo_folder, tmp_path, budget,
                                                                                 monkeypatch):
    from ernie_image.runtime.local import pipe as local_pipe

    models = tmp_path / "models"
    shutil.copytree(tiny_turbo_folder, models / "diffusers" / "ERNIE-Image-Turbo")
    monkeypatch.setitem(sys.modules, "folder_paths", fake_folder_paths(models))
    monkeypatch.setattr(local_pipe, "open_checked_parts", lambda *a, **k: pytest.fail("a model file was opened"))
    with pytest.raises(InvalidInputError) as refused:
        ErnieImageLoader().load(diffusers_folder="ERNIE-Image-Turbo", diffusion_model="(none)", text_encoder="(none)",
                                vae="(none)", prompt_enhancer="(none)", variant="auto", vram_budget_gb=budget,
                                keep_loaded=False)
    assert str(refused.value) == (f"the Loader's vram_budget_gb {budget!r} is not a positive number of GiB up to 1e+06: "
                                  "give the GiB the pipe may use, or 0 for auto (what is free after ComfyUI makes room)")


NAMES = {"model_dir": "--model-dir", "text_encoder": "--text-encoder", "vae": "--vae", "width": "--width",
         "height": "--height"}


@pytest.mark.parametrize("text, expected", [
    ("/models/model_dir/x has no vae/ folder: point model_dir at it", "/models/model_dir/x has no vae/ folder: point "
                                                                      "--model-dir at it"),
    ("/ComfyUI/models/vae/flux2-vae.safetensors is not a VAE (vae)", "/ComfyUI/models/vae/flux2-vae.safetensors is "
                                                                     "not a VAE (--vae)"),
    ("model_dir.safetensors is odd: set model_dir", "model_dir.safetensors is odd: set --model-dir"),
    ("give the text_encoder/ folder or the file (text_encoder)", "give the text_encoder/ folder or the file "
                                                                 "(--text-encoder)"),
    ("set model_dir.", "set --model-dir."),
    ("width/height 512x256 differ", "--width/--height 512x256 differ"),
])
def test_a_setting_is_reworded_where_it_is_a_word_never_inside_a_path_or_file_name(text, expected):
    assert worded(text, ("model_dir", "text_encoder", "vae", "width", "height"), NAMES) == expected


def test_a_dotted_key_such_as_the_metadata_key_is_never_reworded_as_a_setting() -> None:
    from ernie_image.runtime.core.errors import worded

    text = "x.safetensors records ernie_image.variant 'Turbo' in its metadata: set variant to base or turbo"
    assert worded(text, ["variant"], {"variant": "--variant"}) == (
        "x.safetensors records ernie_image.variant 'Turbo' in its metadata: set --variant to base or turbo")


# ------------------------------------------------------------------------------------------- every node, every line
def test_every_node_shows_the_errors_of_its_runtime_calls_in_comfyui_s_words():
    from ernie_image.nodes import NODE_CLASS_MAPPINGS

    unworded = [name for name, node in NODE_CLASS_MAPPINGS.items()
                if not getattr(getattr(node, node.FUNCTION), "speaks_comfy", False)]
    assert unworded == []


@pytest.mark.parametrize("line", ["the variant of this prompt is odd", "pe and vae are words, not settings, here"])
def test_a_notice_that_records_no_setting_is_shown_as_written_on_every_surface(line):
    from ernie_image.nodes.host import NoteHost
    from ernie_image.runtime.cli.console import Console, ConsoleHost

    node = NoteHost()
    node.log(line)
    assert node.notes == [line]
    stream = io.StringIO()
    ConsoleHost(console=Console(stream)).log(line)
    assert stream.getvalue() == line + "\n"


def test_a_notice_names_the_settings_it_records_in_each_surface_s_words():
    from ernie_image.nodes.host import NoteHost
    from ernie_image.runtime.cli.console import Console, ConsoleHost
    from ernie_image.runtime.core.errors import naming_line

    line = naming_line("set variant, or give pe", "variant", "pe")
    node = NoteHost()
    node.log(line)
    assert node.notes == ["set the Loader's variant widget, or give the Loader's prompt_enhancer"]
    stream = io.StringIO()
    ConsoleHost(console=Console(stream)).log(line)
    assert stream.getvalue() == "set --variant, or give --pe\n"


# ------------------------------------------------------------------------------------------- errors on every surface
CLI_FLAG = re.compile(r"(?<![\w-])--[a-z]")
NODE_WORDS = re.compile(r"\bconnect|\bwire\b|\bLoader\b|\bSampler\b|\bwidget|\bnode\b|ComfyUI:|Load Image|"
                        r"Upscale Image")
IMAGE = torch.rand(1, 256, 256, 3)


def _png(path: Path, mode: str, colour) -> Path:
    from PIL import Image

    Image.new(mode, (256, 256), colour).save(path)
    return path


def _request(**fields) -> GenerationRequest:
    return GenerationRequest(**{"prompt": "x", "width": 256, "height": 256, "steps": 1, "cfg": 1.0, **fields})


def _remote_pipe() -> RemotePipe:
    return RemotePipe(["http://127.0.0.1:9"])  # nothing is sent: every case is refused first


LIBRARY_CALLS = {
    "an unreadable image": lambda tmp: read_image(tmp / "none.png"),
    "an image with transparent pixels": lambda tmp: read_image(_png(tmp / "a.png", "RGBA", (1, 2, 3, 0))),
    "a coloured mask": lambda tmp: read_mask(_png(tmp / "m.png", "RGB", (255, 0, 0))),
    "an image and a latent": lambda tmp: _request(init_image=IMAGE, init_latents=torch.rand(1, 128, 16, 16)).validate(),
    "denoise without an image": lambda tmp: _request(denoise=0.5).validate(),
    "a mask without an image": lambda tmp: _request(mask=torch.ones(1, 256, 256)).validate(),
    "a latent that is no tensor": lambda tmp: _request(init_latents=[1, 2]).validate(),
    "an image of an odd size": lambda tmp: _request(init_image=torch.rand(1, 250, 256, 3), height=250).validate(),
    "a mask of another size": lambda tmp: _request(init_image=IMAGE, mask=torch.ones(1, 512, 512)).validate(),
    "an image batch that does not fit": lambda tmp: _request(init_image=torch.rand(2, 256, 256, 3), batch=3).validate(),
    "a mask batch that does not fit": lambda tmp: _request(init_image=IMAGE, mask=torch.ones(3, 256, 256),
                                                           batch=2).validate(),
    "an image with an alpha channel": lambda tmp: _request(init_image=torch.rand(1, 256, 256, 4)).validate(),
    "an image outside 0..1": lambda tmp: _request(init_image=IMAGE * 2).validate(),
    "an image that is no IMAGE": lambda tmp: _request(init_image=torch.rand(256, 256, 3)).validate(),
    "a latent of another model": lambda tmp: _request(init_latents=torch.rand(1, 4, 32, 32)).validate(),
    "no tokenizer": lambda tmp: load_tokenizer(ModelSources(dit=tmp, vae=tmp)),
    "a password in a server URL": lambda tmp: normalize_base_url("http://user:secret@127.0.0.1:30000"),
    "a token in a server URL": lambda tmp: normalize_base_url("http://127.0.0.1:30000/?api_key=secret"),
    "image inputs on a remote pipe": lambda tmp: _remote_pipe().generate(_request(init_image=IMAGE, denoise=0.5),
                                                                         NullHost()),
    "LoRAs on a remote pipe": lambda tmp: _remote_pipe().with_loras(()),
    "a step cache on a remote pipe": lambda tmp: with_step_cache(_remote_pipe(), "dbcache"),
    "the enhancer of a remote pipe without a PE endpoint": lambda tmp: _remote_pipe().enhance("a fox", 1024, 1024, 0),
}


@pytest.mark.parametrize("case", LIBRARY_CALLS)
def test_each_surface_names_a_bad_input_in_its_own_words(case, tmp_path):
    """The library's message names no CLI flag and no node; ComfyUI's names no flag; the CLI's names no node."""
    with pytest.raises(ErnieImageError) as refused:
        LIBRARY_CALLS[case](tmp_path)
    library = str(refused.value)
    in_comfyui = comfy_words(library, refused.value.settings)
    in_cli = cli_message(refused.value)
    assert not CLI_FLAG.search(library) and not NODE_WORDS.search(library), library
    assert not CLI_FLAG.search(in_comfyui), in_comfyui
    assert not NODE_WORDS.search(in_cli), in_cli


# How each surface calls the image inputs and the batch size: the library's arguments, the CLI's flags, the Sampler's
# inputs and widget.
IMAGE_INPUT_WORDS = {
    "library": dict(image="init_image", latent="init_latents", mask="mask", batch="batch"),
    "cli": dict(image="--init-image", latent="init_latents", mask="--mask", batch="--batch"),
    "comfyui": dict(image="the image input", latent="the latent input", mask="the mask input", batch="batch_size"),
}


@pytest.mark.parametrize("fields, words", [
    (dict(init_image=torch.rand(2, 256, 256, 3), batch=3),
     "{image} holds 2 images but the run makes 3: give one (used for every image) or 3, or set {batch} to 2"),
    (dict(init_image=IMAGE, mask=torch.ones(3, 256, 256), batch=2),
     "{mask} holds 3 images but the run makes 2: give one (used for every image) or 2, or set {batch} to 3"),
    (dict(init_latents=torch.rand(2, 128, 16, 16), batch=3),
     "{latent} holds 2 images but the run makes 3: give one (used for every image) or 3, or set {batch} to 2"),
    (dict(init_image=torch.rand(1, 256, 256, 4)),
     "{image} has an alpha channel (RGBA): ERNIE-Image takes RGB: drop or flatten the alpha first (give it as the "
     "mask to repaint the transparent part)"),
    (dict(init_image=torch.rand(1, 256, 256, 5)), "{image} has 5 channels: ERNIE-Image takes RGB [batch, height, "
                                                  "width, 3]"),
    (dict(init_image=IMAGE * 2), "{image} holds values outside 0..1 (or NaN): give float RGB in 0..1"),
    (dict(init_image=torch.rand(1, 512, 256, 3, 1)),
     "{image} (1, 512, 256, 3, 1) is not an IMAGE: give float RGB [batch, height, width, 3] in 0..1"),
    (dict(init_latents=torch.rand(1, 4, 32, 32)),
     "{latent} is an SD1.5/SDXL LATENT (4 channels), not ERNIE-Image's [batch, 128, height/16, width/16]: VAE "
     "Encode the image with the FLUX.2 VAE (flux2-vae) or give the image itself"),
    (dict(batch=100), "{batch} 100 is not allowed: use 1..64"),
], ids=["image batch", "mask batch", "latent batch", "alpha", "channels", "range", "no IMAGE", "other latent",
        "batch range"])
def test_an_image_input_refusal_names_the_input_and_the_batch_as_each_surface_calls_them(fields, words):
    with pytest.raises(InvalidInputError) as refused:
        _request(**fields).validate()
    assert str(refused.value) == words.format(**IMAGE_INPUT_WORDS["library"])
    assert cli_message(refused.value) == words.format(**IMAGE_INPUT_WORDS["cli"])
    assert comfy_words(str(refused.value), refused.value.settings) == words.format(**IMAGE_INPUT_WORDS["comfyui"])


def test_the_out_of_memory_advice_names_the_budget_as_each_surface_calls_it():
    from ernie_image.runtime.local.out_of_memory import memory_refusal

    refusal = memory_refusal(torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.50 GiB"), "dit",
                             _request(), torch.device("cuda"), None)
    assert "set a VRAM budget (vram_budget_gb)" in str(refusal) and not CLI_FLAG.search(str(refusal))
    assert "(the Loader's vram_budget_gb)" in comfy_words(str(refusal), refusal.settings)
    assert "(--budget)" in cli_message(refusal) and "Loader" not in cli_message(refusal)


@pytest.mark.parametrize("setting, expected", [
    ("path", "path {file} has transparent pixels (alpha): flatten it onto a background and save it as RGB, or paint "
             "the area to repaint into a mask"),
    ("init_image", "--init-image {file} has transparent pixels (alpha): flatten it onto a background and save it as "
                   "RGB, or paint the area to repaint into a --mask"),
])
def test_the_image_reader_names_the_file_by_the_library_s_argument_or_the_cli_s_flag(setting, expected, tmp_path):
    image = _png(tmp_path / "a.png", "RGBA", (1, 2, 3, 0))
    with pytest.raises(InvalidInputError) as refused:
        read_image(image, setting)
    shown = str(refused.value) if setting == "path" else cli_message(refused.value)
    assert shown == expected.format(file=image)


def test_comfyui_names_the_sampler_s_inputs_and_its_own_nodes_for_a_bad_image_input():
    from ernie_image.nodes.sampler import ErnieImageSampler

    with pytest.raises(InvalidInputError) as refused:
        ErnieImageSampler().generate(pipe=_remote_pipe(), prompt="x", resolution="custom", width=256, height=256,
                                     steps=1, cfg=1.0, seed=0, batch_size=1, shift=4.0, use_pe=False,
                                     image=torch.rand(1, 250, 256, 3))
    assert str(refused.value).startswith("the image input is 256x250: ERNIE-Image needs sides that are multiples of "
                                         "16 between 256 and 4096: resize or crop it (Upscale Image or ImageCrop) to "
                                         "256x256 first")


def test_comfyui_s_tokenizer_advice_offers_only_what_the_loader_has():
    with pytest.raises(ModelFileError) as refused:
        load_tokenizer(ModelSources(dit=Path("/x"), vae=Path("/x")))
    assert comfy_words(str(refused.value), refused.value.settings) == (
        "no vocabulary for the text encoder found (a tokenizer.json, or one its file embeds): give a text encoder "
        "file that embeds one (the Loader's text_encoder: ministral-3-3b.safetensors), a diffusers folder with "
        "tokenizer/ (the Loader's diffusers_folder)")
    assert cli_message(refused.value).endswith("(--model-dir), or a tokenizer/ folder alone (--tokenizer)")
