"""Image in: where sampling starts from an image (img2img, a hires second pass) and what inpainting keeps.

ComfyUI's KSampler semantics throughout (comfy/samplers.py, v0.8.0):
- denoise d < 1 runs the last `steps` sigmas of the schedule of int(steps / d) steps (KSampler.set_steps);
- the start latent is sigma0 * noise + (1 - sigma0) * x0 with the seed's usual noise (CONST.noise_scaling);
- with a mask, before every model call the latent outside the mask is set to the original noised to the current
  sigma, and the model's clean estimate outside the mask is replaced by the original (KSamplerX0Inpaint): for
  flow matching that is velocity' = m * v + (1 - m) * (x - x0) / sigma, after which an Euler step lands exactly on
  the original noised to the next sigma outside a binary mask.
The mask is resized to the latent grid bilinearly, as comfy.utils.reshape_mask does.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional

import torch
import torch.nn.functional as F

from ..core.errors import InvalidInputError
from ..core.request import repaints_unseen
from .schedule import shifted_sigmas

FULL_DENOISE = 0.9999  # KSampler.set_steps: above this the whole schedule runs
# Multiply-adds one piece of the feather's blur does at most between cancel checks: tens of ms on two CPU cores.
BLUR_PIECE_BUDGET = 1 << 27


def denoise_sigmas(steps: int, shift: float, denoise: float) -> torch.Tensor:
    """The steps+1 sigmas that run for `denoise`: the tail of the int(steps / denoise)-step schedule."""
    if denoise > FULL_DENOISE:
        return shifted_sigmas(steps, shift)
    return shifted_sigmas(int(steps / denoise), shift)[-(steps + 1):]


def needs_encoding(request) -> bool:
    """Whether the job needs the init image's latents: a partial denoise or a mask. denoise 1.0 without a mask
    starts from pure noise, exactly text-to-image, so the image only sets the size."""
    return request.init_image is not None and (request.denoise <= FULL_DENOISE or request.mask is not None)


def _no_cancel() -> None:
    return None


def pixel_mask(request, check_cancel: Callable[[], None] = _no_cancel) -> Optional[torch.Tensor]:
    """The repaint mask at pixel (or the given latent-grid) size, grown and feathered: float32 [B|1, 1, H, W].
    `check_cancel` (a host's: raises Cancelled) is called between pieces of the work, which a wide feather makes
    take seconds."""
    if request.mask is None:
        return None
    mask = request.mask.detach().to("cpu", torch.float32)
    mask = mask.reshape(-1, 1, mask.shape[-2], mask.shape[-1])
    if request.mask_grow > 0:
        mask = grown(mask, request.mask_grow, check_cancel)
    if request.mask_feather > 0:
        mask = gaussian_blur(mask, request.mask_feather, check_cancel)
    return mask.clamp(0, 1)


def refuse_masks_repainting_nothing(mask: Optional[torch.Tensor], request) -> None:
    """A repaint mask (pixel_mask's) that mask_grow and mask_feather leave with no value above 1/255 (a small area
    feathered over a wide one) repaints less than one level of any pixel: refused before the run, as a mask that
    does so as given is (core/request.py)."""
    if mask is None:
        return
    per_image = mask.flatten(1).amax(dim=1)
    unseen = [index for index, largest in enumerate(per_image.tolist()) if repaints_unseen(largest)]
    if unseen:
        which = "mask" if per_image.numel() == 1 else f"mask {unseen[0]} of the batch's {per_image.numel()}"
        changed = [f"{verb} by {name} {getattr(request, name)}" for verb, name in
                   (("grown", "mask_grow"), ("feathered", "mask_feather")) if getattr(request, name)]
        raise InvalidInputError(
            f"{which}, {' and '.join(changed)}, reaches only {float(per_image[unseen[0]]):.4f}: it repaints less than "
            "one level of any pixel, so the image would come back unchanged: feather less, or paint a larger area"
        ).naming("mask_grow", "mask_feather", "mask")


def grown(mask: torch.Tensor, radius: int, check_cancel: Callable[[], None] = _no_cancel) -> torch.Tensor:
    """The mask dilated by a (2 * radius + 1)-pixel square, as max_pool2d(kernel 2 * radius + 1, padding radius)
    computes it for a mask in 0..1: each axis in turn, its window maxima built by doubling spans (a span of 2s is
    the larger of two spans of s), so the work grows with log(radius), not with radius squared (max_pool2d took 11 s
    for radius 64 on a 1024x1024 mask, and hours for 1024). `check_cancel` is called between the doubling passes."""
    for dim in (-1, -2):
        mask = _window_maxima(mask, radius, dim, check_cancel)
    return mask


def _window_maxima(x: torch.Tensor, radius: int, dim: int, check_cancel: Callable[[], None]) -> torch.Tensor:
    """Along `dim`, each value's maximum over [i - radius, i + radius], zeros past the edges (the values are >= 0,
    and a window holds its own centre, so the zeros change no maximum)."""
    length = 2 * radius + 1
    x = F.pad(x, (radius, radius, 0, 0) if dim == -1 else (0, 0, radius, radius))
    spanned, span = x, 1  # spanned[i]: the maximum over x[i : i + span]
    while 2 * span <= length:
        check_cancel()
        size = spanned.size(dim) - span
        spanned = torch.maximum(spanned.narrow(dim, 0, size), spanned.narrow(dim, span, size))
        span *= 2
    size = x.size(dim) - length + 1
    return torch.maximum(spanned.narrow(dim, 0, size), spanned.narrow(dim, length - span, size))


def gaussian_blur(mask: torch.Tensor, radius: int, check_cancel: Callable[[], None] = _no_cancel) -> torch.Tensor:
    """Separable Gaussian of standard deviation radius/2 over 2*radius+1 pixels, edges replicated. The horizontal
    pass runs in bands of rows and the vertical one in bands of columns, each band at most BLUR_PIECE_BUDGET
    multiply-adds with `check_cancel` called before it: at 2048x2048 and radius 1024 the blur takes seconds."""
    offsets = torch.arange(-radius, radius + 1, dtype=torch.float32)
    kernel = torch.exp(-0.5 * (offsets / (radius / 2)) ** 2)
    kernel = kernel / kernel.sum()
    padded = F.pad(mask, (radius, radius, radius, radius), mode="replicate")
    blurred = _conv_in_bands(padded, kernel.view(1, 1, 1, -1), -2, check_cancel)
    return _conv_in_bands(blurred, kernel.view(1, 1, -1, 1), -1, check_cancel)


def _conv_in_bands(x: torch.Tensor, kernel: torch.Tensor, dim: int, check_cancel: Callable[[], None]) -> torch.Tensor:
    """F.conv2d(x, kernel) for one channel and a kernel one pixel long along `dim` (-2: rows, -1: columns), in bands
    along `dim`: each output reads the same inputs as in one whole call, and gets the same value bit for bit."""
    across = -1 if dim == -2 else -2
    outputs_per_line = x.shape[0] * (x.shape[across] - kernel.shape[across] + 1)
    bands = []
    for start, count in _bands(x.shape[dim], outputs_per_line * kernel.numel()):
        check_cancel()
        bands.append(F.conv2d(x.narrow(dim, start, count), kernel))
    return torch.cat(bands, dim=dim)


def _bands(lines: int, cost_per_line: int) -> list[tuple[int, int]]:
    """(first line, line count) of the fewest bands of nearly equal size that cost at most BLUR_PIECE_BUDGET each (or
    are one line). Bit for bit with one call: torch's CPU conv2d computes a one-image input of at most 20480 values
    with a GEMM whose sums depend on the shape, and a larger one or a batch with oneDNN, whose values do not; a pass
    within the budget is one band, and a band of several costs about half the budget or more, which with at most
    2049 taps (mask_feather 1024) and sides of at most 4096 makes it over 28000 values."""
    count = min(lines, max(1, -(-lines * cost_per_line // BLUR_PIECE_BUDGET)))
    size, larger = divmod(lines, count)
    starts = [index * size + min(index, larger) for index in range(count + 1)]
    return [(start, end - start) for start, end in zip(starts, starts[1:])]


def latent_mask(mask: torch.Tensor, latent_shape: torch.Size) -> torch.Tensor:
    """A pixel mask [B|1, 1, H, W] on the latent grid [B, 1, h, w] (comfy.utils.reshape_mask: bilinear)."""
    height, width = latent_shape[-2], latent_shape[-1]
    if mask.shape[-2:] != (height, width):
        mask = F.interpolate(mask, size=(height, width), mode="bilinear")
    return mask.expand(latent_shape[0], 1, height, width)


@dataclass(frozen=True)
class StartState:
    """Where sample_euler starts and what it keeps: its sigmas, the original latents and the repaint mask."""

    sigmas: torch.Tensor  # float32 [steps + 1], terminal 0
    x0: torch.Tensor  # normalised original latents [B, 128, h, w], float32 on the sampling device
    mask: Optional[torch.Tensor] = None  # [B, 1, h, w] in 0..1 on the device, 1 = repaint; None: the whole image

    def start_latents(self, noise: torch.Tensor) -> torch.Tensor:
        return self.noised(noise, float(self.sigmas[0]))

    def noised(self, noise: torch.Tensor, sigma: float) -> torch.Tensor:
        return sigma * noise + (1.0 - sigma) * self.x0

    def before_step(self, latents: torch.Tensor, noise: torch.Tensor, sigma: float) -> torch.Tensor:
        """Outside the mask the latent is the original noised to this step's sigma."""
        if self.mask is None:
            return latents
        return latents * self.mask + self.noised(noise, sigma) * (1.0 - self.mask)

    def velocity(self, latents: torch.Tensor, velocity: torch.Tensor, sigma: float) -> torch.Tensor:
        """Outside the mask the model's clean estimate is the original: the velocity that leads to it."""
        if self.mask is None:
            return velocity
        return velocity * self.mask + (latents - self.x0) / sigma * (1.0 - self.mask)


def start_state(request, x0: Optional[torch.Tensor], device: torch.device,
                mask: Optional[torch.Tensor]) -> Optional[StartState]:
    """The start for `request` given the original latents (None: text-to-image, the sampler's own start) and its
    repaint mask (pixel_mask's, made once a job)."""
    if x0 is None:
        return None
    x0 = x0.to(device, torch.float32)
    if x0.shape[0] != request.batch:
        x0 = x0.expand(request.batch, *x0.shape[1:])
    grid = latent_mask(mask, x0.shape).to(device) if mask is not None else None
    return StartState(denoise_sigmas(request.steps, request.shift, request.denoise), x0, grid)


def init_latents(request) -> Optional[torch.Tensor]:
    """The original latents the request brings itself (a LATENT input); None when they come from encoding."""
    return request.init_latents.detach().to(torch.float32) if request.init_latents is not None else None


def composite(images: torch.Tensor, request, mask: Optional[torch.Tensor]) -> torch.Tensor:
    """Inpainting with `composite`: the original pixels outside the repaint mask (pixel_mask's: grown, feathered),
    exactly."""
    if mask is None or request.init_image is None or not request.composite:
        return images
    if mask.shape[-2:] != images.shape[1:3]:
        mask = F.interpolate(mask, size=images.shape[1:3], mode="bilinear")
    mask = mask.permute(0, 2, 3, 1)  # [B|1, H, W, 1]
    original = request.init_image.detach().to(images.device, torch.float32)
    blended = images * mask + original * (1.0 - mask)
    return torch.where(mask == 0, original.expand_as(images), blended).contiguous()


__all__ = ["StartState", "composite", "denoise_sigmas", "init_latents", "needs_encoding",
           "pixel_mask", "refuse_masks_repainting_nothing", "start_state"]
