"""The library as a newcomer meets it: the names `ernie_image` exports, the README's example, defaults that follow
the pipe's variant, and a package import that stays light and ComfyUI-loadable."""
from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from PIL import Image

import ernie_image
from ernie_image.runtime.core.host import NullHost
from ernie_image.runtime.core.request import GenerationRequest

REPO_ROOT = Path(__file__).resolve().parent.parent


def readme_example() -> str:
    text = (REPO_ROOT / "README.md").read_text()
    block = re.search(r"<!-- library-example:start -->\s*```python\n(.*?)```\s*<!-- library-example:end -->", text, re.S)
    assert block, "README.md has no library example between the library-example markers"
    return block.group(1)


def test_the_readme_example_runs_as_written(tmp_path, monkeypatch, capsys):
    code = readme_example()
    assert len(code.strip().splitlines()) <= 10
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("ERNIE_IMAGE_CACHE", str(tmp_path / "cache"))
    exec(compile(code, "README.md", "exec"), {})
    assert capsys.readouterr().out.strip() == "8 1.0 (1, 256, 256, 3)"  # what the example's comment promises
    from ernie_image import read_png_settings

    settings = read_png_settings(tmp_path / "fox.png")
    assert (settings["steps"], settings["cfg"], settings["seed"], settings["variant"]) == (8, 1.0, 7, "turbo")


def test_every_public_name_imports_from_the_package_top():
    for name in ernie_image.__all__:
        assert getattr(ernie_image, name) is not None, name
    from ernie_image import LocalPipe, RemotePipe  # noqa: F401 - the import is the test
    with pytest.raises(AttributeError):
        ernie_image.NoSuchThing  # noqa: B018


def test_importing_the_package_imports_no_torch_nor_model_code_and_comfyui_still_finds_the_nodes(tmp_path):
    (tmp_path / "ernie_image").symlink_to(REPO_ROOT, target_is_directory=True)
    model_code = ("ernie_image.runtime.model", "ernie_image.runtime.offload", "ernie_image.runtime.local.memory",
                  "ernie_image.runtime.local.parts", "ernie_image.runtime.local.pipe")
    code = ("import sys, ernie_image; light = 'torch' not in sys.modules; "
            "nodes = len(getattr(ernie_image, 'NODE_CLASS_MAPPINGS')); "  # what ComfyUI's start imports
            f"no_model_code = not [m for m in sys.modules if m.startswith({model_code!r})]; "
            "print(light, no_model_code, hasattr(ernie_image, 'WEB_DIRECTORY'), nodes, "
            "sorted(ernie_image.NODE_DISPLAY_NAME_MAPPINGS) == sorted(ernie_image.NODE_CLASS_MAPPINGS))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": str(tmp_path)}, cwd=tmp_path)
    assert done.stdout.split() == ["True", "True", "True", "8", "True"], done.stderr


def test_steps_and_cfg_default_to_the_pipes_variant(tiny_turbo_folder):
    from ernie_image import LoadOptions, LocalPipe, ModelSources

    request = GenerationRequest(prompt="a fox", width=256, height=256)
    assert request.steps is None and request.cfg is None  # "the pipe's variant default"
    result = LocalPipe.load(ModelSources(model_dir=tiny_turbo_folder), LoadOptions(device="cpu")).generate(
        request, NullHost())
    assert (result.request.steps, result.request.cfg) == (8, 1.0)  # Turbo's, not Base's 50 / 4.0
    assert result.request.metadata()["steps"] == 8
    base = GenerationRequest(prompt="a fox").with_defaults("base")
    assert (base.steps, base.cfg) == (50, 4.0)
    assert GenerationRequest(prompt="a fox", steps=3, cfg=2.0).with_defaults("turbo").steps == 3  # given wins


@pytest.mark.parametrize("model_id, expected", [("baidu/ERNIE-Image-Turbo", (8, 1.0)), ("baidu/ERNIE-Image", (50, 4.0))])
def test_the_remote_pipe_sends_the_served_variants_defaults(model_id, expected):
    sys.path.insert(0, str(Path(__file__).parent))
    from fake_sglang import FakeSglang

    from ernie_image import RemotePipe

    with FakeSglang(model_id=model_id) as server:
        pipe = RemotePipe([server.url])
        try:
            result = pipe.generate(GenerationRequest(prompt="a fox", width=256, height=256), NullHost())
        finally:
            pipe.release()
        sent = server.generations[0].body
    assert (sent["num_inference_steps"], sent["guidance_scale"]) == expected
    assert (result.request.steps, result.request.cfg) == expected


@pytest.mark.parametrize("make, expected", [
    (lambda path: path.write_text("hello"), "{path} is not a PNG file (not an image at all): give a PNG that "
                                            "ernie-image wrote"),
    (lambda path: Image.new("RGB", (4, 4)).save(path, format="JPEG"),
     "{path} is not a PNG file (JPEG image): give a PNG that ernie-image wrote"),
    (lambda path: None, "{path} cannot be read as a PNG file (No such file or directory): check the path and that "
                        "the file is complete"),
    (lambda path: path.write_bytes(_png_with_text("{not json")[:60]), "{path} cannot be read as a PNG file"),
    (lambda path: path.write_bytes(_png_with_text("{not json")), "{path}: its 'ernie-image' text is not the settings "
                                                                 "ernie-image writes"),
], ids=["text file", "JPEG", "missing", "cut short", "settings not JSON"])
def test_read_png_settings_refuses_what_is_not_its_png_in_one_line_naming_the_file(tmp_path, make, expected):
    """Was Pillow's UnidentifiedImageError (or a JSON traceback) for a file that is not an ernie-image PNG."""
    from ernie_image import read_png_settings
    from ernie_image.runtime.core.errors import InvalidInputError

    path = tmp_path / "picture.png"
    make(path)
    with pytest.raises(InvalidInputError) as caught:
        read_png_settings(path)
    assert str(caught.value).startswith(expected.format(path=path)), str(caught.value)


def test_read_png_settings_of_a_png_without_settings_is_empty(tmp_path):
    from ernie_image import read_png_settings

    Image.new("RGB", (4, 4)).save(tmp_path / "plain.png")
    assert read_png_settings(tmp_path / "plain.png") == {}


def _png_with_text(text: str) -> bytes:
    import io

    from PIL.PngImagePlugin import PngInfo

    info = PngInfo()
    info.add_text("ernie-image", text)
    buffer = io.BytesIO()
    Image.new("RGB", (4, 4)).save(buffer, format="PNG", pnginfo=info)
    return buffer.getvalue()


def test_checking_a_demo_job_first_leaves_diffusers_usable_in_the_same_process(tmp_path):
    """The demo's shape check builds diffusers models on the meta device; were diffusers first imported there, its
    module-level tables (the NVFP4 lookup) would stay meta tensors and fail later diffusers calls in the process."""
    (tmp_path / "ernie_image").symlink_to(REPO_ROOT, target_is_directory=True)
    code = ("import sys, torch; from ernie_image.runtime.demo.tiny import model_shapes; model_shapes(); "
            "from diffusers.quantizers.bfl.utils import dequantize_nvfp4; "
            "print(dequantize_nvfp4(torch.zeros(2, 8, dtype=torch.uint8), torch.ones(2, 1, dtype=torch.float8_e4m3fn), "
            "torch.tensor(1.0)).abs().sum().item())")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                          env={**os.environ, "PYTHONPATH": str(tmp_path)}, cwd=tmp_path)
    assert done.stdout.strip() == "0.0", done.stderr[-2000:]
