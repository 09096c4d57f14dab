"""The CLI's names for the settings runtime messages name by their Python names, and the one place they are swapped.

The runtime's checks speak the Python API's and the nodes' language (`mask_grow 5000 is not allowed`); an error
records which of its words are such names (ErnieImageError.naming), and the CLI shows its own flags instead
(`--mask-grow 5000 is not allowed`). A name without a flag here is shown as it is.
"""
from __future__ import annotations

import re

from .errors import ErnieImageError

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
    "init image": "--init-image",
    "mask": "--mask",
    "mask_grow": "--mask-grow",
    "mask_feather": "--mask-feather",
    "device": "--device",
    "dtype": "--dtype",
    "quant": "--quant",
    "wait_for_servers_s": "--wait-for-servers",
    "resend_unanswered": "--resend-unanswered",
    "out": "--out",
}


def cli_message(error: BaseException) -> str:
    """`str(error)` with each setting it names (ErnieImageError.naming) written as the CLI's flag where the message
    first names it (later words may be prose: "save the prompt as UTF-8")."""
    text = str(error)
    names = error.settings if isinstance(error, ErnieImageError) else ()
    for name in sorted(names, key=len, reverse=True):  # "mask_grow" before "mask"
        flag = FLAGS.get(name)
        if flag is not None:
            text = re.sub(rf"(?<![\w-]){re.escape(name)}(?![\w-])", flag, text, count=1)
    return text
