"""ErnieImagePromptEnhancer: a prompt in, the prompt enhancer's revised prompt out, as a STRING to read or edit."""
from __future__ import annotations

from typing import Any, Optional

from ..runtime.core.errors import InvalidInputError
from ..runtime.core.phrases import pe_work
from ..runtime.core.request import MAX_NEW_TOKENS_RANGE, SEED_MASK, TEMPERATURE_RANGE
from .comfy_names import speaks_comfy
from .common import CATEGORY, PIPE_TYPE, shown_on_node
from .host import NoteHost, cancel_as_comfy_interrupt
from .live_pipes import generation_lock
from .remote import LEGACY_HIDDEN, chat_endpoint, pe_endpoint_inputs, refuse_url_credentials
from .sampler import resolve_size, seed_input, size_inputs

NO_ENHANCER = ("no prompt enhancer to run: connect a Loader whose model has a PE (prompt_enhancer file or a "
               "diffusers folder with pe/), or set pe_url to an OpenAI-compatible chat server serving the PE")


def timing_text(info: dict[str, Any], notes: list[str]) -> str:
    """What the user is shown about the run: where the PE ran, tokens, seconds, tokens per second, notices."""
    source = info.get("pe", "?")
    if source == "original":
        head = "prompt enhancer did not revise the prompt: the original prompt is passed on"
    else:
        head = f"prompt enhancer ({source}): {pe_work(info)}"
    return "\n".join([head, *notes])


class ErnieImagePromptEnhancer:
    DESCRIPTION = (
        "Rewrites a short prompt with ERNIE-Image's prompt enhancer (PE) and outputs the revised prompt as text, "
        "to read, edit and wire into a Sampler's prompt (with the Sampler's use_pe off). Runs the PE of a "
        "connected Loader, or an OpenAI-compatible chat server (pe_url). Seeded: the same seed, prompt and size "
        "give the same revision."
    )
    CATEGORY = CATEGORY
    FUNCTION = "enhance"
    RETURN_TYPES = ("STRING", "STRING")
    RETURN_NAMES = ("revised_prompt", "info")
    OUTPUT_TOOLTIPS = (
        "The prompt the PE wrote (the original prompt when the PE server failed or answered nothing).",
        "Where the PE ran, tokens generated, seconds and tokens per second, and any notice.",
    )

    @classmethod
    def INPUT_TYPES(cls) -> dict[str, Any]:
        return {
            "required": {
                "prompt": ("STRING", {"multiline": True, "default": "", "tooltip": "The short prompt to enhance. Chinese and English both work."}),
                **size_inputs("The image size the PE writes for (it is told width and height); 'custom' uses "
                              "width and height below. Match the Sampler's."),
                "seed": seed_input("Sampling seed of the PE: the same seed gives the same revised prompt. Use the "
                                   "Sampler's seed to get the revision its own use_pe would make."),
                "temperature": ("FLOAT", {"default": 0.6, "min": TEMPERATURE_RANGE[0], "max": TEMPERATURE_RANGE[1], "step": 0.05,
                                          "tooltip": "PE sampling temperature (Baidu's 0.6; 0 is greedy)."}),
                "top_p": ("FLOAT", {"default": 0.95, "min": 0.01, "max": 1.0, "step": 0.01,
                                    "tooltip": "PE nucleus sampling (Baidu's 0.95)."}),
                "max_new_tokens": ("INT", {"default": 512, "min": MAX_NEW_TOKENS_RANGE[0], "max": MAX_NEW_TOKENS_RANGE[1],
                                           "tooltip": "Cap on the revised prompt's length in tokens."}),
            },
            "optional": {
                "pipe": (PIPE_TYPE, {"tooltip": "Optional: a Loader (runs its PE here) or a Remote Backend with a PE "
                                     "endpoint. Not needed when pe_url is set on this node."}),
                **pe_endpoint_inputs("When set it is used instead of the pipe's PE."),
            },
            "hidden": {"unique_id": "UNIQUE_ID", **{name: kind for name, kind in LEGACY_HIDDEN.items()
                                                    if name.startswith("pe_")}},
        }

    @classmethod
    def VALIDATE_INPUTS(cls, pe_url: Optional[str] = None) -> "bool | str":
        return refuse_url_credentials(pe_url=pe_url)

    @speaks_comfy
    def enhance(self, prompt: str, resolution: str, width: int, height: int, seed: int, temperature: float,
                top_p: float, max_new_tokens: int, pipe: Any = None, pe_url: str = "", pe_model: str = "",
                pe_credential: str = "", unique_id: Optional[str] = None, pe_api_key_env: str = "",
                pe_api_key_file: str = "") -> dict[str, Any]:
        width, height = resolve_size(resolution, width, height)
        if not prompt.strip():
            raise InvalidInputError("the prompt is empty: write what to draw, the PE expands it")
        endpoint = chat_endpoint(pe_url, pe_model, pe_credential,
                                 legacy={"pe_api_key_env": pe_api_key_env, "pe_api_key_file": pe_api_key_file})
        sampling = dict(seed=int(seed) & SEED_MASK, temperature=float(temperature), top_p=float(top_p),
                        max_new_tokens=int(max_new_tokens))
        host = NoteHost(unique_id)
        if endpoint is not None:
            from ..runtime.text.remote_enhancer import revise_prompts_remote

            with cancel_as_comfy_interrupt():
                revised = revise_prompts_remote(endpoint, [prompt], width, height, host=host, **sampling)
        else:
            if pipe is None or not callable(getattr(pipe, "enhance", None)) or not pipe.has_enhancer():
                raise InvalidInputError(NO_ENHANCER)
            # One job on the device at a time; the pipe frees its own memory after a failure or a cancel.
            with generation_lock, cancel_as_comfy_interrupt():
                revised = pipe.enhance(prompt, width, height, host=host, **sampling)
        text = revised.prompts[0]
        info = timing_text(revised.info(), host.notes)
        return shown_on_node(text, text, info)
