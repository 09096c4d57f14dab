"""Images as PNG files with the settings that made them in their text metadata (key `ernie-image`, JSON)."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Mapping

import torch

from .errors import ErnieImageError, InvalidInputError
from .output_files import atomic_outputs

METADATA_KEY = "ernie-image"


def png_paths(out: Path, count: int) -> list[Path]:
    """`out` for one image; `name_0.png`, `name_1.png`, ... for a batch."""
    out = Path(out)
    if count == 1:
        return [out]
    return [out.with_name(f"{out.stem}_{index}{out.suffix}") for index in range(count)]


def save_pngs(images: torch.Tensor, out: Path, settings: Mapping[str, Any]) -> list[Path]:
    """Write images [B, H, W, 3] in 0..1 as PNGs (see png_paths) with `settings` (+ batch_index) as metadata.

    The batch is written whole or not at all: a failure or Ctrl-C leaves no file of it behind and the files it
    would replace as they were (see atomic_outputs for when a cancel stops applying). Settings must hold no secrets; they are readable
    by anyone who has the image (read_png_settings)."""
    from PIL import Image
    from PIL.PngImagePlugin import PngInfo

    out = Path(out)
    paths = png_paths(out, images.shape[0])
    try:
        with atomic_outputs(paths) as partials:
            for index, partial in enumerate(partials):
                info = PngInfo()
                info.add_text(METADATA_KEY, json.dumps({**settings, "batch_index": index}))
                pixels = (images[index].clamp(0, 1) * 255).round().to("cpu").byte().numpy()
                Image.fromarray(pixels, mode="RGB").save(partial, format="PNG", pnginfo=info)
    except OSError as error:
        raise ErnieImageError(f"cannot write {out}: {error.strerror or error}: pick a writable --out path") from None
    return paths


def read_png_settings(path: Path) -> dict[str, Any]:
    """The settings save_pngs recorded in a PNG (an empty dict when it has none). A file that is not a readable PNG,
    or settings that are not JSON, is an InvalidInputError naming the file."""
    from PIL import Image, UnidentifiedImageError

    try:
        with Image.open(path) as image:
            if image.format != "PNG":
                raise InvalidInputError(f"{path} is not a PNG file ({image.format} image): give a PNG that "
                                        "ernie-image wrote")
            text = image.text.get(METADATA_KEY)
    except UnidentifiedImageError:
        raise InvalidInputError(f"{path} is not a PNG file (not an image at all): give a PNG that ernie-image "
                                "wrote") from None
    except Image.DecompressionBombError:
        raise InvalidInputError(f"{path} claims more pixels than any image ernie-image writes (a decompression "
                                "bomb): give a PNG that ernie-image wrote") from None
    except OSError as error:  # missing, a folder, unreadable, cut short
        raise InvalidInputError(f"{path} cannot be read as a PNG file ({error.strerror or error}): check the path "
                                "and that the file is complete") from None
    if not text:
        return {}
    try:
        settings = json.loads(text)
    except ValueError:
        settings = None
    if not isinstance(settings, dict):
        raise InvalidInputError(f"{path}: its {METADATA_KEY!r} text is not the settings ernie-image writes: the file "
                                "was edited or made by another program")
    return settings
