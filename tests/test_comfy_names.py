"""An error names a setting the way the program the user runs calls it: the Python name in the library, the flag in
the CLI (runtime/cli/names.py), the Loader's widget in ComfyUI (nodes/comfy_names.py): a ComfyUI user is never told
to "point --model-dir at" a folder."""
from __future__ import annotations

import io
import shutil
import sys
from pathlib import Path

import pytest

from comfy_folders import fake_folder_paths
from ernie_image.nodes.loader import ErnieImageLoader
from ernie_image.runtime.cli.commands import main
from ernie_image.runtime.core.errors import ModelFileError, worded
from ernie_image.runtime.formats.sources import ModelSources
from ernie_image.runtime.local.options import LoadOptions
from ernie_image.runtime.local.pipe import LocalPipe

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
