"""mask_grow dilates the repaint mask by a (2 * mask_grow + 1)-pixel square, as ComfyUI's max-pool dilation does, and
its cost does not grow with the square of the radius: max_pool2d took 11 s for mask_grow 64 on a 1024x1024 mask and
would take hours for the largest allowed (1024), before any sampling. A mask that growing and feathering leave
repainting less than one level of any pixel is refused before the run."""
from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from PIL import Image

from ernie_image.runtime.cli.commands import main
from ernie_image.runtime.core.request import MAX_MASK_PIXELS
from ernie_image.runtime.sampling.image_in import grown


@pytest.mark.parametrize("shape", [(1, 1, 17, 23), (3, 1, 40, 31), (1, 1, 5, 5)])
@pytest.mark.parametrize("radius", [1, 2, 3, 4, 5, 7, 8, 15, 16, 33])
def test_a_grown_mask_is_max_pool2ds_dilation_value_for_value(shape, radius):
    generator = torch.Generator().manual_seed(radius)
    mask = (torch.rand(shape, generator=generator) > 0.95).float() * torch.rand(shape, generator=generator)
    assert torch.equal(grown(mask, radius), F.max_pool2d(mask, 2 * radius + 1, stride=1, padding=radius))


def test_the_largest_radius_on_a_large_mask_grows_a_pixel_into_its_square_clipped_at_the_edges():
    mask = torch.zeros(1, 1, 2048, 1536)
    mask[0, 0, 1800, 100] = 0.5
    expected = torch.zeros_like(mask)
    expected[0, 0, 1800 - MAX_MASK_PIXELS:, :100 + MAX_MASK_PIXELS + 1] = 0.5
    assert torch.equal(grown(mask, MAX_MASK_PIXELS), expected)


@pytest.mark.parametrize("feather, refused", [(16, True), (0, False)])
def test_a_mask_feathered_to_less_than_one_level_is_refused_before_the_run(capsys, tmp_path, tiny_turbo_folder,
                                                                            dit_steps, feather, refused):
    """One white pixel feathered over 33x33 pixels peaks near 0.0027: no pixel of the picture would change."""
    Image.fromarray((np.random.default_rng(0).random((256, 256, 3)) * 255).astype(np.uint8)).save(tmp_path / "in.png")
    dot = np.zeros((256, 256), np.uint8)
    dot[128, 128] = 255
    Image.fromarray(dot).save(tmp_path / "dot.png")
    out = tmp_path / "out.png"
    code = main(["generate", "--model-dir", str(tiny_turbo_folder), "--init-image", str(tmp_path / "in.png"),
                 "--mask", str(tmp_path / "dot.png"), "--mask-feather", str(feather), "--steps", "1", "--prompt",
                 "a fox", "--out", str(out)])
    line = capsys.readouterr().err.strip().splitlines()[-1]
    if refused:
        assert code == 2 and line == (
            "error: --mask, feathered by --mask-feather 16, reaches only 0.0027: it repaints less than one level of "
            "any pixel, so the image would come back unchanged: feather less, or paint a larger area"), line
        assert not out.exists() and dit_steps == []
    else:
        assert code == 0 and out.exists(), line


def test_a_job_grows_and_feathers_its_mask_once(monkeypatch, tmp_path, tiny_turbo_folder):
    """A wide feather costs seconds: the refusal check, the sampler's start and the composite share one mask."""
    from ernie_image.runtime.sampling import image_in

    feathered = []
    blur = image_in.gaussian_blur
    monkeypatch.setattr(image_in, "gaussian_blur",
                        lambda mask, radius, check_cancel: feathered.append(radius) or blur(mask, radius, check_cancel))
    Image.fromarray((np.random.default_rng(0).random((256, 256, 3)) * 255).astype(np.uint8)).save(tmp_path / "in.png")
    square = np.zeros((256, 256), np.uint8)
    square[64:192, 64:192] = 255
    Image.fromarray(square).save(tmp_path / "square.png")
    assert main(["generate", "--model-dir", str(tiny_turbo_folder), "--init-image", str(tmp_path / "in.png"),
                 "--mask", str(tmp_path / "square.png"), "--mask-feather", "8", "--denoise", "0.7", "--steps", "1",
                 "--prompt", "a fox", "--out", str(tmp_path / "out.png")]) == 0
    assert feathered == [8]
