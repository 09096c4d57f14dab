"""read_png_settings keeps its promise for files built to break it: every one is an InvalidInputError naming the
file in one line (never RecursionError, Pillow's ValueError, a hang, or NaN settings), and a PNG damaged in
transit is called damaged, not "not an image"."""
from __future__ import annotations

import io
import os
import struct
import threading
import zlib
from pathlib import Path

import pytest
from PIL import Image
from PIL.PngImagePlugin import PngInfo

from ernie_image.runtime.core.errors import InvalidInputError
from ernie_image.runtime.files.png_output import read_png_settings


def _png(text: str = "", compressed: bool = False) -> bytes:
    info = PngInfo()
    if text:
        info.add_text("ernie-image", text, zip=compressed)
    buffer = io.BytesIO()
    Image.new("RGB", (4, 4)).save(buffer, format="PNG", pnginfo=info)
    return buffer.getvalue()


def _chunk(kind: bytes, data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)


def _with_chunk_before_idat(png: bytes, chunk: bytes) -> bytes:
    at = png.index(b"IDAT") - 4
    return png[:at] + chunk + png[at:]


def _refusal(path: Path) -> str:
    with pytest.raises(InvalidInputError) as caught:
        read_png_settings(path)
    message = str(caught.value)
    assert "\n" not in message and str(path) in message, message
    return message


def test_deeply_nested_settings_are_not_the_settings_ernie_image_writes(tmp_path):
    """Was RecursionError from json.loads."""
    path = tmp_path / "nested.png"
    path.write_bytes(_png("[" * 100_000))
    assert "its 'ernie-image' text is not the settings ernie-image writes" in _refusal(path)


@pytest.mark.parametrize("payload", [lambda: os.urandom(2 << 20).hex().encode(), lambda: b"\0" * (64 << 20)],
                         ids=["large zTXt", "zlib bomb"])
def test_a_text_chunk_beyond_pillows_limit_is_refused_naming_the_file(tmp_path, payload):
    """Was Pillow's `ValueError: Decompressed data too large for PngImagePlugin.MAX_TEXT_CHUNK`."""
    path = tmp_path / "big.png"
    ztxt = _chunk(b"zTXt", b"ernie-image\0\0" + zlib.compress(payload(), 6))
    path.write_bytes(_with_chunk_before_idat(_png(), ztxt))
    message = _refusal(path)
    assert "text chunk larger than" in message and "not a PNG that ernie-image wrote" in message, message


def test_a_fifo_named_png_is_refused_at_once_not_read_forever(tmp_path):
    path = tmp_path / "x.png"
    os.mkfifo(path)
    outcome: list[BaseException] = []
    reader = threading.Thread(target=lambda: outcome.append(pytest.raises(InvalidInputError, read_png_settings, path)
                                                            .value), daemon=True)
    reader.start()
    reader.join(10)
    if reader.is_alive():  # unblock the reader (a writer opening the FIFO ends its open) before failing
        with open(path, "wb"):
            pass
        pytest.fail("read_png_settings blocked on a FIFO")
    assert str(outcome[0]) == (f"{path} is not a regular file (a pipe, device or socket): give a PNG that "
                               "ernie-image wrote")


def test_a_folder_named_png_is_refused_as_a_folder(tmp_path):
    path = tmp_path / "x.png"
    path.mkdir()
    assert _refusal(path) == f"{path} is a folder: give a PNG that ernie-image wrote"


@pytest.mark.parametrize("text, value", [('{"seed": NaN}', "NaN"), ('{"width": 1e999}', "1e999"),
                                         ('{"cfg": -Infinity}', "-Infinity"), ('{"a": [1, {"b": 2e400}]}', "2e400")])
def test_settings_with_non_finite_numbers_are_refused(tmp_path, text, value):
    """Were returned as NaN / inf without a word."""
    path = tmp_path / "nan.png"
    path.write_bytes(_png(text))
    message = _refusal(path)
    assert f"holds the number {value}, which ernie-image never writes" in message, message


def test_finite_settings_still_read_back(tmp_path):
    path = tmp_path / "ok.png"
    path.write_bytes(_png('{"seed": 7, "cfg": 4.5, "width": 1e3, "nested": [1.5, {"x": -2}]}', compressed=True))
    assert read_png_settings(path) == {"seed": 7, "cfg": 4.5, "width": 1000.0, "nested": [1.5, {"x": -2}]}


def test_a_png_whose_text_chunk_has_a_bad_checksum_is_called_damaged(tmp_path):
    """Was "is not a PNG file (not an image at all)" for a real PNG with one flipped byte."""
    png = bytearray(_png('{"seed": 7}'))
    png[png.index(b'"seed"')] ^= 0x01  # a byte of the text flipped: its chunk's CRC no longer matches
    path = tmp_path / "damaged.png"
    path.write_bytes(bytes(png))
    message = _refusal(path)
    assert message == (f"{path} is a damaged PNG file (a chunk's checksum does not match its data): copy the file "
                       "again from where it came from"), message
