"""ComfyUI adapter: thin node classes over runtime/ (V1 node API, works in ComfyUI v0.8.0 and later)."""
from __future__ import annotations

from .enhancer import ErnieImagePromptEnhancer
from .loader import ErnieImageLoader
from .lora import ErnieImageLoRA
from .quant_config import ErnieImageQuantConfig
from .remote import ErnieImageRemoteBackend
from .routes import register_routes
from .sampler import ErnieImageSampler, ErnieImageTurboSampler
from .step_cache import ErnieImageStepCache

NODE_CLASS_MAPPINGS: dict[str, type] = {
    "ErnieImageLoader": ErnieImageLoader,
    "ErnieImageSampler": ErnieImageSampler,
    "ErnieImageTurboSampler": ErnieImageTurboSampler,
    "ErnieImageQuantConfig": ErnieImageQuantConfig,
    "ErnieImageRemoteBackend": ErnieImageRemoteBackend,
    "ErnieImagePromptEnhancer": ErnieImagePromptEnhancer,
    "ErnieImageLoRA": ErnieImageLoRA,
    "ErnieImageStepCache": ErnieImageStepCache,
}

NODE_DISPLAY_NAME_MAPPINGS: dict[str, str] = {
    "ErnieImageLoader": "ERNIE-Image Loader",
    "ErnieImageSampler": "ERNIE-Image Sampler",
    "ErnieImageTurboSampler": "ERNIE-Image Turbo Sampler",
    "ErnieImageQuantConfig": "ERNIE-Image Quant Config",
    "ErnieImageRemoteBackend": "ERNIE-Image Remote Backend (SGLang)",
    "ErnieImagePromptEnhancer": "ERNIE-Image Prompt Enhancer",
    "ErnieImageLoRA": "ERNIE-Image LoRA",
    "ErnieImageStepCache": "ERNIE-Image Step Cache",
}

register_routes()
