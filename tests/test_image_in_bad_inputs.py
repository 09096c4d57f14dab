"""Every bad image input of img2img and inpainting is one line naming the cause and the fix, before any work.

CLI cases run against a model folder that does not exist: the image's error must come first, so nothing was
opened. API cases leave the pipe with nothing loaded.
"""
from __future__ import annotations

import re
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from ernie_image.runtime.core.errors import InvalidInputError
from ernie_image.runtime.core.host import NullHost
from ernie_image.runtime.core.request import GenerationRequest
from ernie_image.runtime.demo.tiny import build_tiny_model
from ernie_image.runtime.formats.sources import ModelSources
from ernie_image.runtime.local.options import LoadOptions
from ernie_image.runtime.local.pipe import LocalPipe


def _refused(**fields) -> str:
    settings = dict(prompt="x", width=256, height=256, steps=2, cfg=1.0)
    settings.update(fields)
    with pytest.raises(InvalidInputError) as caught:
        GenerationRequest(**settings).validate()
    message = str(caught.value)
    assert "\n" not in message and len(message) < 400
    return message


IMAGE = torch.rand(1, 256, 256, 3)


@pytest.mark.parametrize("fields, expected", [
    (dict(init_image=torch.rand(1, 250, 256, 3), width=256, height=250),
     "init_image is 256x250: ERNIE-Image needs sides that are multiples of 16 between 256 and 4096: resize or crop "
     "it to 256x256"),
    (dict(init_image=torch.rand(1, 1000, 1000, 3), width=1000, height=1000), "resize or crop it to 1008x1008"),
    (dict(init_image=torch.rand(1, 128, 128, 3), width=128, height=128), "resize or crop it to 256x256"),
    (dict(init_image=IMAGE, mask=torch.ones(1, 256, 240)), "mask is 240x256 but the image is 256x256"),
    (dict(init_image=torch.rand(3, 256, 256, 3), batch=2),
     "init_image holds 3 images but the run makes 2: give one (used for every image) or 2, or set batch to 3"),
    (dict(init_image=IMAGE, mask=torch.ones(3, 256, 256), batch=2), "mask holds 3 images but the run makes 2"),
    (dict(init_image=torch.rand(70, 256, 256, 3)),  # more than a batch can be: no batch size to suggest
     "init_image holds 70 images but the run makes 1: give one (a batch takes up to 64 images)"),
    (dict(init_image=IMAGE, mask=torch.ones(2, 256, 256)),
     "mask holds 2 images but the run makes 1: give one, or set batch to 2"),
    (dict(init_image=IMAGE, denoise=float("nan")), "denoise nan is not allowed: use 0.01..1"),
    (dict(init_image=IMAGE, denoise=1e-300), "denoise 1e-300 is not allowed: use 0.01..1"),  # an endless schedule
    (dict(init_image=IMAGE, denoise=0.0), "denoise 0.0 is not allowed"),
    (dict(init_image=IMAGE, denoise=1.5), "denoise 1.5 is not allowed"),
    (dict(init_image=IMAGE, denoise=-0.2), "denoise -0.2 is not allowed"),
    (dict(init_latents=torch.rand(1, 4, 32, 32)), "init_latents is an SD1.5/SDXL LATENT (4 channels)"),
    (dict(init_latents=torch.rand(1, 16, 32, 32)), "init_latents is a FLUX.1 / SD3 LATENT (16 channels)"),
    (dict(init_latents=torch.rand(1, 32, 32, 32)), "an unpatchified FLUX.2 VAE latent (32 channels)"),
    (dict(init_latents=torch.rand(1, 16, 4, 32, 32)), "is a video LATENT"),
    (dict(init_image=torch.rand(1, 256, 256, 4)), "init_image has an alpha channel (RGBA)"),
    (dict(init_image=IMAGE * 2), "init_image holds values outside 0..1"),
    (dict(init_image=IMAGE, width=512, height=512), "width/height 512x512 differ from the init input's 256x256"),
    (dict(init_image=IMAGE, init_latents=torch.rand(1, 128, 16, 16)), "both init_image and init_latents were given"),
    (dict(denoise=0.5), "denoise 0.5 needs init_image or init_latents to start from"),
    (dict(mask=torch.ones(256, 256)), "mask given without init_image or init_latents"),
    (dict(init_image=IMAGE, mask=torch.ones(256, 256) * 2), "mask holds values outside 0..1"),
    (dict(init_image=IMAGE, mask=torch.ones(256, 256), mask_grow=-1), "mask_grow -1 is not allowed"),
    (dict(init_image=IMAGE, mask=torch.ones(256, 256), mask_feather=5000), "mask_feather 5000 is not allowed"),
    (dict(init_image=IMAGE, mask=torch.zeros(1, 256, 256)),
     "mask is all 0: it marks nothing to repaint, so the image would come back unchanged (Load Image's mask of a "
     "picture without transparency is all 0): paint the area to repaint (1), or leave the mask out to redraw the "
     "whole image"),
    (dict(init_image=IMAGE, mask=torch.stack((torch.ones(256, 256), torch.zeros(256, 256))), batch=2),
     "mask 1 of the batch's 2 is all 0: it marks nothing to repaint"),
    (dict(init_latents=torch.rand(1, 128, 16, 16), mask=torch.zeros(1, 1, 16, 16)), "mask is all 0"),
    (dict(init_image=IMAGE, mask=torch.full((1, 256, 256), 1 / 255)),
     "mask's largest value is 0.0039 (1 of 255): it repaints less than one level of any pixel, so the image would "
     "come back unchanged (a mask saved as 0 and 1 rather than 0 and 255?): paint the area to repaint white (1)"),
])
def test_request_refuses_a_bad_image_input_in_one_line(fields, expected):
    assert expected in _refused(**fields)


def test_good_image_inputs_pass():
    GenerationRequest(prompt="x", width=256, height=256, init_image=IMAGE, denoise=0.4).validate()
    # one image serves a batch; a mask of the latent grid is accepted with a LATENT (SetLatentNoiseMask of a latent)
    GenerationRequest(prompt="x", width=256, height=256, batch=3, init_image=IMAGE, mask=torch.ones(256, 256)).validate()
    GenerationRequest(prompt="x", width=256, height=256, init_latents=torch.rand(1, 128, 16, 16),
                      mask=torch.ones(1, 1, 16, 16)).validate()


def test_metadata_records_flags_never_tensors():
    request = GenerationRequest(prompt="x", width=256, height=256, init_image=IMAGE, denoise=0.5,
                                mask=torch.ones(256, 256))
    metadata = request.metadata()
    assert not any(isinstance(value, torch.Tensor) for value in metadata.values())
    assert metadata["init"] == "image" and metadata["denoise"] == 0.5 and metadata["inpaint"] is True
    assert "init" not in GenerationRequest(prompt="x").metadata()  # text-to-image metadata is unchanged


def test_the_api_refuses_before_anything_loads(tiny_turbo_folder):
    pipe = LocalPipe.load(ModelSources(model_dir=tiny_turbo_folder), LoadOptions(device="cpu"))
    with pytest.raises(InvalidInputError, match="init_latents is an SD1.5/SDXL LATENT"):
        pipe.generate(GenerationRequest(prompt="x", width=256, height=256, init_latents=torch.rand(1, 4, 32, 32)),
                      NullHost())
    assert not pipe.is_loaded()


# ------------------------------------------------------------------------------------------------------------ CLI
def _cli(capsys, *argv: str) -> str:
    from ernie_image.runtime.cli.commands import main

    assert main(list(argv)) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), lines
    return lines[0]


def _png(path: Path, array: np.ndarray, mode: str | None = None) -> Path:
    Image.fromarray(array, mode=mode).save(path) if mode else Image.fromarray(array).save(path)
    return path


@pytest.fixture
def files(tmp_path) -> dict[str, Path]:
    rgb = (np.random.default_rng(0).random((256, 256, 3)) * 255).astype(np.uint8)
    made = {
        "rgb": _png(tmp_path / "rgb.png", rgb),
        "odd": _png(tmp_path / "odd.png", np.zeros((250, 300, 3), np.uint8)),
        "mask_small": _png(tmp_path / "mask_small.png", np.full((240, 256), 255, np.uint8)),
        "mask": _png(tmp_path / "mask.png", np.full((256, 256), 255, np.uint8)),
        "black": _png(tmp_path / "black.png", np.zeros((256, 256), np.uint8)),
        "sixteen": tmp_path / "sixteen.png",
        "alpha": _png(tmp_path / "alpha.png", np.dstack([rgb, np.full((256, 256), 128, np.uint8)])),
        "opaque": _png(tmp_path / "opaque.png", np.dstack([rgb, np.full((256, 256), 255, np.uint8)])),
        "broken": tmp_path / "broken.png",
    }
    Image.fromarray(np.full((256, 256), 40000, np.uint16)).save(made["sixteen"])
    assert Image.open(made["sixteen"]).mode.startswith("I")
    made["broken"].write_bytes(b"\x89PNG\r\n\x1a\n not really a png")
    frames = [Image.fromarray(rgb), Image.fromarray(rgb[::-1].copy())]
    made["two_frames"] = tmp_path / "two_frames.png"
    frames[0].save(made["two_frames"], save_all=True, append_images=frames[1:])
    return made


@pytest.mark.parametrize("argv, expected", [
    (["--init-image", "{odd}"], "error: --init-image is 300x250: ERNIE-Image needs sides that are multiples of 16"),
    (["--init-image", "{odd}"], "resize or crop it to 304x256"),
    (["--init-image", "{rgb}", "--mask", "{mask_small}"], "error: --mask is 256x240 but the image is 256x256"),
    (["--init-image", "{rgb}", "--batch", "2", "--mask", "{mask_small}"], "mask is 256x240"),
    (["--init-image", "{rgb}", "--denoise", "nan"], "error: --denoise 'nan' is not a number: give a plain decimal"),
    (["--init-image", "{rgb}", "--denoise", "0"], "error: --denoise 0.0 is not allowed"),
    (["--init-image", "{rgb}", "--denoise", "1.01"], "error: --denoise 1.01 is not allowed"),
    (["--init-image", "{rgb}", "--denoise", "1e-9"], "error: --denoise 1e-09 is not allowed: use 0.01..1"),
    (["--denoise", "0.5"], "error: --denoise 0.5 needs --init-image: give the image to start from, or leave --denoise out"),
    (["--init-image", "{sixteen}"], "is a 16-bit image (mode I;16): ERNIE-Image reads 8-bit images: save it as 8-bit RGB"),
    (["--init-image", "{alpha}"], "has transparent pixels (alpha): flatten it"),
    (["--init-image", "{broken}"], "is not a readable image"),
    (["--init-image", "{missing}"], "missing.png does not exist: give the path of a PNG or JPEG file"),
    (["--mask", "{rgb}"], "--mask needs --init-image"),
    (["--init-image", "{two_frames}", "--batch", "3"], "error: --init-image holds 2 images but the run makes 3: give "
                                                      "one (used for every image) or 3, or set --batch to 2"),
    (["--init-image", "{rgb}", "--width", "512"], "error: --width/--height 512x256 differ from the init input's 256x256"),
    (["--init-image", "{rgb}", "--mask", "{mask}", "--mask-grow", "-3"], "error: --mask-grow -3 is not allowed"),
    (["--init-image", "{rgb}", "--mask", "{mask}", "--mask-feather", "5000"], "error: --mask-feather 5000 is not allowed"),
    (["--init-image", "{rgb}", "--mask", "{rgb}"], "has coloured pixels: a mask is read from its grey level"),
    (["--init-image", "{rgb}", "--mask", "{black}"], "error: --mask is all 0: it marks nothing to repaint"),
    # a value no run takes is named as that, not as needing the image or mask it would go with
    (["--denoise=1.0000001"], "error: --denoise 1.0000001 is not allowed: use 0.01..1"),
    (["--denoise", "0"], "error: --denoise 0.0 is not allowed: use 0.01..1"),
    (["--mask-grow", "1025"], "error: --mask-grow 1025 is not allowed: use 0..1024 pixels"),
    (["--mask-feather=-1"], "error: --mask-feather -1 is not allowed: use 0..1024 pixels"),
])
def test_cli_refuses_bad_image_inputs_before_opening_the_model(capsys, tmp_path, files, argv, expected):
    names = {**{k: str(v) for k, v in files.items()}, "missing": str(tmp_path / "missing.png")}
    line = _cli(capsys, "generate", "--model-dir", str(tmp_path / "no-model-here"), "--out",
                str(tmp_path / "out.png"), *[a.format(**names) for a in argv])
    assert expected in line, line
    assert not (tmp_path / "out.png").exists()


def test_an_opaque_alpha_channel_is_dropped(files):
    from ernie_image.runtime.files.image_files import read_image

    assert torch.equal(read_image(files["opaque"]), read_image(files["rgb"]))
    assert read_image(files["rgb"]).shape == (1, 256, 256, 3)


def test_cli_inpaints_a_file_and_records_what_it_did(capsys, tmp_path, files, tiny_turbo_folder):
    import json

    from ernie_image.runtime.cli.commands import main

    mask = np.zeros((256, 256), np.uint8)
    mask[64:192, 64:192] = 255
    mask_path = _png(tmp_path / "mask.png", mask)
    out = tmp_path / "inpainted.png"
    assert main(["generate", "--model-dir", str(tiny_turbo_folder), "--init-image", str(files["rgb"]),
                 "--denoise", "0.6", "--mask", str(mask_path), "--steps", "2", "--device", "cpu",
                 "--out", str(out)]) == 0
    written = Image.open(out)
    assert written.size == (256, 256)  # the image decided the size
    settings = json.loads(written.text["ernie-image"])
    assert settings["init"] == "image" and settings["denoise"] == 0.6 and settings["inpaint"] is True
    pixels = np.asarray(written)
    original = np.asarray(Image.open(files["rgb"]))
    assert np.array_equal(pixels[mask == 0], original[mask == 0])  # composited: the kept part is the file's pixels


def test_a_remote_pipe_refuses_image_inputs_in_one_line_and_sends_nothing():
    from fake_sglang import FakeSglang

    from ernie_image.runtime.remote.backend import RemotePipe, RemoteSettings

    with FakeSglang(model_id="baidu/ERNIE-Image-Turbo") as server:
        pipe = RemotePipe([server.url], RemoteSettings(retry_attempts=1, connect_timeout_s=1.0))
        try:
            for fields in (dict(init_image=IMAGE, denoise=0.5), dict(init_latents=torch.rand(1, 128, 16, 16)),
                           dict(init_image=IMAGE, mask=torch.ones(256, 256))):
                with pytest.raises(InvalidInputError) as caught:
                    pipe.generate(GenerationRequest(prompt="x", width=256, height=256, steps=8, cfg=1.0, **fields),
                                  NullHost())
                message = str(caught.value)
                assert "image inputs (img2img, inpainting) are not supported by the remote SGLang backend" in message
                assert "\n" not in message
        finally:
            pipe.release()
    assert server.generations == []


def test_a_decoder_only_vae_file_is_named_before_anything_loads(tmp_path):
    from safetensors.torch import save_file

    from ernie_image.runtime.core.errors import ModelFileError

    from safetensors import safe_open

    sources = build_tiny_model(tmp_path / "comfy", layout="comfy", variant="turbo")
    with safe_open(str(sources.vae), "pt") as handle:  # the same file without its encoder (config kept)
        metadata = handle.metadata()
        decoder_only = {k: handle.get_tensor(k) for k in handle.keys() if not k.startswith("encoder.")}
    save_file(decoder_only, str(sources.vae), metadata=metadata)
    pipe = LocalPipe.load(sources, LoadOptions(device="cpu"))
    request = GenerationRequest(prompt="x", width=256, height=256, steps=2, cfg=1.0, init_image=IMAGE, denoise=0.5)
    with pytest.raises(ModelFileError, match="holds only the VAE decoder: image inputs need the encoder too"):
        pipe.generate(request, NullHost())
    assert not pipe.is_loaded()
    pipe.generate(GenerationRequest(prompt="x", width=256, height=256, steps=1, cfg=1.0), NullHost())  # text-to-image


def test_an_image_claiming_far_more_pixels_than_ernie_takes_is_refused_before_decoding(tmp_path):
    from PIL import Image

    from ernie_image.runtime.files.image_files import read_image

    path = tmp_path / "bomb.png"
    Image.new("1", (40000, 40000)).save(path)  # 1-bit zeros: a small file, 1.6 Gpx if decoded
    with pytest.raises(InvalidInputError, match=r"^path .*bomb.png (is 40000x40000: ERNIE-Image takes sides "
                                                r"up to 4096|claims more pixels than any image ERNIE-Image takes)"):
        read_image(path)


@pytest.mark.parametrize("kind, cause", [("fifo", "is not a regular file (a pipe, device or socket)"),
                                         ("loop", "is a broken or looping symbolic link")])
def test_an_image_path_that_is_a_pipe_or_a_link_loop_is_named_for_what_it_is(tmp_path, kind, cause):
    import os

    from ernie_image.runtime.files.image_files import read_image

    path = tmp_path / "in.png"
    if kind == "fifo":
        os.mkfifo(path)
    else:
        (tmp_path / "other.png").symlink_to(path)
        path.symlink_to(tmp_path / "other.png")
    pattern = rf"^path .*in.png {re.escape(cause)}: give the path of a PNG or JPEG"
    with pytest.raises(InvalidInputError, match=pattern):
        read_image(path)
