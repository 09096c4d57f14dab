"""The CLI's names for the settings runtime messages name by their Python names, and the one place they are swapped.

The runtime's checks speak the Python API's and the nodes' language (`mask_grow 5000 is not allowed`); an error
records which of its words are such names (ErnieImageError.naming), and the CLI shows its own flags instead
(`--mask-grow 5000 is not allowed`). A name without a flag here is shown as it is. Lines that are not errors but
name a setting (a notice recorded with errors.naming_line, a pipe's description naming `variant`) are worded the
same way (`cli_words`). ComfyUI's names for the same settings: nodes/comfy_names.py.
"""
from __future__ import annotations

from typing import Iterable

from ..core.errors import named_settings, worded
from ..core.phrases import AUTO_BUDGET
from ..core.variant import VARIANT_DEFAULTS, own_settings
from ..local.loaded_files import RELOAD
from ..net.urls import KEYS_FILE

FLAGS: dict[str, str] = {
    "prompt": "--prompt",
    "negative_prompt": "--negative",
    "width": "--width",
    "height": "--height",
    "steps": "--steps",
    "cfg": "--cfg",
    "shift": "--shift",
    "seed": "--seed",
    "batch": "--batch",
    "denoise": "--denoise",
    "init_image": "--init-image",
    "mask": "--mask",
    "mask_grow": "--mask-grow",
    "mask_feather": "--mask-feather",
    "device": "--device",
    "dtype": "--dtype",
    "quant": "--quant",
    "wait_for_servers_s": "--wait-for-servers",
    "read_timeout_s": "--read-timeout",
    "resend_unanswered": "--resend-unanswered",
    "out": "--out",
    "step_cache_compare": "--step-cache-compare",
    "variant": "--variant",
    "model_dir": "--model-dir",
    "dit": "--dit",
    "text_encoder": "--text-encoder",
    "vae": "--vae",
    "pe": "--pe",
    "tokenizer": "--tokenizer",
    "urls": "--server",
    "vram_budget_gb": "--budget",
    AUTO_BUDGET: "auto (free VRAM minus a reserve)",
    "step_cache": "--step-cache",
    "pe_endpoint": "--pe-url",
    "pe_temperature": "--temperature",
    "pe_top_p": "--top-p",
    "pe_max_new_tokens": "--max-new-tokens",
    "format": "--format",
    KEYS_FILE: f"{KEYS_FILE} (or --api-key-env / --api-key-file; --pe-api-key-env / --pe-api-key-file for a PE URL)",
    **{own_settings(variant): f"--steps {int(own['steps'])} --cfg {own['cfg']:g}"
       for variant, own in VARIANT_DEFAULTS.items()},
    RELOAD: "run the command again",  # a model file changed under the run (local/loaded_files.py)
}


def cli_message(error: BaseException) -> str:
    """`str(error)` with each setting it names (ErnieImageError.naming) written as the CLI's flag where the message
    first names it (later words may be prose: "save the prompt as UTF-8")."""
    return cli_words(str(error), named_settings(error))


def cli_words(text: str, settings: Iterable[str]) -> str:
    """`text` naming `settings` by their Python names, with the CLI's flags for them (errors.worded)."""
    return worded(text, settings, FLAGS)
