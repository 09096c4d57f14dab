"""The diffusers and transformers classes the runtime builds its models from, imported in this one place.

Each is imported on first use (`from ..model.libraries import MistralModel` inside the function that builds one):
diffusers and transformers stay unimported until a model is built. torch._dynamo is imported first, through
dynamo_import.py, so the import leaves no inductor cache folder behind; a module that imported these classes from
diffusers or transformers itself could bring that folder back, and tests/test_no_stray_folders.py refuses one.
"""
from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from .dynamo_import import import_dynamo

if TYPE_CHECKING:
    from diffusers import AutoencoderKLFlux2, ErnieImageTransformer2DModel
    from transformers import (Ministral3Config, Ministral3ForCausalLM, Mistral3Config, Mistral3Model, MistralConfig,
                              MistralModel)

# Each class by the library it comes from.
LIBRARY_OF: dict[str, str] = {
    "AutoencoderKLFlux2": "diffusers",
    "ErnieImageTransformer2DModel": "diffusers",
    "MistralConfig": "transformers",
    "MistralModel": "transformers",
    "Mistral3Config": "transformers",
    "Mistral3Model": "transformers",
    "Ministral3Config": "transformers",
    "Ministral3ForCausalLM": "transformers",
}

__all__ = sorted(LIBRARY_OF)


def __getattr__(name: str) -> Any:
    library = LIBRARY_OF.get(name)
    if library is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    import_dynamo()
    found = getattr(importlib.import_module(library), name)
    globals()[name] = found
    return found
