"""mask_grow dilates the repaint mask by a (2 * mask_grow + 1)-pixel square, as ComfyUI's max-pool dilation does, and
its cost does not grow with the square of the radius: max_pool2d took 11 s for mask_grow 64 on a 1024x1024 mask and
would take hours for the largest allowed (1024), before any sampling."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

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
