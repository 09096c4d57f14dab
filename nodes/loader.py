"""ErnieImageLoader: model files from ComfyUI's folders in, a local ERNIE_PIPE and its memory plan out."""
from __future__ import annotations

from typing import Any, Optional

from ..runtime.core.errors import ErnieImageError, InvalidInputError, named_settings
from ..runtime.core.variant import files_notices
from . import comfy_env
from .comfy_env import GGUF_FOLDER_KEY, NONE_CHOICE
from .comfy_names import comfy_words, speaks_comfy
from .common import CATEGORY, PIPE_TYPE, shown_on_node
from .live_pipes import track
from .quant_config import QUANT_TYPE, QuantChoice, refuse_gguf_file_without_gguf

VARIANTS = ("auto", "base", "turbo")
MAX_BUDGET_GB = 1024.0


def build_sources(diffusers_folder: str, diffusion_model: str, text_encoder: str, vae: str,
                  prompt_enhancer: str, variant: str) -> Any:
    from ..runtime.formats.sources import ModelSources

    sources = ModelSources(
        model_dir=comfy_env.resolve_diffusers_folder(diffusers_folder),
        dit=comfy_env.resolve_model_file(("diffusion_models", GGUF_FOLDER_KEY), diffusion_model, "diffusion model"),
        text_encoder=comfy_env.resolve_model_file(("text_encoders", GGUF_FOLDER_KEY), text_encoder, "text encoder"),
        vae=comfy_env.resolve_model_file(("vae",), vae, "VAE"),
        pe=comfy_env.resolve_model_file(("text_encoders",), prompt_enhancer, "prompt enhancer"),
        variant=variant,  # "auto": decided from the files
    )
    if sources.model_dir is None and (sources.dit is None or sources.text_encoder is None or sources.vae is None):
        missing = [name for name, path in (("diffusion_model", sources.dit), ("text_encoder", sources.text_encoder),
                                           ("vae", sources.vae)) if path is None]
        raise InvalidInputError(
            f"the Loader has no {', '.join(missing)}: pick a diffusers_folder, or all three of diffusion_model, "
            f"text_encoder and vae (ComfyUI's models/diffusion_models, models/text_encoders, models/vae)"
        )
    return sources


def build_options(vram_budget_gb: float, keep_loaded: bool, quant_config: Optional[QuantChoice]) -> Any:
    from ..runtime.local.options import LoadOptions

    return LoadOptions(
        vram_budget_gb=None if vram_budget_gb == 0 else float(vram_budget_gb),  # the runtime refuses < 0, nan, inf
        keep_loaded=bool(keep_loaded),
        quant=quant_config.load_quant if quant_config is not None else "none",
    )


class ErnieImageLoader:
    DESCRIPTION = (
        "Loads ERNIE-Image or ERNIE-Image-Turbo from ComfyUI's model folders (a diffusers folder, or "
        "diffusion_models + text_encoders + vae single files, .safetensors or .gguf) and plans its memory for "
        "the VRAM budget. Base or Turbo: the variant widget, else what the DiT file records, its config, then its "
        "name; the text says which decided. Outputs the pipe for the Samplers."
    )
    CATEGORY = CATEGORY
    FUNCTION = "load"
    RETURN_TYPES = (PIPE_TYPE, "STRING")
    RETURN_NAMES = ("pipe", "memory_plan")
    OUTPUT_TOOLTIPS = ("The loaded model, for a Sampler or Turbo Sampler.", "How the model is placed in memory.")

    @classmethod
    def INPUT_TYPES(cls) -> dict[str, Any]:
        return {
            "required": {
                "diffusers_folder": (
                    comfy_env.diffusers_folder_choices(),
                    {"default": NONE_CHOICE, "tooltip": "A baidu/ERNIE-Image(-Turbo) diffusers folder in models/diffusers. "
                     "Single files picked below override its parts."},
                ),
                "diffusion_model": (
                    comfy_env.model_choices("diffusion_models", with_gguf=True),
                    {"default": NONE_CHOICE, "tooltip": "The DiT from models/diffusion_models: bf16, fp8 or nvfp4 .safetensors, or a .gguf."},
                ),
                "text_encoder": (
                    comfy_env.model_choices("text_encoders", with_gguf=True),
                    {"default": NONE_CHOICE, "tooltip": "The Ministral-3B text encoder from models/text_encoders (.safetensors or .gguf)."},
                ),
                "vae": (
                    comfy_env.model_choices("vae"),
                    {"default": NONE_CHOICE, "tooltip": "The Flux2 VAE from models/vae."},
                ),
                "prompt_enhancer": (
                    comfy_env.model_choices("text_encoders"),
                    {"default": NONE_CHOICE, "tooltip": "Optional: ERNIE-Image's prompt enhancer (models/text_encoders). "
                     "Without it the Sampler's use_pe switch does nothing."},
                ),
                "variant": (
                    list(VARIANTS),
                    {"default": "auto",
                     "tooltip": "auto: base or Turbo from what the DiT file records (files this pack writes), its "
                     "diffusers config, else its name (the two have the same weights' shapes); the text below says "
                     "which decided. Set it when that is wrong."},
                ),
                "vram_budget_gb": (
                    "FLOAT",
                    {"default": 0.0, "min": 0.0, "max": MAX_BUDGET_GB, "step": 0.5,
                     "tooltip": "GPU memory this model may use, in GiB (1024 MiB, as nvidia-smi counts). 0 = auto "
                     "(what is free after ComfyUI makes room). "
                     "A small budget streams DiT blocks from RAM: slower, but it fits."},
                ),
                "keep_loaded": (
                    "BOOLEAN",
                    {"default": True, "label_on": "keep in memory", "label_off": "free after each run",
                     "tooltip": "Keep the weights in VRAM between runs (fast), or free them after every run (leaves the GPU to other models)."},
                ),
            },
            "optional": {
                "quant_config": (QUANT_TYPE, {"tooltip": "Optional: an ERNIE-Image Quant Config node choosing the weight format. Default: bf16 or the file's own format."}),
            },
        }

    @classmethod
    def IS_CHANGED(cls, diffusers_folder: str, diffusion_model: str, text_encoder: str, vae: str, prompt_enhancer: str,
                   **_: Any) -> str:
        """ComfyUI runs the Loader again, dropping its cached pipe, when this value changes between two prompts: the
        identities of every file the Loader reads (a diffusers folder's too), so a model file replaced, rewritten or
        cut is loaded again and the Loader's text says what the new file is. Choices that name no file: the load
        says so."""
        from ..runtime.files.identity import fingerprint

        try:
            sources = build_sources(diffusers_folder, diffusion_model, text_encoder, vae, prompt_enhancer, "auto")
        except ErnieImageError as error:
            return f"not loadable: {error}"
        return fingerprint((sources.model_dir, sources.dit, sources.text_encoder, sources.vae, sources.pe))

    @speaks_comfy
    def load(self, diffusers_folder: str, diffusion_model: str, text_encoder: str, vae: str, prompt_enhancer: str,
             variant: str, vram_budget_gb: float, keep_loaded: bool,
             quant_config: Optional[QuantChoice] = None) -> dict[str, Any]:
        from ..runtime.local.pipe import LocalPipe

        sources = build_sources(diffusers_folder, diffusion_model, text_encoder, vae, prompt_enhancer, variant)
        options = build_options(vram_budget_gb, keep_loaded, quant_config)
        if quant_config is not None:
            refuse_gguf_file_without_gguf(quant_config, sources.component("transformer"))
        pipe = LocalPipe.load(sources, options)  # reads only the files' headers: nothing to cancel
        track(pipe)
        described = pipe.describe()  # the plan of a default 1024x1024 image: the Sampler checks its own size
        plan = comfy_words(described, named_settings(described))
        # the widget set against what the file says; or the file's metadata or config against its name or each other
        for notice in files_notices(pipe.variant_choice):
            plan = f"{plan}\n{comfy_words(notice, notice.settings)}"
        for notice in pipe.file_notices:  # a file of a model folder that is not read
            plan = f"{plan}\n{notice}"
        if quant_config is not None and not pipe.quant_reason:  # the pipe says itself what 'auto' runs
            plan = f"{plan}\nquant: {quant_config.reason}"
        return shown_on_node(plan, pipe, plan)
