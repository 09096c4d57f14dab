"""What a server's image answer must be: exactly the one image asked for (n=1), an 8-bit RGB PNG, opaque, one frame.

sglang 0.5.23 sends 8-bit RGB PNGs (every answer seen from the real server, shared/facts/SGLANG.md), so anything else
is a server, or something in front of it, misbehaving: converted to RGB, a 16-bit grayscale PNG comes out pure white
and an alpha channel is lost; keeping the first of two images hides the second. Each is refused in one line naming the server and what it
sent, through the library, the CLI (exit 2, no file written), the ComfyUI Sampler and check-remote (the server's row
fails), and in a fleet it counts as a wrong-size answer does: the server answered, so it is given up on for the batch
and its image is made by another server.

Real aiohttp servers on loopback (tests/fake_sglang.py) answer each PNG below, built byte by byte so that every
colour type and bit depth PNG has is sent exactly as a misbehaving server would.
"""
from __future__ import annotations

import base64
import io
import struct
import zlib
from pathlib import Path
from typing import Optional

import pytest
from PIL import Image, ImageFile

from ernie_image.nodes.remote import ErnieImageRemoteBackend
from ernie_image.nodes.sampler import ErnieImageTurboSampler
from ernie_image.runtime.cli.commands import main
from ernie_image.runtime.core.host import NullHost
from ernie_image.runtime.core.request import GenerationRequest
from ernie_image.runtime.net.errors import BadResponse
from ernie_image.runtime.remote.backend import RemotePipe, RemoteSettings
from ernie_image.runtime.remote.image_answer import decode_image
from ernie_image.runtime.remote.server_check import check_remote

from fake_sglang import FakeSglang

SIDE = 256
FAST = RemoteSettings(retry_attempts=2, retry_down_after_s=0.05, probe_every_s=0.05, connect_timeout_s=1.0,
                      wait_for_servers_s=10.0)
TURBO = ["--steps", "8", "--cfg", "1", "--width", str(SIDE), "--height", str(SIDE)]
MISBEHAVING = "refused, the server is misbehaving: check the server and the model it runs (its log and its version)"
CHANNELS = {0: 1, 2: 3, 3: 1, 4: 2, 6: 4}  # samples per pixel of each PNG colour type


ADAM7 = ((0, 0, 8, 8), (4, 0, 8, 8), (0, 4, 4, 8), (2, 0, 4, 4), (0, 2, 2, 4), (1, 0, 2, 2), (0, 1, 1, 2))


def png(color_type: int, depth: int, pixel: bytes = b"", palette: Optional[bytes] = None,
        trns: Optional[bytes] = None, interlaced: bool = False, pixels_cut: int = 0) -> bytes:
    """A SIDE x SIDE PNG of this colour type and bit depth, every pixel `pixel` (zeros when empty); `interlaced`:
    Adam7; `pixels_cut`: that many bytes of the filtered pixels left out, the PNG's chunks otherwise whole."""
    rows = []
    for x0, y0, dx, dy in ADAM7 if interlaced else ((0, 0, 1, 1),):
        columns = -(-(SIDE - x0) // dx)
        row = pixel * columns if pixel else bytes(-(-columns * CHANNELS[color_type] * depth // 8))
        rows += [b"\x00" + row] * -(-(SIDE - y0) // dy)
    filtered = b"".join(rows)
    chunks = [(b"IHDR", struct.pack(">IIBBBBB", SIDE, SIDE, depth, color_type, 0, 0, int(interlaced)))]
    chunks += [(b"PLTE", palette)] if palette else []
    chunks += [(b"tRNS", trns)] if trns else []
    chunks += [(b"IDAT", zlib.compress(filtered[:len(filtered) - pixels_cut])), (b"IEND", b"")]
    return b"\x89PNG\r\n\x1a\n" + b"".join(struct.pack(">I", len(data)) + kind + data +
                                          struct.pack(">I", zlib.crc32(kind + data)) for kind, data in chunks)


def pillow_saved(image: Image.Image, **options) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, **options)
    return buffer.getvalue()


def animated_png() -> bytes:
    frames = [Image.new("RGB", (SIDE, SIDE), colour) for colour in ("red", "blue")]
    return pillow_saved(frames[0], format="PNG", save_all=True, append_images=frames[1:])


# what a server sends -> how the refusal says it
NOT_8_BIT_RGB = {
    "16-bit grayscale (I;16)": (png(0, 16, b"\x12\x34"), "a 16-bit grayscale PNG"),
    "8-bit grayscale (L)": (png(0, 8, b"\x80"), "an 8-bit grayscale PNG"),
    "1-bit (1)": (png(0, 1), "a 1-bit grayscale PNG"),
    "16-bit RGB": (png(2, 16, b"\x10\x00\x20\x00\x30\x00"), "a 16-bit RGB PNG"),
    "RGB with a transparent colour": (png(2, 8, b"\x10\x20\x30", trns=b"\x00\x10\x00\x20\x00\x30"),
                                      "an 8-bit RGB PNG with transparency (a tRNS chunk)"),
    "palette (P)": (png(3, 8, b"\x00", palette=b"\x10\x20\x30"), "an 8-bit palette PNG"),
    "palette with transparency": (png(3, 8, b"\x00", palette=b"\x10\x20\x30", trns=b"\x80"),
                                  "an 8-bit palette PNG with transparency (a tRNS chunk)"),
    "grayscale with alpha (LA)": (png(4, 8, b"\x80\x0a"), "an 8-bit grayscale PNG with an alpha channel"),
    "RGBA, alpha 10": (png(6, 8, b"\x10\x20\x30\x0a"), "an 8-bit RGBA PNG"),
    "RGBA, fully opaque": (png(6, 8, b"\x10\x20\x30\xff"), "an 8-bit RGBA PNG"),
    "16-bit RGBA": (png(6, 16, b"\x10\x00\x20\x00\x30\x00\xff\xff"), "a 16-bit RGBA PNG"),
    "animated (APNG)": (animated_png(), "an 8-bit RGB PNG, animated (2 frames)"),
}


def refusal(url: str, said: str) -> str:
    return f"{url} sent {said}, not the 8-bit RGB PNG an SGLang server makes: {MISBEHAVING}"


# a server answering with each bad image, or each wrong count of images -> the line that refuses it
def _bad_answers() -> dict[str, tuple[dict, str]]:
    answers = {name: (dict(image_b64=base64.b64encode(raw).decode()), said) for name, (raw, said) in
               NOT_8_BIT_RGB.items()}
    answers.update({f"{count} images for n=1": (dict(images_per_answer=count), "") for count in (0, 2, 3)})
    return answers


BAD_ANSWERS = _bad_answers()


def expected_line(name: str, url: str) -> str:
    behaviour, said = BAD_ANSWERS[name]
    count = behaviour.get("images_per_answer")
    if count is None:
        return refusal(url, said)
    sent = "no image" if count == 0 else f"{count} images"
    return f"{url} sent {sent} for the 1 asked for (n=1): {MISBEHAVING}"


def request(batch: int = 1) -> GenerationRequest:
    return GenerationRequest(prompt="a red fox in snow", negative_prompt="", width=SIDE, height=SIDE, steps=8,
                             cfg=1.0, seed=7, batch=batch)


def test_the_pngs_sent_are_what_their_names_say():
    """The table's bytes are real PNGs of those kinds: Pillow reads each, in the mode its name says."""
    modes = {}
    for name, (raw, _) in NOT_8_BIT_RGB.items():
        with Image.open(io.BytesIO(raw)) as image:
            image.load()
            modes[name] = image.mode
    assert modes == {"16-bit grayscale (I;16)": "I;16", "8-bit grayscale (L)": "L", "1-bit (1)": "1",
                     "16-bit RGB": "RGB", "RGB with a transparent colour": "RGB", "palette (P)": "P",
                     "palette with transparency": "P", "grayscale with alpha (LA)": "LA", "RGBA, alpha 10": "RGBA",
                     "RGBA, fully opaque": "RGBA", "16-bit RGBA": "RGBA", "animated (APNG)": "RGB"}


@pytest.mark.parametrize("interlaced", [False, True], ids=["plain", "interlaced"])
@pytest.mark.parametrize("truncated_allowed", [False, True], ids=["", "LOAD_TRUNCATED_IMAGES set"])
def test_an_opaque_8_bit_rgb_png_is_accepted_pixel_for_pixel(monkeypatch, interlaced, truncated_allowed):
    monkeypatch.setattr(ImageFile, "LOAD_TRUNCATED_IMAGES", truncated_allowed)
    raw = png(2, 8, b"\x00\x80\xff", interlaced=interlaced)
    image = decode_image(base64.b64encode(raw).decode(), SIDE, SIDE, "srv")
    assert image.shape == (SIDE, SIDE, 3)
    assert (image * 255).round().tolist() == [[[0.0, 128.0, 255.0]] * SIDE] * SIDE


WHOLE = png(2, 8, b"\x10\x20\x30")
CUT = {
    "cut in half": WHOLE[:len(WHOLE) // 2],
    "pixels short, chunks whole": png(2, 8, b"\x10\x20\x30", pixels_cut=3 * SIDE),
    "interlaced, pixels short": png(2, 8, b"\x10\x20\x30", interlaced=True, pixels_cut=10),
}
WHOLE_PIXELS = {
    "no IEND": WHOLE[:-12],
    "IEND cut short": WHOLE[:-4],
    "data past the pixels": png(2, 8, b"\x10\x20\x30", pixels_cut=-7),
}


@pytest.mark.parametrize("name", CUT)
@pytest.mark.parametrize("truncated_allowed", [False, True], ids=["", "LOAD_TRUNCATED_IMAGES set"])
def test_a_png_that_is_not_whole_is_refused_even_where_pillow_is_told_to_accept_truncated_images(
        monkeypatch, name, truncated_allowed):
    """Some ComfyUI node packs set ImageFile.LOAD_TRUNCATED_IMAGES for the whole process: Pillow then fills what is
    missing with black and says nothing."""
    monkeypatch.setattr(ImageFile, "LOAD_TRUNCATED_IMAGES", truncated_allowed)
    with pytest.raises(BadResponse) as caught:
        decode_image(base64.b64encode(CUT[name]).decode(), SIDE, SIDE, "srv")
    assert str(caught.value) in [f"srv returned bytes that are not a readable image ({kind}); see the server log and "
                                 f"check its version" for kind in ("OSError", "SyntaxError", "ValueError")]


@pytest.mark.parametrize("name", NOT_8_BIT_RGB)
def test_decoding_refuses_every_png_but_8_bit_rgb_naming_what_it_is(name):
    raw, said = NOT_8_BIT_RGB[name]
    with pytest.raises(BadResponse) as caught:
        decode_image(base64.b64encode(raw).decode(), SIDE, SIDE, "http://gpu-a:30000")
    assert str(caught.value) == refusal("http://gpu-a:30000", said)


@pytest.mark.parametrize("image, named", [
    (Image.new("CMYK", (SIDE, SIDE)), "TIFF"),
    (Image.new("F", (SIDE, SIDE)), "TIFF"),
    (Image.new("I", (SIDE, SIDE)), "TIFF"),
], ids=["CMYK", "F", "I"])
def test_modes_a_png_cannot_hold_come_in_another_format_and_are_refused_as_that_format(image, named):
    b64 = base64.b64encode(pillow_saved(image, format=named)).decode()
    with pytest.raises(BadResponse) as caught:
        decode_image(b64, SIDE, SIDE, "srv")
    assert str(caught.value) == (f"srv sent a {named} image, not the PNG asked for: refused (the server ignored "
                                 f"output_format png): check its version")


# ------------------------------------------------------------------------------------------------ through the library
@pytest.mark.parametrize("name", BAD_ANSWERS)
def test_the_library_refuses_each_bad_answer_in_one_line_and_asks_the_server_once(name):
    behaviour, _ = BAD_ANSWERS[name]
    with FakeSglang(**behaviour) as server:
        pipe = RemotePipe([server.url], FAST)
        with pytest.raises(BadResponse) as caught:
            pipe.generate(request(), NullHost())
        pipe.release()
        sent = [g.body for g in server.generations]
    assert str(caught.value) == expected_line(name, server.url)
    assert [(body["n"], body["response_format"], body["output_format"]) for body in sent] == [(1, "b64_json", "png")]


@pytest.mark.parametrize("name", ["16-bit grayscale (I;16)", "RGBA, alpha 10", "2 images for n=1",
                                  "0 images for n=1"])
def test_a_fleet_gives_up_on_the_misbehaving_server_and_makes_its_image_on_another(name):
    """As a wrong-size answer: the server answered, so it is done with the image; no server is running it, so it is
    made elsewhere, and the server is out of the rotation for this batch."""
    behaviour, _ = BAD_ANSWERS[name]
    host = NullHost()
    with FakeSglang(**behaviour) as bad, FakeSglang(service_time_s=0.05) as good:
        pipe = RemotePipe([bad.url, good.url], FAST)
        result = pipe.generate(request(batch=3), host)
        pipe.release()
        asked_bad = len(bad.generations)
    assert result.images.shape == (3, SIDE, SIDE, 3)
    assert {entry["server"] for entry in result.info["images"]} == {good.url} and asked_bad == 1
    about_bad = [line for line in host.messages if bad.url in line]
    assert len(about_bad) == 1 and about_bad[0].startswith(
        f"giving up on {bad.url} for this batch: {expected_line(name, bad.url)}; image ") and about_bad[0].endswith(
        f" goes back to the queue; the batch goes on with {good.url}"), host.messages


# ---------------------------------------------------------------------------------------------------- the CLI
@pytest.mark.parametrize("name", BAD_ANSWERS)
def test_the_cli_exits_2_in_one_line_and_writes_no_file(capsys, tmp_path, name):
    behaviour, _ = BAD_ANSWERS[name]
    with FakeSglang(**behaviour) as server:
        code = main(["generate", "--server", server.url, "--prompt", "x", *TURBO, "--out", str(tmp_path / "r.png")])
    captured = capsys.readouterr()
    assert code == 2 and captured.out == ""
    said = captured.err.strip().splitlines()  # what the run is doing, then the error
    assert said[-1] == f"error: {expected_line(name, server.url)}" and not any("error" in line for line in said[:-1])
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("name", BAD_ANSWERS)
def test_check_remote_fails_the_server_with_the_same_line(capsys, name):
    behaviour, _ = BAD_ANSWERS[name]
    with FakeSglang(**behaviour) as server:
        rows = check_remote([server.url], credentials=None)
        code = main(["check-remote", server.url])
    out = capsys.readouterr().out.splitlines()
    line = expected_line(name, server.url)
    assert not rows[0].ok and rows[0].problems == [line] and rows[0].generation_s is None
    assert code == 1
    assert out[1].split()[:2] == [server.url, "PROBLEM"] and out[2:] == [f"! {line}"], out


def test_check_remote_passes_a_server_that_sends_8_bit_rgb(capsys):
    with FakeSglang() as server:
        assert main(["check-remote", server.url]) == 0
    assert capsys.readouterr().out.splitlines()[1].split()[:2] == [server.url, "ready"]


# ------------------------------------------------------------------------------------------------- in ComfyUI
def test_the_comfyui_sampler_on_a_remote_pipe_stops_with_the_line():
    with FakeSglang(image_b64=base64.b64encode(NOT_8_BIT_RGB["16-bit grayscale (I;16)"][0]).decode()) as server:
        pipe = ErnieImageRemoteBackend().connect(server_urls=server.url, connect_timeout_s=2.0,
                                                 read_timeout_s=30.0)["result"][0]
        with pytest.raises(Exception) as caught:
            ErnieImageTurboSampler().generate(pipe=pipe, prompt="x", resolution="custom", width=SIDE, height=SIDE,
                                              steps=8, cfg=1.0, seed=0, batch_size=1, shift=4.0, use_pe=False)
        pipe.release()
    assert str(caught.value) == refusal(server.url, "a 16-bit grayscale PNG")


@pytest.mark.parametrize("name", WHOLE_PIXELS)
@pytest.mark.parametrize("truncated_allowed", [False, True], ids=["", "LOAD_TRUNCATED_IMAGES set"])
def test_a_png_whose_pixels_are_all_there_is_used_as_pillow_uses_it(monkeypatch, name, truncated_allowed):
    monkeypatch.setattr(ImageFile, "LOAD_TRUNCATED_IMAGES", truncated_allowed)
    image = decode_image(base64.b64encode(WHOLE_PIXELS[name]).decode(), SIDE, SIDE, "srv")
    assert (image * 255).round().tolist() == [[[16.0, 32.0, 48.0]] * SIDE] * SIDE
