"""What a generation asks for and what it returns; shared by the local runtime and the remote backend."""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any, Optional

import torch

from .errors import InvalidInputError

MIN_SIDE = 256
MAX_SIDE = 4096
SIDE_MULTIPLE = 16
SEED_MASK = (1 << 63) - 1

# Baidu's recommended settings per model.
VARIANT_DEFAULTS: dict[str, dict[str, float]] = {
    "base": {"steps": 50, "cfg": 4.0},
    "turbo": {"steps": 8, "cfg": 1.0},
}

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
    for name, value in (("width", width), ("height", height)):
        if value % SIDE_MULTIPLE or not MIN_SIDE <= value <= MAX_SIDE:
            raise InvalidInputError(
                f"{name} {value} is not allowed: ERNIE-Image needs a multiple of {SIDE_MULTIPLE} between "
                f"{MIN_SIDE} and {MAX_SIDE}; use {nearest_valid_side(value)}"
            )


_INT_FIELDS = ("width", "height", "steps", "seed", "batch", "pe_max_new_tokens")
_NUMBER_FIELDS = ("cfg", "shift", "pe_temperature", "pe_top_p")


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
            raise InvalidInputError(f"{name} {value!r} is not allowed: give {kind}")


def _check_texts(request: "GenerationRequest") -> None:
    """Every prompt is a str that encodes as UTF-8 (a None prompt or an undecodable argv byte is named here)."""
    texts = [("prompt", request.prompt), ("negative_prompt", request.negative_prompt)]
    texts += [(f"prompt {index + 1}", text) for index, text in enumerate(request.prompts or ())]
    for name, text in texts:
        if not isinstance(text, str):
            raise InvalidInputError(f"{name} {text!r} is not allowed: give text (an empty string for none)")
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as error:
            raise InvalidInputError(f"{name} is not valid UTF-8 text (undecodable byte at character {error.start}): "
                                    "save the prompt as UTF-8") from None


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

    def validate(self) -> None:
        _check_types(self)
        _check_texts(self)
        validate_size(self.width, self.height)
        if self.steps is not None and not 1 <= self.steps <= 1000:
            raise InvalidInputError(f"steps {self.steps} is not allowed: use 1..1000 (50 for ERNIE-Image, 8 for Turbo)")
        if not 1 <= self.batch <= 64:
            raise InvalidInputError(f"batch {self.batch} is not allowed: use 1..64")
        if not 0 <= self.seed <= SEED_MASK:
            raise InvalidInputError(f"seed {self.seed} is not allowed: use 0..{SEED_MASK}")
        if self.cfg is not None and (not math.isfinite(self.cfg) or self.cfg < 0 or self.cfg > 100):
            raise InvalidInputError(f"cfg {self.cfg} is not allowed: use 0..100 (4.0 for ERNIE-Image, 1.0 for Turbo)")
        if not math.isfinite(self.shift) or self.shift <= 0:
            raise InvalidInputError(f"shift {self.shift} is not allowed: use a positive value (4.0 is Baidu's)")
        if self.prompts is not None and len(self.prompts) != self.batch:
            raise InvalidInputError(f"{len(self.prompts)} prompts given for batch {self.batch}: give one per image")

    def with_defaults(self, variant: str) -> "GenerationRequest":
        """This request with the steps and CFG left at None set to `variant`'s recommended values."""
        defaults = VARIANT_DEFAULTS[variant]
        return dataclasses.replace(
            self, steps=int(defaults["steps"]) if self.steps is None else self.steps,
            cfg=float(defaults["cfg"]) if self.cfg is None else self.cfg)

    @property
    def uses_cfg(self) -> bool:
        if self.cfg is None:
            raise ValueError("the request's cfg is not resolved yet: call with_defaults(variant) first")
        return self.cfg > 1.0

    def prompt_list(self) -> list[str]:
        return list(self.prompts) if self.prompts is not None else [self.prompt] * self.batch

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
        }


@dataclass
class GenerationResult:
    images: torch.Tensor  # float32 [B, H, W, 3] in 0..1 on the CPU (ComfyUI's IMAGE)
    latents: Optional[torch.Tensor]  # normalised DiT-space latents [B, 128, H/16, W/16] (ComfyUI LATENT), None remotely
    prompts_used: list[str]
    info: dict[str, Any] = field(default_factory=dict)  # timings, memory, server details; shown to the user
    # The request as it ran: steps and CFG resolved to the pipe's variant defaults, sizes as sent (remote rounding).
    request: Optional[GenerationRequest] = None
