"""What a server's answer to an image request must hold: exactly the images asked for, each an 8-bit RGB PNG of the
size asked for, opaque and of one frame.

sglang 0.5.23 answers `{"data": [one entry per image], ...}`; asked for `output_format: png`, each image is an 8-bit
RGB PNG (the uint8 pixels its pipeline makes; every answer seen from a real server was RGB). Anything else comes from
a server, or something in front of it, that is misbehaving; converting it would hide that (a 16-bit grayscale PNG
turned pure white, an alpha channel dropped, a second image thrown away), so it is refused in one line naming the
server and what it sent, before a pixel is decoded wherever the PNG's header tells.
"""
from __future__ import annotations

import base64
import binascii
import io
import struct
import warnings
import zlib
from typing import Any, Optional

import numpy as np
import torch
from PIL import Image, ImageFile, UnidentifiedImageError

from ..net.errors import BadResponse

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
RGB_COLOR_TYPE = 2  # the PNG colour type of RGB without alpha
MISBEHAVING = "refused, the server is misbehaving: check the server and the model it runs (its log and its version)"
ADAM7_PASSES = ((0, 0, 8, 8), (4, 0, 8, 8), (0, 4, 4, 8), (2, 0, 4, 4), (0, 2, 2, 4), (1, 0, 2, 2), (0, 1, 1, 2))
# PNG colour type -> (its name, what follows "PNG")
_COLOR_TYPES = {0: ("grayscale", ""), 2: ("RGB", ""), 3: ("palette", ""), 4: ("grayscale", " with an alpha channel"),
                6: ("RGBA", "")}


def answered_images(body: Any, asked: int, label: str) -> list[Any]:
    """The b64_json of each image in a generation's JSON answer; exactly `asked` (the request's n) of them."""
    if not isinstance(body, dict):
        raise BadResponse(f"{label} answered the generation with {type(body).__name__}, not a JSON object")
    data = body.get("data")
    if not isinstance(data, list):
        raise BadResponse(f"{label} answered the generation without images (no 'data'); see the server log")
    if len(data) != asked:
        sent = "no image" if not data else f"{len(data)} image{'s' if len(data) > 1 else ''}"
        raise BadResponse(f"{label} sent {sent} for the {asked} asked for (n={asked}): {MISBEHAVING}")
    if not all(isinstance(entry, dict) for entry in data):
        raise BadResponse(f"{label} answered the generation with an image entry that is not a JSON object; see the "
                          f"server log")
    return [entry.get("b64_json") for entry in data]


def _image_format(raw: bytes) -> Optional[str]:
    """The format Pillow reads from the header of `raw` (not a PNG), or None for bytes that are no image it knows.
    Only the header is read: nothing is decoded."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            with Image.open(io.BytesIO(raw)) as image:
                return image.format or None
    except (UnidentifiedImageError, Image.DecompressionBombError, OSError, ValueError):
        return None


def _png_depth_and_color(raw: bytes) -> tuple[int, int]:
    """(bits per sample, colour type) from the IHDR chunk a PNG opens with (ValueError when it does not)."""
    if len(raw) < 26 or raw[12:16] != b"IHDR" or struct.unpack(">I", raw[8:12])[0] != 13:
        raise ValueError("the PNG does not open with its IHDR chunk")
    return raw[24], raw[25]


def png_kind(depth: int, color_type: int, transparent_color: bool = False, frames: int = 1) -> str:
    """The PNG in words, as the user is told what a server sent: "a 16-bit grayscale PNG"."""
    name, after = _COLOR_TYPES.get(color_type, (f"colour type {color_type}", ""))
    text = f"{'an' if depth == 8 else 'a'} {depth}-bit {name} PNG{after}"
    if transparent_color:
        text += " with transparency (a tRNS chunk)"
    if frames > 1:
        text += f", animated ({frames} frames)"
    return text


def _refuse_unless_8_bit_rgb(image: Image.Image, raw: bytes, label: str) -> None:
    """An opened PNG that is not one opaque frame of 8-bit RGB is refused, naming what it is."""
    depth, color_type = _png_depth_and_color(raw)
    transparent_color = "transparency" in image.info
    frames = getattr(image, "n_frames", 1)
    if (depth, color_type) == (8, RGB_COLOR_TYPE) and image.mode == "RGB" and not transparent_color and frames == 1:
        return
    raise BadResponse(f"{label} sent {png_kind(depth, color_type, transparent_color, frames)}, not the 8-bit RGB PNG "
                      f"an SGLang server makes: {MISBEHAVING}")


def _filtered_rgb_bytes(width: int, height: int, interlaced: bool) -> int:
    """How many bytes an 8-bit RGB PNG's pixels inflate to: each row of each pass, 3 bytes a pixel and a filter byte."""
    passes = ADAM7_PASSES if interlaced else ((0, 0, 1, 1),)
    total = 0
    for x0, y0, dx, dy in passes:
        columns, rows = -(-(width - x0) // dx), -(-(height - y0) // dy)
        if columns > 0 and rows > 0:
            total += rows * (1 + 3 * columns)
    return total


def _rgb_pixels_all_there(raw: bytes, width: int, height: int) -> bool:
    """Whether an 8-bit RGB PNG holds every byte of its pixels, as Pillow checks it unless something in the process
    set ImageFile.LOAD_TRUNCATED_IMAGES (some ComfyUI node packs do): Pillow then fills what is missing with black
    and says nothing. As for Pillow, the pixels are what counts: a missing or cut IEND, or data past the pixels, do
    not matter."""
    offset, compressed = 8, []
    while offset + 8 <= len(raw):  # the chunks, the last perhaps cut short
        length, kind = struct.unpack(">I", raw[offset:offset + 4])[0], raw[offset + 4:offset + 8]
        if kind == b"IDAT":
            compressed.append(raw[offset + 8:offset + 8 + length])
        if kind == b"IEND":
            break
        offset += 12 + length
    expected = _filtered_rgb_bytes(width, height, interlaced=raw[28] == 1)
    try:  # inflated no further than the image's own size
        return len(zlib.decompressobj().decompress(b"".join(compressed), expected)) == expected
    except zlib.error:
        return False


def decode_image(b64: Any, width: int, height: int, label: str) -> torch.Tensor:
    """base64 PNG -> float32 [H, W, 3] in 0..1. It must be a PNG of the size asked for, one frame of opaque 8-bit RGB;
    size and kind are checked from the header, before any pixel is decoded."""
    if not isinstance(b64, str) or not b64:
        raise BadResponse(f"{label} returned no image data (b64_json is empty): is response_format supported?")
    try:
        raw = base64.b64decode(b64, validate=True)
    except (binascii.Error, ValueError):
        raise BadResponse(f"{label} returned an image that is not valid base64; see the server log") from None
    if not raw.startswith(PNG_SIGNATURE):
        other = _image_format(raw)
        if other is not None:  # decoded, it would pass for the lossless PNG the request asked for
            raise BadResponse(f"{label} sent a {other} image, not the PNG asked for: refused (the server ignored "
                              f"output_format png): check its version")
    try:
        with warnings.catch_warnings():
            # Pillow warns (several lines on stderr) of a header claiming a huge image: refused below, in one line.
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            image = Image.open(io.BytesIO(raw))
        with image:
            size = image.size  # from the header: a wrong size is refused before any pixel is decoded
            if size != (width, height):
                raise BadResponse(
                    f"{label} returned a {size[0]}x{size[1]} image for a {width}x{height} request, refused before "
                    f"decoding: the server may floor sizes or be misconfigured; check its version and its log"
                )
            _refuse_unless_8_bit_rgb(image, raw, label)
            if ImageFile.LOAD_TRUNCATED_IMAGES and not _rgb_pixels_all_there(raw, width, height):
                raise OSError("image file is truncated")  # as Pillow says it when the flag is not set
            image.load()
            array = np.asarray(image, dtype=np.float32)  # one float copy of the pixels, scaled in place
    except Image.DecompressionBombError:
        raise BadResponse(f"{label} returned an image whose header claims far more pixels than the {width}x{height} "
                          f"asked for (a decompression bomb), refused before decoding: check the server's version "
                          f"and its log, and that the URL is the SGLang server's") from None
    except (UnidentifiedImageError, OSError, ValueError) as exc:
        raise BadResponse(f"{label} returned bytes that are not a readable image ({type(exc).__name__}); see the "
                          f"server log and check its version") from None
    array /= 255.0
    return torch.from_numpy(array)
