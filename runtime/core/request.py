"""What a generation asks for and what it returns; shared by the local runtime and the remote backend."""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any, Optional

import torch

from .errors import InvalidInputError
from .number_text import not_allowed
from .step_cache_config import StepCacheConfig
from .variant import VARIANT_DEFAULTS

MIN_SIDE = 256
MAX_SIDE = 4096
SIDE_MULTIPLE = 16
SIDE_RANGE = (MIN_SIDE, MAX_SIDE)  # a side is also a multiple of SIDE_MULTIPLE
SEED_MASK = (1 << 63) - 1
SEED_RANGE = (0, SEED_MASK)

# Baidu's ~1 MP presets (width, height).
RESOLUTION_PRESETS: tuple[tuple[int, int], ...] = (
    (1024, 1024),
    (848, 1264),
    (1264, 848),
    (896, 1200),
    (1200, 896),
    (768, 1376),
    (1376, 768),
)


def nearest_valid_side(value: int) -> int:
    snapped = (value + SIDE_MULTIPLE // 2) // SIDE_MULTIPLE * SIDE_MULTIPLE  # half rounds up: 1000 -> 1008
    return max(MIN_SIDE, min(MAX_SIDE, snapped))


def validate_size(width: int, height: int) -> None:
    """Refuse a side that is not a multiple of SIDE_MULTIPLE within the range, naming every such side."""
    bad = [(name, value) for name, value in (("width", width), ("height", height))
           if value % SIDE_MULTIPLE or not MIN_SIDE <= value <= MAX_SIDE]
    if not bad:
        return
    if len(bad) == 1:
        (name, value), = bad
        raise InvalidInputError(
            f"{name} {value} is not allowed: ERNIE-Image needs a multiple of {SIDE_MULTIPLE} between "
            f"{MIN_SIDE} and {MAX_SIDE}; use {nearest_valid_side(value)}"
        ).naming(name)
    raise InvalidInputError(
        f"width {width} and height {height} are not allowed: ERNIE-Image needs multiples of {SIDE_MULTIPLE} between "
        f"{MIN_SIDE} and {MAX_SIDE}; use {nearest_valid_side(width)}x{nearest_valid_side(height)}"
    ).naming("width", "height")


_INT_FIELDS = ("width", "height", "steps", "seed", "batch", "pe_max_new_tokens")
_NUMBER_FIELDS = ("cfg", "shift", "pe_temperature", "pe_top_p")
_BOOL_FIELDS = ("use_pe", "composite")  # a string "false" would read as true


_VARIANT_DEFAULT_FIELDS = ("steps", "cfg")  # None in a request: the pipe's variant default (VARIANT_DEFAULTS)


def _check_types(request: "GenerationRequest") -> None:
    """A wrong type from a caller (a float step count) is named here, not deep inside torch."""
    for name in _INT_FIELDS + _NUMBER_FIELDS:
        value = getattr(request, name)
        if value is None and name in _VARIANT_DEFAULT_FIELDS:
            continue
        allowed = (int,) if name in _INT_FIELDS else (int, float)
        if isinstance(value, bool) or not isinstance(value, allowed):
            kind = "a whole number" if name in _INT_FIELDS else "a number"
            raise InvalidInputError(f"{name} {value!r} is not allowed: give {kind}").naming(name)
    for name in _BOOL_FIELDS:
        value = getattr(request, name)
        if not isinstance(value, bool):
            raise InvalidInputError(f"{name} {value!r} is not allowed: give True or False").naming(name)


def _check_texts(request: "GenerationRequest") -> None:
    """Every prompt is a str that encodes as UTF-8 (a None prompt or an undecodable argv byte is named here)."""
    texts = [("prompt", request.prompt), ("negative_prompt", request.negative_prompt)]
    texts += [(f"prompt {index + 1}", text) for index, text in enumerate(request.prompts or ())]
    for name, text in texts:
        if not isinstance(text, str):
            raise InvalidInputError(f"{name} {text!r} is not allowed: give text (an empty string for none)").naming(name)
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as error:
            raise InvalidInputError(f"{name} is not valid UTF-8 text (undecodable byte at character {error.start}): "
                                    "save the prompt as UTF-8").naming(name) from None


MAX_MASK_PIXELS = 1024  # mask_grow / mask_feather limit
MASK_PIXELS_RANGE = (0, MAX_MASK_PIXELS)
# Words of the image checks a front end may say its own way (named by errors.naming: ComfyUI adds its nodes).
RESIZE_IT = "resize or crop it"
MASK_OF_ITS_SIZE = "a mask of the image's size"
LOCAL_PIPE = "a local pipe (LocalPipe)"
# LATENT channel counts of other model families, for the message that names what was connected.
OTHER_LATENTS = {4: "an SD1.5/SDXL LATENT (4 channels)", 16: "a FLUX.1 / SD3 LATENT (16 channels)",
                 32: "an unpatchified FLUX.2 VAE latent (32 channels)"}


def _image_size_problem(width: int, height: int, what: str) -> Optional[str]:
    """Image inputs follow text-to-image's size rule: refused (never resized or cropped) with the nearest size."""
    ok = all(v % SIDE_MULTIPLE == 0 and MIN_SIDE <= v <= MAX_SIDE for v in (width, height))
    if ok:
        return None
    return (f"{what} is {width}x{height}: ERNIE-Image needs sides that are multiples of {SIDE_MULTIPLE} between "
            f"{MIN_SIDE} and {MAX_SIDE}: {RESIZE_IT} to {nearest_valid_side(width)}x{nearest_valid_side(height)} "
            "first")


MAX_BATCH = 64  # images one run makes at most
BATCH_RANGE = (1, MAX_BATCH)
STEPS_RANGE = (1, 1000)
CFG_RANGE = (0.0, 100.0)
# denoise: the last `steps` of a schedule of int(steps / denoise) steps, which a tiny denoise makes endless
DENOISE_RANGE = (0.01, 1.0)
SHIFT_RANGE = (0.01, 100.0)  # the flow-matching shift; beyond it the timesteps collapse to 0 or 1 (ComfyUI's range)
# the prompt enhancer's sampling
TEMPERATURE_RANGE = (0.0, 5.0)
TOP_P_RULE = "a value in (0, 1]"  # open at 0, so no LOW..HIGH range
MAX_NEW_TOKENS_RANGE = (1, 8192)


def _check_batch(count: int, batch: int, setting: str) -> None:
    """`setting` (init_image, init_latents, mask) holds one image for the whole batch or one per image."""
    if count not in (1, batch):
        larger = f", or set batch to {count}" if count <= MAX_BATCH else f" (a batch takes up to {MAX_BATCH} images)"
        given = "give one" if batch == 1 else f"give one (used for every image) or {batch}"
        raise InvalidInputError(f"{setting} holds {count} images but the run makes {batch}: {given}{larger}"
                                ).naming(setting, "batch")


def _check_init_image(request: "GenerationRequest") -> tuple[int, int]:
    image = request.init_image
    if not isinstance(image, torch.Tensor) or image.ndim != 4 or not image.is_floating_point():
        shape = tuple(image.shape) if isinstance(image, torch.Tensor) else type(image).__name__
        raise InvalidInputError(f"init_image {shape} is not an IMAGE: give float RGB [batch, height, width, 3] in 0..1"
                                ).naming("init_image")
    channels = image.shape[-1]
    if channels == 4:
        raise InvalidInputError("init_image has an alpha channel (RGBA): ERNIE-Image takes RGB: drop or flatten "
                                "the alpha first (give it as the mask to repaint the transparent part)"
                                ).naming("init_image")
    if channels != 3:
        raise InvalidInputError(f"init_image has {channels} channels: ERNIE-Image takes RGB [batch, height, width, 3]"
                                ).naming("init_image")
    if not bool(torch.isfinite(image).all()) or float(image.min()) < 0 or float(image.max()) > 1:
        raise InvalidInputError("init_image holds values outside 0..1 (or NaN): give float RGB in 0..1"
                                ).naming("init_image")
    height, width = int(image.shape[1]), int(image.shape[2])
    problem = _image_size_problem(width, height, "init_image")
    if problem:
        raise InvalidInputError(problem).naming("init_image", RESIZE_IT)
    _check_batch(int(image.shape[0]), request.batch, "init_image")
    return width, height


def _check_init_latents(request: "GenerationRequest") -> tuple[int, int]:
    latents = request.init_latents
    if not isinstance(latents, torch.Tensor) or not latents.is_floating_point():
        raise InvalidInputError(f"init_latents {type(latents).__name__} is not a LATENT tensor: give a float tensor "
                                "[batch, 128, height/16, width/16]").naming("init_latents")
    if latents.ndim == 5:
        raise InvalidInputError(f"init_latents {tuple(latents.shape)} is a video LATENT: ERNIE-Image takes an image "
                                "LATENT [batch, 128, height/16, width/16]").naming("init_latents")
    channels = int(latents.shape[1]) if latents.ndim == 4 else None
    if channels != 128:
        what = OTHER_LATENTS.get(channels, f"a LATENT of shape {tuple(latents.shape)}")
        raise InvalidInputError(f"init_latents is {what}, not ERNIE-Image's [batch, 128, height/16, width/16]: "
                                "VAE Encode the image with the FLUX.2 VAE (flux2-vae) or give the image itself"
                                ).naming("init_latents")
    if not bool(torch.isfinite(latents).all()):
        raise InvalidInputError("init_latents holds NaN or infinite values: give a LATENT from a finished run"
                                ).naming("init_latents")
    height, width = int(latents.shape[2]) * 16, int(latents.shape[3]) * 16
    problem = _image_size_problem(width, height, "init_latents (as pixels)")
    if problem:
        raise InvalidInputError(problem).naming("init_latents", RESIZE_IT)
    _check_batch(int(latents.shape[0]), request.batch, "init_latents")
    return width, height


def _check_mask(request: "GenerationRequest", width: int, height: int) -> None:
    mask = request.mask
    if not isinstance(mask, torch.Tensor) or mask.ndim not in (2, 3, 4) or (mask.ndim == 4 and mask.shape[1] != 1):
        shape = tuple(mask.shape) if isinstance(mask, torch.Tensor) else type(mask).__name__
        raise InvalidInputError(f"mask {shape} is not a MASK: give [batch, height, width] or [height, width] in 0..1")
    if not request.has_image_input:
        raise InvalidInputError("mask given without init_image or init_latents to repaint: give the image too"
                                ).naming("mask", "init_image", "init_latents")
    mask_h, mask_w = int(mask.shape[-2]), int(mask.shape[-1])
    latent_grid = request.init_image is None and (mask_w, mask_h) == (width // 16, height // 16)
    if (mask_w, mask_h) != (width, height) and not latent_grid:
        raise InvalidInputError(f"mask is {mask_w}x{mask_h} but the image is {width}x{height}: give "
                                f"{MASK_OF_ITS_SIZE}").naming("mask", MASK_OF_ITS_SIZE)
    if not bool(torch.isfinite(mask).all()) or float(mask.min()) < 0 or float(mask.max()) > 1:
        raise InvalidInputError("mask holds values outside 0..1 (or NaN): give a MASK in 0..1 (1 = repaint)")
    _check_batch(int(mask.shape[0]) if mask.ndim > 2 else 1, request.batch, "mask")
    _refuse_empty_masks(mask)
    for name in ("mask_grow", "mask_feather"):
        value = getattr(request, name)
        if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= MAX_MASK_PIXELS:
            raise not_allowed(name, repr(value), MASK_PIXELS_RANGE, " pixels").naming(name)


def repaints_unseen(largest: float) -> bool:
    """Whether a mask whose largest value is `largest` repaints at most one level of any 8-bit pixel (1/255, as an
    8-bit mask file or its float32 copy holds it)."""
    return largest * 255 < 1 + 1e-4


def _refuse_empty_masks(mask: torch.Tensor) -> None:
    """A mask that marks nothing to repaint would give the init image back after a whole run: all 0 (most often
    ComfyUI's Load Image mask of an image without transparency, connected by habit), or no value above 1/255 (a
    mask saved as 0 and 1 rather than 0 and 255). After mask_grow and mask_feather: sampling/image_in.py."""
    per_image = mask.reshape(-1, mask.shape[-2] * mask.shape[-1]).amax(dim=1).float()
    unseen = [index for index, largest in enumerate(per_image.tolist()) if repaints_unseen(largest)]
    if not unseen:
        return
    which = "mask" if per_image.numel() == 1 else f"mask {unseen[0]} of the batch's {per_image.numel()}"
    largest = float(per_image[unseen[0]])
    if largest == 0:
        raise InvalidInputError(f"{which} is all 0: it marks nothing to repaint, so the image would come back "
                                "unchanged (Load Image's mask of a picture without transparency is all 0): paint the "
                                "area to repaint (1), or leave the mask out to redraw the whole image").naming("mask")
    raise InvalidInputError(f"{which}'s largest value is {largest:.4f} ({largest * 255:.0f} of 255): it repaints less "
                            "than one level of any pixel, so the image would come back unchanged (a mask saved as 0 "
                            "and 1 rather than 0 and 255?): paint the area to repaint white (1)").naming("mask")


def _check_image_inputs(request: "GenerationRequest") -> None:
    """denoise, init image / latent, mask: each bad input named in one line, before any weights are read."""
    denoise = request.denoise
    if isinstance(denoise, bool) or not isinstance(denoise, (int, float)) \
            or not DENOISE_RANGE[0] <= denoise <= DENOISE_RANGE[1]:  # NaN fails the range test too
        raise not_allowed("denoise", repr(denoise), DENOISE_RANGE, " (1.0 redraws everything)").naming("denoise")
    if request.init_image is not None and request.init_latents is not None:
        raise InvalidInputError("both init_image and init_latents were given: give one of them"
                                ).naming("init_image", "init_latents")
    if not request.has_image_input:
        if denoise < 1:
            raise InvalidInputError(f"denoise {denoise:g} needs init_image or init_latents to start from: give one, "
                                    "or set denoise to 1.0").naming("denoise", "init_image", "init_latents")
        if request.mask is not None:
            _check_mask(request, request.width, request.height)
        return
    width, height = _check_init_image(request) if request.init_image is not None else _check_init_latents(request)
    if (request.width, request.height) != (width, height):
        raise InvalidInputError(f"width/height {request.width}x{request.height} differ from the init input's "
                                f"{width}x{height}: set them to its size (the image decides the size)"
                                ).naming("width", "height")
    if request.mask is not None:
        _check_mask(request, width, height)


@dataclass(frozen=True)
class GenerationRequest:
    prompt: str
    negative_prompt: str = ""
    width: int = 1024
    height: int = 1024
    # None: the variant's recommended value (50 steps, CFG 4 for ERNIE-Image; 8 steps, CFG 1 for Turbo), filled in
    # by the pipe that runs the request (with_defaults); the result's `request` holds the values used.
    steps: Optional[int] = None
    cfg: Optional[float] = None
    shift: float = 4.0
    seed: int = 0
    batch: int = 1
    use_pe: bool = False
    pe_temperature: float = 0.6
    pe_top_p: float = 0.95
    pe_max_new_tokens: int = 512
    # Per-image prompts for a batch whose prompts differ; when set its length must equal `batch`.
    prompts: Optional[tuple[str, ...]] = None
    # Image in (img2img, inpainting, a hires second pass). At most one of init_image (ComfyUI IMAGE: float32
    # [B, H, W, 3] in 0..1) and init_latents (normalised DiT latents [B, 128, H/16, W/16], ComfyUI's FLUX.2 LATENT);
    # width and height must be its size. A batch of 1 serves every image of `batch`.
    init_image: Optional[torch.Tensor] = field(default=None, compare=False, repr=False)
    init_latents: Optional[torch.Tensor] = field(default=None, compare=False, repr=False)
    denoise: float = 1.0  # ComfyUI KSampler's: the last `steps` of a schedule of int(steps / denoise) steps
    mask: Optional[torch.Tensor] = field(default=None, compare=False, repr=False)  # [B, H, W] / [H, W], 1 = repaint
    mask_grow: int = 0  # pixels the mask is grown by before use
    mask_feather: int = 0  # pixels of soft edge after growing
    composite: bool = True  # paste the result onto the original pixels outside the mask (needs init_image)
    # Whose settings steps and cfg are: "base" or "turbo" (the Sampler nodes say theirs), None when nobody says. A pipe
    # of the other variant runs them with a notice (variant.settings_notice), never silently.
    settings_for: Optional[str] = None
    # A block-residual step cache for the DiT (step_cache/; local pipes only), None for none.
    step_cache: Optional[StepCacheConfig] = None

    def validate(self) -> None:
        _check_types(self)
        _check_texts(self)
        if self.settings_for not in (None, *VARIANT_DEFAULTS):
            raise InvalidInputError(f"settings_for {self.settings_for!r} is not allowed: give 'base', 'turbo' or None"
                                    ).naming("settings_for")
        _check_image_inputs(self)  # first: a bad image's size is named as the image's, not as width/height
        validate_size(self.width, self.height)
        if self.steps is not None and not STEPS_RANGE[0] <= self.steps <= STEPS_RANGE[1]:
            raise not_allowed("steps", str(self.steps), STEPS_RANGE, " (50 for ERNIE-Image, 8 for Turbo)"
                              ).naming("steps")
        if not 1 <= self.batch <= MAX_BATCH:
            raise not_allowed("batch", str(self.batch), BATCH_RANGE).naming("batch")
        if not 0 <= self.seed <= SEED_MASK:
            raise not_allowed("seed", str(self.seed), SEED_RANGE).naming("seed")
        if self.cfg is not None and (not math.isfinite(self.cfg) or not CFG_RANGE[0] <= self.cfg <= CFG_RANGE[1]):
            raise not_allowed("cfg", str(self.cfg), CFG_RANGE, " (4.0 for ERNIE-Image, 1.0 for Turbo)").naming("cfg")
        if not math.isfinite(self.shift) or not SHIFT_RANGE[0] <= self.shift <= SHIFT_RANGE[1]:
            raise not_allowed("shift", str(self.shift), SHIFT_RANGE, " (4.0 is Baidu's)").naming("shift")
        if self.prompts is not None and len(self.prompts) != self.batch:
            raise InvalidInputError(f"{len(self.prompts)} prompts given for batch {self.batch}: give one per image")
        if self.step_cache is not None:
            if not isinstance(self.step_cache, StepCacheConfig):
                raise InvalidInputError(f"step_cache {self.step_cache!r} is not a StepCacheConfig: give "
                                        "ernie_image.StepCacheConfig(...) or None").naming("step_cache")
            self.step_cache.validate(self.steps)

    def as_enhanced(self, revised: bool) -> "GenerationRequest":
        """This request as it ran: `use_pe` off when the prompt enhancer revised nothing (the model has none, or its
        endpoint failed and the original prompts were used, each with a notice), so the settings a PNG records give
        the same image again."""
        return self if revised or not self.use_pe else dataclasses.replace(self, use_pe=False)

    def with_defaults(self, variant: str) -> "GenerationRequest":
        """This request with the steps and CFG left at None set to `variant`'s recommended values."""
        defaults = VARIANT_DEFAULTS[variant]
        return dataclasses.replace(
            self, steps=int(defaults["steps"]) if self.steps is None else self.steps,
            cfg=float(defaults["cfg"]) if self.cfg is None else self.cfg)

    @property
    def has_image_input(self) -> bool:
        return self.init_image is not None or self.init_latents is not None

    @property
    def is_inpainting(self) -> bool:
        return self.mask is not None

    @property
    def uses_cfg(self) -> bool:
        if self.cfg is None:
            raise ValueError("the request's cfg is not resolved yet: call with_defaults(variant) first")
        return self.cfg > 1.0

    def prompt_list(self) -> list[str]:
        return list(self.prompts) if self.prompts is not None else [self.prompt] * self.batch

    def unused_negative_notice(self) -> Optional[str]:
        """The notice for a negative prompt that cannot act (None when it acts or there is none): at CFG 1 or below
        no unconditional pass runs, here or on an SGLang server, so the negative prompt never reaches the image."""
        if not self.negative_prompt.strip() or self.uses_cfg:
            return None
        return (f"the negative prompt has no effect at CFG {self.cfg:g} (only above CFG 1, e.g. ERNIE-Image's 4.0): "
                "raise CFG for it to act, or leave it out")

    def metadata(self) -> dict[str, Any]:
        """Settings worth recording next to the image (PNG text, node output). Never secrets."""
        return {
            "prompt": self.prompt,
            "negative_prompt": self.negative_prompt,
            "width": self.width,
            "height": self.height,
            "steps": self.steps,
            "cfg": self.cfg,
            "shift": self.shift,
            "seed": self.seed,
            "batch": self.batch,
            "use_pe": self.use_pe,
            **self._image_metadata(),
            **({"step_cache": self.step_cache.metadata()} if self.step_cache is not None else {}),
        }

    def _image_metadata(self) -> dict[str, Any]:
        """What the image inputs were, as flags and numbers (the tensors themselves stay out)."""
        if not self.has_image_input:
            return {}
        info: dict[str, Any] = {"init": "image" if self.init_image is not None else "latent", "denoise": self.denoise}
        if self.mask is not None:
            info.update(inpaint=True, mask_grow=self.mask_grow, mask_feather=self.mask_feather,
                        composite=self.composite and self.init_image is not None)
        return info


def refuse_image_inputs(request: GenerationRequest, backend: str) -> None:
    """A backend without image inputs says so in one line instead of ignoring the image."""
    if request.has_image_input or request.mask is not None:
        raise InvalidInputError(f"image inputs (img2img, inpainting) are not supported by {backend}: run them on "
                                f"{LOCAL_PIPE}, or leave out init_image, init_latents and mask"
                                ).naming(LOCAL_PIPE, "init_image", "init_latents", "mask")


@dataclass
class GenerationResult:
    images: torch.Tensor  # float32 [B, H, W, 3] in 0..1 on the CPU (ComfyUI's IMAGE)
    latents: Optional[torch.Tensor]  # normalised DiT-space latents [B, 128, H/16, W/16] (ComfyUI LATENT), None remotely
    prompts_used: list[str]
    info: dict[str, Any] = field(default_factory=dict)  # timings, memory, server details; shown to the user
    # The request as it ran: steps and CFG resolved to the pipe's variant defaults, sizes as sent (remote rounding).
    request: Optional[GenerationRequest] = None
