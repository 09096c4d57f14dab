"""Loading the prompt enhancer: a `Ministral3ForCausalLM` and its tokenizer, from either layout users have.

- diffusers folder: `pe/` (config.json + safetensors, `model.`-prefixed keys) and `pe_tokenizer/` (tokenizer.json,
  chat_template.jinja with the fixed system text); the safetensors file inside `pe/`, given alone, finds
  `pe_tokenizer/` and `pe/generation_config.json` as the folder does;
- ComfyUI single file `text_encoders/ernie-image-prompt-enhancer.safetensors`: `model.layers.N...` keys in Hugging
  Face layout, no lm_head (tied to the embeddings), the Tekken tokenizer embedded as the uint8 tensor
  `tekken_model`, no chat template (Baidu's is used, see pe_prompt.py).

The model is built on the meta device and filled tensor by tensor from the memory-mapped file, so host RAM holds
about one copy of the weights and no random init is ever materialised.
"""
from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import torch

from ..core.errors import ModelFileError
from ..core.variant import Variant
from ..formats import open_component
from ..formats.config_json import config_named, config_there, load_config, read_config
from ..formats.sources import ModelSources, component_folder
from ..formats.tokenizer import holds_tokenizer
from ..model.builders import rebuild_rotary_tables
from ..model.config_fit import check_config_fits
from ..model.dtype_fit import check_built_dtypes, floating_tensors
from ..model.fill import fill_from_file
from ..model.tensor_fit import check_built_tensors, shapes_of
from .token_sampler import TRANSFORMERS_DEFAULT_TOP_K

_DROPPED_CONFIG_KEYS = ("architectures", "dtype", "torch_dtype", "transformers_version", "model_type")


@dataclass
class PeWeights:
    """Where one PE's parts are."""

    weights: Path  # pe/ folder, the file inside it, or the single file
    tokenizer_folder: Optional[Path]  # pe_tokenizer/ when there is one
    generation_config: dict


def locate_pe(sources: ModelSources) -> PeWeights:
    if not sources.has_pe():
        raise ModelFileError(
            "no prompt enhancer found: give a diffusers folder with pe/ and pe_tokenizer/, or the "
            "ernie-image-prompt-enhancer.safetensors file (pe), or turn the prompt enhancer off"
        ).naming("pe")
    weights = sources.component("pe")
    folder = component_folder(weights, "pe")
    tokenizer_folder = None
    for candidate in ([folder.parent / "pe_tokenizer"] if folder is not None else []) + (
        [sources.model_dir / "pe_tokenizer"] if sources.model_dir is not None else []
    ):
        if holds_tokenizer(candidate, "download the model's pe_tokenizer/ folder again"):
            tokenizer_folder = candidate
            break
    generation_config = {}
    if folder is not None and config_there(folder / "generation_config.json"):
        generation_config = read_config(folder / "generation_config.json")
    return PeWeights(weights, tokenizer_folder, generation_config)


def default_top_k(located: PeWeights) -> int:
    """The top_k transformers' generate() would use for this PE (the folder's generation_config, else 50)."""
    value = located.generation_config.get("top_k")
    return TRANSFORMERS_DEFAULT_TOP_K if value is None else int(value)


def pe_config_for(component, variant: Variant = "base") -> dict:
    config = component.config
    if config is not None:
        config = dict(config.get("text_config", config))
    else:
        config = load_config(variant, "pe")
        width = tuple(component.tensor("embed_tokens.weight").shape)[1]
        if width != config["hidden_size"]:
            raise ModelFileError(
                f"{component.path}: embedding width {width} is not the ERNIE-Image prompt enhancer's "
                f"{config['hidden_size']}: give ernie-image-prompt-enhancer.safetensors"
            )
    return {k: v for k, v in config.items() if k not in _DROPPED_CONFIG_KEYS}


def pe_weight_bytes(config: dict, dtype: torch.dtype) -> int:
    """Bytes the PE's weights take on the device (tied head counted once), for make_room and the memory plan."""
    hidden, layers = int(config["hidden_size"]), int(config["num_hidden_layers"])
    heads, kv_heads = int(config["num_attention_heads"]), int(config["num_key_value_heads"])
    head_dim = int(config.get("head_dim") or hidden // heads)
    ffn, vocab = int(config["intermediate_size"]), int(config["vocab_size"])
    attention = hidden * head_dim * (2 * heads + 2 * kv_heads)
    per_layer = attention + 3 * hidden * ffn + 2 * hidden
    count = layers * per_layer + vocab * hidden * (1 if config.get("tie_word_embeddings", True) else 2) + hidden
    return count * torch.tensor([], dtype=dtype).element_size()


def pe_on_meta(component, variant: Variant = "base"):
    """The Ministral3ForCausalLM its config describes, on the meta device: a config that does not build it is named."""
    from ..model.libraries import Ministral3Config, Ministral3ForCausalLM

    with config_named(component, "prompt enhancer"):
        config = Ministral3Config(**pe_config_for(component, variant))
        config._attn_implementation = "sdpa"
        with torch.device("meta"):
            return Ministral3ForCausalLM(config)


def check_pe_config(component, variant: Variant = "base") -> None:
    """The PE's config held against its weights, then built on the meta device (as model.builders does for the
    other parts): a config that does not fit or does not build fails at load in one line naming the config."""
    check_config_fits(component, "pe", variant)
    model = pe_on_meta(component, variant)
    made = shapes_of(model.model)
    tied = model.config.tie_word_embeddings
    if not tied:  # a head of its own, read from the file's lm_head.weight
        made["lm_head.weight"] = tuple(model.lm_head.weight.shape)
    check_built_tensors(component, "pe", made, may_hold=lambda key: tied and _is_head_copy(component, key))
    check_pe_dtypes(component, model)


def _is_head_copy(component, key: str) -> bool:
    """Whether `key` is a copy of the embeddings saved as the head (transformers ignores it when the head is tied):
    lm_head.weight in the shape the file holds embed_tokens.weight in."""
    if key != "lm_head.weight" or "embed_tokens.weight" not in component.keys:
        return False
    head = _held_shape(component, key)
    return head is not None and head == _held_shape(component, "embed_tokens.weight")


def _held_shape(component, key: str) -> Optional[tuple[int, ...]]:
    shape = getattr(component.tensor(key), "shape", None)
    return tuple(shape) if shape is not None else None


def check_pe_dtypes(component, model) -> None:
    """The file's dtypes held against the PE's (dtype_fit.py): its model's tensors, and an untied head's."""
    head = set() if model.config.tie_word_embeddings else {"lm_head.weight"}
    check_built_dtypes(component, floating_tensors(model.model) | head)


def build_pe_model(component, device: torch.device, dtype: torch.dtype, variant: Variant = "base"):
    """Ministral3ForCausalLM filled from a "pe" ComponentFile (canonical MistralModel keys)."""
    model = pe_on_meta(component, variant)
    check_pe_dtypes(component, model)  # the head too, which fill_from_file does not read
    config = model.config
    rebuild_rotary_tables(model.model, config, device)
    fill_from_file(model.model, component, device, dtype)
    if config.tie_word_embeddings:
        model.lm_head.weight = model.model.embed_tokens.weight
    elif "lm_head.weight" in component.keys:
        model.lm_head.weight = torch.nn.Parameter(component.tensor("lm_head.weight").to(device=device, dtype=dtype),
                                                  requires_grad=False)
    else:
        raise ModelFileError(
            f"{component.path}: the prompt enhancer's config says its head is not tied to the embeddings but the "
            f"file has no lm_head.weight: the file is incomplete"
        )
    return model.eval().requires_grad_(False)


def load_pe_tokenizer(located: PeWeights, sources: ModelSources) -> Any:
    """pe_tokenizer/ if present, else the Tekken tokenizer embedded in the single file, else the text encoder's.

    The last fallback is sound because the PE and the text encoder are both Ministral-3 3B with one vocabulary.
    """
    from ..formats.tokenizer import read_tokenizer_folder
    from ..formats.tokenizer_fit import embedded_origin, folder_origin, remember_origin

    if located.tokenizer_folder is not None:
        tokenizer = read_tokenizer_folder(located.tokenizer_folder, "download the model's pe_tokenizer/ folder again")
        return remember_origin(tokenizer, folder_origin(located.tokenizer_folder, "pe_tokenizer"))
    if located.weights.is_file():
        from ..formats.tekken import tokenizer_from_text_encoder_file

        tokenizer = tokenizer_from_text_encoder_file(located.weights)
        if tokenizer is not None:
            return remember_origin(tokenizer, embedded_origin(located.weights))
    from ..formats.tokenizer import NoTokenizerFound, load_tokenizer

    try:
        return load_tokenizer(sources)
    except NoTokenizerFound:
        raise ModelFileError(
            f"no tokenizer for the prompt enhancer {located.weights}: it embeds none and no pe_tokenizer/ or text-"
            f"encoder tokenizer was given; pass the diffusers folder or the text-encoder file too"
        ) from None


def pe_embedding_rows(component) -> int:
    """The rows of the PE's token embedding, from its file's shapes (nothing is read)."""
    return int(tuple(component.tensor("embed_tokens.weight").shape)[0])


def open_pe_component(located: PeWeights):
    return open_component(located.weights, "pe")
