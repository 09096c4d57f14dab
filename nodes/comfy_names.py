"""ComfyUI's names for the settings runtime messages name by their Python names, and the one place nodes swap them.

The runtime's checks speak the Python API's language (`point model_dir at a diffusers folder`) and record which of
their words are such names (ErnieImageError.naming); the CLI shows its flags for them (runtime/cli/names.py), the
nodes show what a ComfyUI user sees on the canvas (`point the Loader's diffusers_folder at ...`). A name the nodes
call the same (`mask_grow`, `steps`) needs no entry.
"""
from __future__ import annotations

import functools
from contextlib import contextmanager
from typing import Any, Callable, Iterable, Iterator, TypeVar

from ..runtime.core.errors import ErnieImageError, worded
from ..runtime.core.phrases import AUTO_BUDGET, RUN_CHECKS_ITS_SIZE
from ..runtime.core.request import LOCAL_PIPE, MASK_OF_ITS_SIZE, RESIZE_IT
from ..runtime.core.variant import own_settings
from ..runtime.formats.tokenizer import TOKENIZER_FOLDER
from ..runtime.local.loaded_files import RELOAD

_Run = TypeVar("_Run", bound=Callable[..., Any])

NAMES: dict[str, str] = {
    "model_dir": "the Loader's diffusers_folder",
    "dit": "the Loader's diffusion_model",
    "text_encoder": "the Loader's text_encoder",
    "vae": "the Loader's vae",
    "pe": "the Loader's prompt_enhancer",
    "variant": "the Loader's variant widget",
    "quant": "Quant Config format",
    own_settings("base"): "the Sampler",
    own_settings("turbo"): "the Turbo Sampler",
    "urls": "the Remote Backend's server_urls",
    "vram_budget_gb": "the Loader's vram_budget_gb",
    AUTO_BUDGET: "0 for auto (what is free after ComfyUI makes room)",
    "step_cache": "the Step Cache node",
    RUN_CHECKS_ITS_SIZE: "the Sampler checks its own size before it starts",
    "pe_endpoint": "pe_url",
    "pe_temperature": "the Prompt Enhancer's temperature",
    "pe_top_p": "the Prompt Enhancer's top_p",
    "pe_max_new_tokens": "the Prompt Enhancer's max_new_tokens",
    "init_image": "the image input",
    "batch": "batch_size",
    "init_latents": "the latent input",
    "mask": "the mask input",
    RESIZE_IT: f"{RESIZE_IT} (Upscale Image or ImageCrop)",
    MASK_OF_ITS_SIZE: f"{MASK_OF_ITS_SIZE} (the MASK of the same Load Image, or Upscale Image on both)",
    LOCAL_PIPE: "a local ERNIE-Image Loader",
    TOKENIZER_FOLDER: "",  # the Loader takes no tokenizer of its own
    # A model file changed under the Loader's pipe (runtime/local/loaded_files.py): the Loader's IS_CHANGED sees it.
    RELOAD: "queue the prompt again: the Loader reloads changed files",
}


def comfy_words(text: str, settings: Iterable[str]) -> str:
    """`text` naming `settings` by their Python names, with ComfyUI's names for them (errors.worded)."""
    return worded(text, settings, NAMES)


@contextmanager
def in_comfy_words() -> Iterator[None]:
    """Run a node's work so that an ErnieImageError it raises names settings as ComfyUI shows them (the same error,
    its message re-worded: ComfyUI shows `str(error)`)."""
    try:
        yield
    except ErnieImageError as error:
        if error.settings:
            error.args = (comfy_words(str(error), error.settings),)
            error.settings = ()
        raise


def speaks_comfy(run: _Run) -> _Run:
    """A node's FUNCTION, run in_comfy_words: whatever runtime call raises, the node shows ComfyUI's names."""
    @functools.wraps(run)
    def in_words(*args: Any, **kwargs: Any) -> Any:
        with in_comfy_words():
            return run(*args, **kwargs)

    in_words.speaks_comfy = True  # type: ignore[attr-defined]
    return in_words  # type: ignore[return-value]
