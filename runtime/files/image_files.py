"""Image and mask files read into ComfyUI's IMAGE and MASK tensors: the one reader of the CLI and the library.

Read the way ComfyUI's Load Image reads them (nodes.py LoadImage, v0.8.0), so a file gives the same pixels here as
in a workflow: turned upright by its EXIF orientation (a portrait phone photo stays portrait), a 32-bit integer
('I') image scaled by 1/255 as 16-bit data, every frame of an animated file as a batch
(an MPO camera file: its first picture only), RGB at 8 bits, divided by 255.

Where Load Image would give wrong pixels without a word, the file is refused in one line instead: 16-bit ('I;16')
and float ('F') files (Load Image clips them to white: save them as 8-bit RGB), transparent pixels (flatten them, or
paint the area to repaint as a mask; a fully opaque alpha channel carries nothing and is dropped), a frame of another
size than the first (Load Image drops it), a 32-bit integer mask (its 1/255 scaling would make a white mask repaint
1/255), damaged or truncated files. Sizes are never resized or cropped: a side that is not a multiple of 16 is refused by the request
with the nearest valid size. A mask is read from its grey level (white = repaint), upright and frame by frame by
the same rules (Load Image's MASK of an animated file is a batch too).
"""
from __future__ import annotations

from pathlib import Path
from typing import Any, Iterator

import numpy as np
import torch

from ..core.errors import InvalidInputError, one_line
from ..core.request import MAX_SIDE
from .file_kind import not_a_regular_file

HIGH_DEPTH_MODES = ("I;16", "I;16B", "I;16L", "I;16N", "F")
MAX_FRAMES = 64  # a batch's largest size: more frames can never be a valid init image
PILLOW_ERRORS = (OSError, ValueError, SyntaxError, KeyError, IndexError, TypeError)  # what a damaged file raises


def _unreadable(path: Path, setting: str, error: BaseException) -> InvalidInputError:
    return InvalidInputError(f"{setting} {path} is not a readable image ({one_line(error, 120)}): give a PNG or JPEG "
                             "file (re-save it if it is damaged)").naming(setting)


def _open(path: Path, setting: str, eight_bit: str = "8-bit RGB"):
    """The image file opened and decoded; `eight_bit`: what a 16-bit or floating-point one is told to be saved as."""
    from PIL import Image, UnidentifiedImageError

    what = not_a_regular_file(path)
    if what is not None:
        raise InvalidInputError(f"{setting} {path} {what}: give the path of a PNG or JPEG file").naming(setting)
    try:
        image = Image.open(path)
        # the size from the header first: an image far beyond any size ERNIE-Image takes is refused undecoded
        if image.width * image.height > 4 * MAX_SIDE * MAX_SIDE:
            raise InvalidInputError(f"{setting} {path} is {image.width}x{image.height}: ERNIE-Image takes sides up to "
                                    f"{MAX_SIDE}: resize it first").naming(setting)
        image.load()
    except Image.DecompressionBombError:
        raise InvalidInputError(f"{setting} {path} claims more pixels than any image ERNIE-Image takes (sides up to "
                                f"{MAX_SIDE}): resize it first, or re-save it if it is damaged"
                                ).naming(setting) from None
    except (UnidentifiedImageError, *PILLOW_ERRORS) as error:
        raise _unreadable(path, setting, error) from None
    if image.mode in HIGH_DEPTH_MODES:
        depth = "16-bit" if "16" in image.mode else "32-bit floating-point"
        raise InvalidInputError(f"{setting} {path} is a {depth} image (mode {image.mode}): ERNIE-Image reads 8-bit "
                                f"images: save it as {eight_bit}").naming(setting)
    return image


def _upright(frame, path: Path, setting: str):
    """One frame as Load Image takes it: turned by its EXIF orientation; 'I' (32-bit integer) scaled by 1/255."""
    from PIL import ImageOps

    try:
        frame = ImageOps.exif_transpose(frame)
    except PILLOW_ERRORS as error:  # an orientation tag Pillow cannot apply: the picture would come out turned
        raise InvalidInputError(f"{setting} {path} has EXIF data that cannot be read ({one_line(error, 120)}): "
                                "re-save it (without EXIF, turned upright)").naming(setting) from None
    if frame.mode == "I":
        frame = frame.point(lambda value: value * (1 / 255))
    return frame


def _frames(image, path: Path, setting: str) -> Iterator[Any]:
    """Every frame, upright; a frame of another size than the first is refused (Load Image drops it); an MPO file's
    first picture only."""
    from PIL import ImageSequence

    count = getattr(image, "n_frames", 1)
    if image.format != "MPO" and count > MAX_FRAMES:
        raise InvalidInputError(f"{setting} {path} has {count} frames: a batch takes up to {MAX_FRAMES} images: save "
                                "the frame to start from as a PNG").naming(setting)
    size = None
    try:
        for number, frame in enumerate(ImageSequence.Iterator(image), start=1):
            upright = _upright(frame, path, setting)
            size = size or upright.size
            if upright.size != size:  # Load Image drops it without a word: the batch would lose an image
                raise InvalidInputError(f"{setting} {path}: its frame {number} is {upright.size[0]}x{upright.size[1]}, "
                                        f"the first {size[0]}x{size[1]}: save the frames to use as a file of one "
                                        "size").naming(setting)
            yield upright
            if image.format == "MPO":
                return
    except InvalidInputError:
        raise
    except PILLOW_ERRORS as error:  # a later frame cut short or damaged
        raise _unreadable(path, setting, error) from None


def _has_alpha(image) -> bool:
    return image.mode in ("RGBA", "LA", "PA") or (image.mode == "P" and "transparency" in image.info)


def _opaque(image, refusal: InvalidInputError):
    """`image` without its alpha channel when every pixel is opaque; `refusal` (the one-line error) otherwise."""
    if not _has_alpha(image):
        return image
    rgba = image.convert("RGBA")
    if rgba.getextrema()[3][0] < 255:
        raise refusal
    return rgba


def read_image(path: Path, setting: str = "path") -> torch.Tensor:
    """An image file -> float32 [frames, H, W, 3] in 0..1 (ComfyUI's IMAGE; one frame for a still image).
    `setting`: the setting errors name the file by (the CLI passes "init_image", which it shows as --init-image)."""
    path = Path(path)
    refusal = InvalidInputError(f"{setting} {path} has transparent pixels (alpha): flatten it onto a background and "
                                "save it as RGB, or paint the area to repaint into a mask").naming(setting, "mask")
    frames = [np.asarray(_opaque(frame, refusal).convert("RGB"), dtype=np.float32) / 255.0
              for frame in _frames(_open(path, setting), path, setting)]
    return torch.from_numpy(np.stack(frames))


COLOUR_TOLERANCE = 8  # JPEG rounding puts grey pixels a few levels off grey; a stroke of colour is far more


def read_mask(path: Path, setting: str = "path") -> torch.Tensor:
    """A mask file -> float32 [frames, H, W] in 0..1: its grey level, white = repaint, black = keep; every frame of
    the file, upright, as read_image reads the init image's frames (one a batch image).
    `setting`: as read_image's (the CLI passes "mask")."""
    path = Path(path)
    refusal = InvalidInputError(f"{setting} {path} has transparent pixels: a mask is read from its grey level "
                                "(white = repaint): save it as grayscale without alpha").naming(setting)
    image = _open(path, setting, "8-bit grayscale")
    if image.mode == "I":  # Load Image scales a picture of this mode by 1/255: a 0/255 mask would repaint 1/255
        raise InvalidInputError(f"{setting} {path} is a 32-bit integer image (mode I): a mask is read from an 8-bit "
                                "grey level: save it as 8-bit grayscale").naming(setting)
    greys = [_grey(_opaque(frame, refusal), path, setting) for frame in _frames(image, path, setting)]
    return torch.from_numpy(np.stack(greys))


def _grey(image, path: Path, setting: str) -> np.ndarray:
    """A mask frame's grey level in 0..1 [H, W]; a frame with coloured pixels is refused."""
    if image.mode not in ("1", "L", "I", "I;16", "F"):
        channels = np.asarray(image.convert("RGB"), dtype=np.int16)
        if (channels.max(axis=-1) - channels.min(axis=-1)).max() > COLOUR_TOLERANCE:
            raise InvalidInputError(f"{setting} {path} has coloured pixels: a mask is read from its grey level "
                                    "(white = repaint), so a red stroke would repaint at 30%; save it as black and "
                                    "white").naming(setting)
    return np.asarray(image.convert("L"), dtype=np.float32) / 255.0
