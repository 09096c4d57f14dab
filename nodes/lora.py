"""ErnieImageLoRA: pipe + a LoRA file from ComfyUI's `loras` folder + strength -> the same model with the LoRA.

Chainable: each node adds its LoRA to the stack of the pipe it gets. The output shares the Loader's loaded
model (no second copy); the stack is put on the DiT when a sampler runs with it, re-applying only the LoRA deltas.
`mode` (merge / branch) is an optional widget appended last, so workflows saved before it existed load unchanged:
the editor fills a widget missing from widgets_values with its default, and an API graph without the input runs
`apply` with the default.
"""
from __future__ import annotations

from typing import Any

from ..runtime.core.errors import InvalidInputError
from ..runtime.lora.stack import LORA_MODES, MAX_STRENGTH, check_strength, describe_stack
from . import comfy_env
from .comfy_names import speaks_comfy
from .common import CATEGORY, PIPE_TYPE, shown_on_node

LORA_FOLDER_KEY = "loras"


class ErnieImageLoRA:
    DESCRIPTION = (
        "Applies a LoRA (from models/loras) to an ERNIE-Image pipe at a strength. Chain several for a stack. "
        "Reads diffusers/PEFT, ai-toolkit, musubi-tuner, OneTrainer and kohya LoRAs and LyCORIS LoKr/LoHa. The "
        "model is not reloaded when a LoRA or its strength changes, and removing the node gives the base model."
    )
    CATEGORY = CATEGORY
    FUNCTION = "apply"
    RETURN_TYPES = (PIPE_TYPE,)
    RETURN_NAMES = ("pipe",)
    OUTPUT_TOOLTIPS = ("The same model with this LoRA added to its stack, for a Sampler or another LoRA node.",)

    @classmethod
    def INPUT_TYPES(cls) -> dict[str, Any]:
        return {
            "required": {
                "pipe": (PIPE_TYPE, {"tooltip": "An ERNIE-Image Loader output, or another LoRA node's."}),
                "lora_name": (sorted(comfy_env.filenames(LORA_FOLDER_KEY), key=str.lower),
                              {"tooltip": "A LoRA trained on ERNIE-Image or ERNIE-Image-Turbo, from models/loras "
                               "(.safetensors)."}),
                "strength": ("FLOAT", {"default": 1.0, "min": -MAX_STRENGTH, "max": MAX_STRENGTH, "step": 0.01,
                                       "tooltip": "How strongly the LoRA applies: 1.0 as trained, 0 off, negative "
                                       "inverts it."}),
            },
            "optional": {
                "mode": (list(LORA_MODES), {"default": "merge",
                                            "tooltip": "merge: added into the model's weights on the GPU (no slowdown per "
                                            "step; the original weights are kept in RAM to remove it exactly). branch: "
                                            "run beside the weights (a few % slower per step, no RAM copy). Streamed "
                                            "blocks, GGUF and NVFP4 weights always use the branch."}),
            },
        }

    @classmethod
    def VALIDATE_INPUTS(cls, strength: Any = None) -> Any:
        """Checked when the prompt is queued (POST /prompt answers 400 with this reason), not only when it runs:
        ComfyUI's own min/max check lets NaN through. A strength fed by a link is None here and checked on run."""
        if strength is None:
            return True
        try:
            check_strength(strength)
        except InvalidInputError as error:
            return str(error)
        return True

    @speaks_comfy
    def apply(self, pipe: Any, lora_name: str, strength: float, mode: str = "merge") -> dict[str, Any]:
        if pipe is None or not hasattr(pipe, "generate"):
            raise InvalidInputError("the pipe input is not connected: wire an ERNIE-Image Loader to it")
        if not hasattr(pipe, "with_loras"):
            raise InvalidInputError("this pipe does not take LoRAs: wire an ERNIE-Image Loader to the LoRA node")
        path = comfy_env.resolve_model_file((LORA_FOLDER_KEY,), lora_name, "LoRA")
        if path is None:
            raise InvalidInputError("no LoRA picked: put a LoRA .safetensors in models/loras and pick it")
        view = pipe.with_loras([(path, check_strength(strength, lora_name), mode)])
        view.check()  # a bad file fails here, on this node, before any sampler runs
        return shown_on_node(describe_stack(view.loras), view)
