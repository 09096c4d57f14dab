"""Images as PNG files with the settings that made them in their text metadata (key `ernie-image`, JSON)."""
from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Mapping, Optional, Sequence

import torch

from ..core.errors import InvalidInputError
from ..core.pipe import short_repr
from .file_kind import not_a_regular_file
from .output_files import OutputNotReplaced, atomic_outputs, opened_partial, write_error

METADATA_KEY = "ernie-image"


def png_paths(out: Path, count: int) -> list[Path]:
    """`out` for one image; `name_0.png`, `name_1.png`, ... for a batch."""
    out = Path(out)
    if count == 1:
        return [out]
    return [out.with_name(f"{out.stem}_{index}{out.suffix}") for index in range(count)]


@dataclass(frozen=True)
class PngOutput:
    """Images [B, H, W, 3] in 0..1 to write as PNGs to `out` (png_paths) with `settings` (+ batch_index) as
    metadata; `name`: what the caller calls `out`, which an error writing it names (the CLI shows its flag)."""
    images: torch.Tensor
    out: Path
    settings: Mapping[str, Any]
    name: str = "out"


def save_pngs(images: torch.Tensor, out: Path, settings: Mapping[str, Any],
              before_replacing: Optional[Callable[[], None]] = None) -> list[Path]:
    """Write images [B, H, W, 3] in 0..1 as PNGs (see png_paths) with `settings` (+ batch_index) as metadata.

    The batch is written whole or not at all: a failure or Ctrl-C leaves no file of it behind and the files it
    would replace as they were (see atomic_outputs for when a cancel stops applying). Settings must hold no secrets;
    they are readable by anyone who has the image (read_png_settings). `before_replacing`: see save_png_outputs."""
    return save_png_outputs([PngOutput(images, Path(out), settings)], before_replacing)[0]


def save_png_outputs(outputs: Sequence[PngOutput], before_replacing: Optional[Callable[[], None]] = None
                     ) -> list[list[Path]]:
    """Write several outputs' PNGs as one batch (save_pngs): every file of every output or none. Returns each
    output's paths, in order. `before_replacing` runs once every file is written, just before they replace their
    targets: what it finds there (another command's file: outputs_seen.py) is what they replace."""
    from PIL import Image
    from PIL.PngImagePlugin import PngInfo

    if not outputs:
        return []
    files: list[tuple[PngOutput, int, str]] = []  # (the output, the image's index in it, its settings text)
    for output in outputs:
        check_images(output.images)
        files += [(output, index, _settings_json(output.settings, index)) for index in range(output.images.shape[0])]
    paths = [png_paths(output.out, output.images.shape[0]) for output in outputs]
    writing = outputs[0]  # the output whose file is being written: an error names it
    try:
        with atomic_outputs([path for group in paths for path in group]) as partials:
            for (writing, index, text), partial in zip(files, partials):
                info = PngInfo()
                info.add_text(METADATA_KEY, text)
                pixels = (writing.images[index].clamp(0, 1) * 255).round().to("cpu").byte().numpy()
                with opened_partial(partial) as handle:
                    Image.fromarray(pixels, mode="RGB").save(handle, format="PNG", pnginfo=info)
            if before_replacing is not None:
                before_replacing()
    except OutputNotReplaced as error:  # a rename after every file was written: name the output it was for
        failed = next(output for output, group in zip(outputs, paths) if error.target in group)
        raise write_error(failed.out, error, failed.name) from None
    except OSError as error:
        raise write_error(writing.out, error, writing.name) from None
    return paths


def check_images(images: Any) -> None:
    """Refuse, in one line, images save_pngs cannot write: anything but a float tensor [B, H, W, 3] of finite values
    (Pillow would say "Invalid mode for data type", or write NaN as black without a word)."""
    if not isinstance(images, torch.Tensor):
        raise InvalidInputError(f"images {short_repr(images)} is not a torch.Tensor: give a tensor [B, H, W, 3] of "
                                "floats in 0..1")
    shape = tuple(images.shape)
    if images.dim() != 4 or shape[-1] != 3:
        fix = ("add the batch dimension (images.unsqueeze(0))" if images.dim() == 3 and shape[-1] == 3 else
               "give channels last (images.permute(0, 2, 3, 1))" if images.dim() == 4 and shape[1] == 3 else
               "give RGB images, channels last")
        raise InvalidInputError(f"images of shape {shape} are not a batch [B, H, W, 3]: {fix}")
    if shape[0] == 0:
        raise InvalidInputError("images is an empty batch [0, H, W, 3]: nothing to write; give at least one image")
    if not images.is_floating_point():
        raise InvalidInputError(f"images of dtype {images.dtype} are not floats in 0..1: give images.float() / 255")
    if not bool(torch.isfinite(images).all()):
        raise InvalidInputError("images hold NaN or infinite pixels: the run that made them failed numerically; "
                                "nothing was written")


def _settings_json(settings: Mapping[str, Any], index: int) -> str:
    try:
        return json.dumps({**settings, "batch_index": index}, allow_nan=False)
    except (TypeError, ValueError, RecursionError) as error:
        raise InvalidInputError(f"settings cannot be written as JSON ({error}): give settings of str, int, float, "
                                "bool, None, lists and dicts (finite numbers)") from None


def read_png_settings(path: Path) -> dict[str, Any]:
    """The settings save_pngs recorded in a PNG (an empty dict when it has none). A file that is not a readable PNG,
    or settings that are not JSON, is an InvalidInputError naming the file."""
    from PIL import Image, UnidentifiedImageError

    path = Path(path)
    what = not_a_regular_file(path)
    if what is not None and what != "does not exist":  # a missing file: Pillow's own words below
        raise InvalidInputError(f"{path} {what}: give a PNG that ernie-image wrote")
    try:
        with Image.open(path) as image:
            if image.format != "PNG":
                raise InvalidInputError(f"{path} is not a PNG file ({image.format} image): give a PNG that "
                                        "ernie-image wrote")
            text = image.text.get(METADATA_KEY)
    except InvalidInputError:  # a ValueError too: not one of Pillow's below
        raise
    except (UnidentifiedImageError, SyntaxError):  # Pillow's broken-chunk errors are SyntaxError
        if _starts_as_png(path):
            raise InvalidInputError(f"{path} is a damaged PNG file (a chunk's checksum does not match its data): "
                                    "copy the file again from where it came from") from None
        raise InvalidInputError(f"{path} is not a PNG file (not an image at all): give a PNG that ernie-image "
                                "wrote") from None
    except Image.DecompressionBombError:
        raise InvalidInputError(f"{path} claims more pixels than any image ernie-image writes (a decompression "
                                "bomb): give a PNG that ernie-image wrote") from None
    except OSError as error:  # missing, a folder, unreadable, cut short
        raise InvalidInputError(f"{path} cannot be read as a PNG file ({error.strerror or error}): check the path "
                                "and that the file is complete") from None
    except ValueError:  # Pillow's limits on text chunks (MAX_TEXT_CHUNK, MAX_TEXT_MEMORY): a zTXt bomb too
        from PIL import PngImagePlugin

        raise InvalidInputError(f"{path} has a text chunk larger than {PngImagePlugin.MAX_TEXT_CHUNK >> 20} MiB "
                                "unpacked (ernie-image writes a few KiB): not a PNG that ernie-image wrote") from None
    if not text:
        return {}
    try:
        settings = json.loads(text, parse_constant=_refuse_constant, parse_float=_finite_float)
    except _NonFinite as number:
        raise InvalidInputError(f"{path}: its {METADATA_KEY!r} text holds the number {number}, which ernie-image "
                                "never writes: the file was edited or made by another program") from None
    except (ValueError, RecursionError):  # RecursionError: arrays nested too deep to parse
        settings = None
    if not isinstance(settings, dict):
        raise InvalidInputError(f"{path}: its {METADATA_KEY!r} text is not the settings ernie-image writes: the file "
                                "was edited or made by another program")
    return settings


class _NonFinite(Exception):
    """A NaN or infinite number in settings JSON (its text is the message)."""


def _refuse_constant(text: str) -> float:
    raise _NonFinite(text)  # NaN, Infinity, -Infinity: Python's json extensions, never in what save_pngs writes


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):  # 1e999 parses as inf
        raise _NonFinite(text)
    return value


def _starts_as_png(path: Path) -> bool:
    try:
        with open(path, "rb") as file:
            return file.read(8) == b"\x89PNG\r\n\x1a\n"
    except OSError:
        return False
