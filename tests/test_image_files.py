"""Image files are read the way ComfyUI's Load Image reads them (nodes.py LoadImage, v0.8.0), in one place for the
CLI and the library: upright by their EXIF orientation, 'I' images scaled by 1/255, every frame of an animated file
as a batch (an MPO camera file: its first picture), so a file gives the same pixels in a workflow and here."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from ernie_image.runtime.core.errors import InvalidInputError
from ernie_image.runtime.files.image_files import read_image, read_mask

ROTATE_90_CLOCKWISE_TO_VIEW = 6  # EXIF Orientation: how a phone held upright stores a portrait photo


def _sideways_portrait() -> np.ndarray:
    """A portrait scene 256 wide, 320 tall, stored as the sensor saw it: 320 wide, 256 tall, its top (red) on the
    left."""
    stored = np.zeros((256, 320, 3), np.uint8)
    stored[:, :, 2] = 255  # blue
    stored[:, :64] = (255, 0, 0)  # the scene's top 64 rows
    return stored


def _with_orientation(path: Path, pixels: np.ndarray, orientation: int = ROTATE_90_CLOCKWISE_TO_VIEW) -> Path:
    exif = Image.Exif()
    exif[0x0112] = orientation
    Image.fromarray(pixels).save(path, exif=exif.tobytes(), **({"quality": 95} if path.suffix == ".jpg" else {}))
    assert Image.open(path).getexif()[0x0112] == orientation  # the tag is in the file as written
    return path


@pytest.mark.parametrize("suffix", [".png", ".jpg"])
def test_a_portrait_phone_photo_is_read_upright(tmp_path, suffix):
    image = read_image(_with_orientation(tmp_path / f"portrait{suffix}", _sideways_portrait()))
    assert tuple(image.shape) == (1, 320, 256, 3)  # portrait, not sideways
    red = image[0, :64, :, 0].mean() - image[0, :64, :, 2].mean()
    blue = image[0, 64:, :, 2].mean() - image[0, 64:, :, 0].mean()
    assert red > 0.9 and blue > 0.9, (float(red), float(blue))  # the scene's top is at the top


def test_a_mask_is_turned_upright_by_the_same_rule(tmp_path):
    stored = np.zeros((256, 320), np.uint8)
    stored[:, :64] = 255  # repaint the scene's top
    mask = read_mask(_with_orientation(tmp_path / "mask.png", stored))
    assert tuple(mask.shape) == (1, 320, 256)
    assert float(mask[0, :64].min()) == 1.0 and float(mask[0, 64:].max()) == 0.0


def test_an_animated_mask_is_a_batch_of_its_frames_as_the_image_is(tmp_path):
    """Load Image's MASK of an animated file holds every frame; a mask for a batch of two is not its first frame
    twice."""
    frames = [Image.fromarray(np.full((256, 256), value, np.uint8)) for value in (255, 0, 128)]
    animated = tmp_path / "animated_mask.png"
    frames[0].save(animated, save_all=True, append_images=frames[1:])
    mask = read_mask(animated)
    assert tuple(mask.shape) == (3, 256, 256)
    assert [round(float(frame.mean()) * 255) for frame in mask] == [255, 0, 128]


def test_a_16_bit_mask_is_told_to_be_saved_as_8_bit_grayscale(tmp_path):
    path = tmp_path / "deep_mask.png"
    Image.fromarray(np.full((256, 256), 40000, np.uint16)).save(path)
    with pytest.raises(InvalidInputError, match="save it as 8-bit grayscale$"):
        read_mask(path)


def test_a_frame_of_another_size_is_refused_not_dropped(tmp_path):
    """Load Image leaves such a frame out without a word: the batch would be an image short."""
    path = tmp_path / "pages.tiff"
    pages = [Image.fromarray(np.full((256, 256), 255, np.uint8)), Image.fromarray(np.zeros((128, 128), np.uint8))]
    pages[0].save(path, save_all=True, append_images=pages[1:])
    for read in (read_image, read_mask):
        with pytest.raises(InvalidInputError, match=r"its frame 2 is 128x128, the first 256x256: save the frames to "
                                                    r"use as a file of one size$"):
            read(path)


def test_a_32_bit_integer_mask_is_told_to_be_saved_as_8_bit_grayscale(tmp_path):
    """Load Image scales such a picture by 1/255: a mask of 0 and 255 would repaint 1/255 of a pixel."""
    path = tmp_path / "mask_i.tiff"
    Image.fromarray(np.full((256, 256), 255, np.int32), mode="I").save(path)
    with pytest.raises(InvalidInputError, match=r"is a 32-bit integer image \(mode I\): .* save it as 8-bit grayscale$"):
        read_mask(path)


def test_an_upright_photo_is_read_as_stored(tmp_path):
    pixels = _sideways_portrait()
    image = read_image(_with_orientation(tmp_path / "upright.png", pixels, orientation=1))
    assert np.array_equal((image[0].numpy() * 255).round().astype(np.uint8), pixels)


def test_a_32_bit_integer_image_is_scaled_by_1_255_as_load_image_scales_it(tmp_path):
    path = tmp_path / "deep.tiff"
    Image.fromarray(np.full((256, 256), 40000, np.int32), mode="I").save(path)
    assert Image.open(path).mode == "I"
    image = read_image(path)
    assert tuple(image.shape) == (1, 256, 256, 3)
    assert float(image.min()) == float(image.max()) == pytest.approx(156 / 255)  # int(40000 / 255) / 255


def test_an_animated_file_is_a_batch_of_its_frames_and_an_mpo_its_first_picture(tmp_path):
    frames = [Image.fromarray(np.full((256, 256, 3), value, np.uint8)) for value in (0, 128, 255)]
    animated = tmp_path / "animated.png"
    frames[0].save(animated, save_all=True, append_images=frames[1:])
    image = read_image(animated)
    assert tuple(image.shape) == (3, 256, 256, 3)
    assert [round(float(frame.mean()) * 255) for frame in image] == [0, 128, 255]
    camera = tmp_path / "camera.mpo"
    frames[1].save(camera, format="MPO", save_all=True, append_images=[frames[2]])
    assert Image.open(camera).format == "MPO" and Image.open(camera).n_frames == 2
    image = read_image(camera)
    assert tuple(image.shape) == (1, 256, 256, 3) and abs(float(image.mean()) * 255 - 128) < 2


@pytest.mark.parametrize("pixels, depth", [
    (np.full((256, 256), 40000, np.uint16), "16-bit image \\(mode I;16\\)"),
    (np.full((256, 256), 0.5, np.float32), "32-bit floating-point image \\(mode F\\)"),
])
def test_a_high_depth_file_load_image_would_turn_white_is_refused_naming_its_depth(tmp_path, pixels, depth):
    path = tmp_path / "deep.tiff"
    Image.fromarray(pixels).save(path)
    with pytest.raises(InvalidInputError, match=f"is a {depth}: ERNIE-Image reads 8-bit images: save it as 8-bit RGB"):
        read_image(path)


def test_the_library_reads_images_with_the_same_reader():
    import ernie_image

    assert ernie_image.read_image is read_image and ernie_image.read_mask is read_mask


def test_the_cli_generates_a_portrait_from_a_portrait_phone_photo(tmp_path, tiny_turbo_folder):
    from ernie_image.runtime.cli.commands import main

    photo = _with_orientation(tmp_path / "IMG_0001.jpg", _sideways_portrait())
    out = tmp_path / "out.png"
    assert main(["generate", "--model-dir", str(tiny_turbo_folder), "--init-image", str(photo), "--denoise", "0.5",
                 "--steps", "1", "--device", "cpu", "--out", str(out)]) == 0
    assert Image.open(out).size == (256, 320)


def test_a_coloured_mask_is_refused_in_one_line_rather_than_read_as_a_weak_grey(tmp_path) -> None:
    """A pure red stroke's grey level is 0.30: read silently, it would repaint at 30%."""
    from PIL import Image

    from ernie_image.runtime.core.errors import InvalidInputError
    from ernie_image.runtime.files.image_files import read_mask

    red = Image.new("RGB", (32, 32))
    red.paste((255, 0, 0), (8, 8, 24, 24))
    red.save(tmp_path / "red.png")
    with pytest.raises(InvalidInputError, match="has coloured pixels: a mask is read from its grey level"):
        read_mask(tmp_path / "red.png")
    grey = Image.new("RGB", (32, 32))
    grey.paste((255, 255, 255), (8, 8, 24, 24))
    grey.save(tmp_path / "white.jpg", quality=70)
    assert float(read_mask(tmp_path / "white.jpg").max()) > 0.9  # a JPEG's near-grey pixels are still a mask
