"""ErnieImageStepCache: pipe -> the same pipe running every job with a block-residual step cache.

Off unless this node is in the graph (or its method is "off"). The settings travel with the job: the result's
request and info record them, and ComfyUI's saved PNG holds this node's widgets in its workflow. The Sampler's
text after a run says how many steps were computed.
"""
from __future__ import annotations

from typing import Any

from ..runtime.core.errors import InvalidInputError
from ..runtime.core.step_cache_config import (DEFAULT_END, DEFAULT_MAX_SKIPS, DEFAULT_START, DEFAULT_THRESHOLD,
                                         MAX_SKIPS_LIMIT, MAX_THRESHOLD, METHODS, OFF, StepCacheConfig)
from ..runtime.step_cache.view import with_step_cache
from .comfy_names import speaks_comfy
from .common import CATEGORY, PIPE_TYPE, shown_on_node

METHOD_DEFAULT = 0  # first_blocks 0: the method's own count (StepCacheConfig's None), so switching method just works


class ErnieImageStepCache:
    DESCRIPTION = (
        "Skips the DiT's middle blocks on steps where its first blocks' output barely changed since the last "
        "computed step, reusing that step's residual (cache-dit's DBCache / First-Block-Cache). Fewer DiT "
        "evaluations for nearly the same picture on ERNIE-Image (50 steps); little to gain on Turbo's 8. Judge it "
        "on your model: same seed with and without this node."
    )
    CATEGORY = CATEGORY
    FUNCTION = "apply"
    RETURN_TYPES = (PIPE_TYPE,)
    RETURN_NAMES = ("pipe",)
    OUTPUT_TOOLTIPS = ("The same model, running every job with this step cache, for a Sampler or a LoRA node.",)

    @classmethod
    def INPUT_TYPES(cls) -> dict[str, Any]:
        return {
            "required": {
                "pipe": (PIPE_TYPE, {"tooltip": "An ERNIE-Image Loader output (or a LoRA node's). Local models "
                                     "only: a Remote Backend's server runs its own DiT."}),
                "method": ([*METHODS, OFF], {"default": METHODS[0],
                                             "tooltip": "dbcache: compare the first first_blocks blocks, always run "
                                             "the last last_blocks (cache-dit's Dual Block Cache). fbcache: compare "
                                             "one first block, no last block (First-Block-Cache). off: no cache."}),
                "threshold": ("FLOAT", {"default": DEFAULT_THRESHOLD, "min": 0.0, "max": MAX_THRESHOLD,
                                        "step": 0.01, "round": 0.001,
                                        "tooltip": "Skip a step's middle blocks when the first blocks' output "
                                        "changed by less than this (relative L1). Higher skips more. 0.08 is "
                                        "cache-dit's default; 0 never skips."}),
                "start": ("FLOAT", {"default": DEFAULT_START, "min": 0.0, "max": 1.0, "step": 0.01,
                                    "tooltip": "Fraction of the steps before which every step is computed (0.15 of "
                                    "50: the first 8). The first step always is."}),
                "end": ("FLOAT", {"default": DEFAULT_END, "min": 0.0, "max": 1.0, "step": 0.01,
                                  "tooltip": "Fraction of the steps from which every step is computed again. The "
                                  "last step always is."}),
                "max_consecutive_skips": ("INT", {"default": DEFAULT_MAX_SKIPS, "min": 1, "max": MAX_SKIPS_LIMIT,
                                                  "tooltip": "At most this many skipped steps in a row; the next "
                                                  "one is computed."}),
            },
            "optional": {
                "first_blocks": ("INT", {"default": METHOD_DEFAULT, "min": 0, "max": 35,
                                         "tooltip": "dbcache: blocks always computed first; their change decides "
                                         "(cache-dit's Fn, 8). More is more precise and skips less work. fbcache: "
                                         "1, the one it computes. 0: the method's own (dbcache 8, fbcache 1)."}),
                "last_blocks": ("INT", {"default": 0, "min": 0, "max": 34,
                                        "tooltip": "dbcache: blocks always computed last, after the cached middle "
                                        "(cache-dit's Bn, 0). fbcache: 0."}),
            },
        }

    @speaks_comfy
    def apply(self, pipe: Any, method: str, threshold: float, start: float, end: float,
              max_consecutive_skips: int, first_blocks: int = METHOD_DEFAULT, last_blocks: int = 0) -> dict[str, Any]:
        if pipe is None or not hasattr(pipe, "generate"):
            raise InvalidInputError("the pipe input is not connected: wire an ERNIE-Image Loader to it")
        if method == OFF:
            view = with_step_cache(pipe, None)
            return shown_on_node("step cache off", view)
        config = StepCacheConfig(method, threshold=float(threshold), start=float(start), end=float(end),
                                 max_skips=int(max_consecutive_skips),
                                 first_blocks=None if first_blocks == METHOD_DEFAULT else int(first_blocks),
                                 last_blocks=int(last_blocks))
        view = with_step_cache(pipe, config)
        # The Sampler after this node decides the steps: the text gives the window as fractions of them.
        return shown_on_node(config.label(), view)
