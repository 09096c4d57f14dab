"""Writing a model in the Comfy-Org single-file layout (what ComfyUI users download), for tests and the demo model.

    diffusion_models/ernie-image[-turbo]-tiny.safetensors   DiT, diffusers names under `model.diffusion_model.`
    text_encoders/ministral-3-3b-tiny.safetensors            `model.layers.N...`, `model.embed_tokens.weight`,
                                                             `model.norm.weight`, `lm_head.weight`, `tekken_model`
    vae/flux2-vae-tiny.safetensors                           BFL names (`decoder.up.N.block.M...`)
    text_encoders/ernie-image-prompt-enhancer-tiny.safetensors  (with a PE)

A tiny model cannot be recognised as Ministral-3B or the FLUX.2 VAE from its shapes (and GroupNorm group counts
are not in any shape), so the text encoder, PE and VAE files carry their config as JSON in the safetensors
metadata key "config"; the released-size files are read without it. The DiT file records its variant
(`ernie_image.variant`), as every DiT file this pack writes does.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

import torch

from ..core.variant import METADATA_KEY, Variant
from ..files.output_files import give_usual_mode
from ..formats.sources import ModelSources
from ..formats.tekken import TEKKEN_KEY, byte_symbols, tekken_json_from_vocabulary
from ..formats.vae_keys import to_bfl_state_dict
from .tiny_vocab import SPECIAL_TOKENS

COMFY_DIT_PREFIX = "model.diffusion_model."


def _tensors(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    # safetensors refuses shared storage (tied weights) and non-contiguous views: give it private copies.
    return {key: value.detach().clone().contiguous() for key, value in state.items()}


def _save(path: Path, state: dict[str, torch.Tensor], config: Optional[dict] = None,
          recorded: Optional[dict[str, str]] = None) -> Path:
    from safetensors.torch import save_file

    path.parent.mkdir(parents=True, exist_ok=True)
    metadata = {"format": "pt", **(recorded or {})}
    if config is not None:
        metadata["config"] = json.dumps(config, default=list)
    save_file(_tensors(state), str(path), metadata=metadata)
    give_usual_mode([path])
    return path


def tiny_tekken_bytes() -> bytes:
    """The tiny tokenizer of runtime/demo/tiny.py (its byte symbols in the same id order) as a tekken.json."""
    symbol_to_byte = {symbol: byte for byte, symbol in enumerate(byte_symbols())}
    byte_tokens = [bytes([symbol_to_byte[symbol]]) for symbol in sorted(symbol_to_byte)]
    return tekken_json_from_vocabulary(byte_tokens, list(SPECIAL_TOKENS))


def _tekken_tensor(data: bytes) -> torch.Tensor:
    return torch.frombuffer(bytearray(data), dtype=torch.uint8)


def _text_state(text_encoder) -> dict[str, torch.Tensor]:
    """Mistral3Model -> Hugging Face text-model keys, as in Comfy-Org's ministral-3-3b (no vision tower)."""
    state = {}
    for key, value in text_encoder.state_dict().items():
        if key.startswith("language_model."):
            state["model." + key[len("language_model."):]] = value
    state["lm_head.weight"] = state["model.embed_tokens.weight"]
    return state


def save_comfy_layout(dest: Path, variant: Variant, dit, text_encoder, vae, pe=None,
                      dit_prefix: str = COMFY_DIT_PREFIX) -> ModelSources:
    dest = Path(dest)
    tekken = _tekken_tensor(tiny_tekken_bytes())
    dit_name = "ernie-image-turbo-tiny.safetensors" if variant == "turbo" else "ernie-image-tiny.safetensors"
    dit_path = _save(dest / "diffusion_models" / dit_name,
                     {dit_prefix + key: value for key, value in dit.state_dict().items()},
                     recorded={METADATA_KEY: variant})
    text_state = _text_state(text_encoder)
    text_state[TEKKEN_KEY] = tekken
    text_path = _save(dest / "text_encoders" / "ministral-3-3b-tiny.safetensors", text_state,
                      config=text_encoder.config.text_config.to_dict())
    up_blocks = len(vae.config.block_out_channels)
    vae_path = _save(dest / "vae" / "flux2-vae-tiny.safetensors", to_bfl_state_dict(vae.state_dict(), up_blocks),
                     config={k: v for k, v in dict(vae.config).items() if not k.startswith("_")})
    pe_path = None
    if pe is not None:
        pe_state = dict(pe.state_dict())
        if pe.config.tie_word_embeddings:
            pe_state.pop("lm_head.weight", None)
        pe_state[TEKKEN_KEY] = tekken
        pe_path = _save(dest / "text_encoders" / "ernie-image-prompt-enhancer-tiny.safetensors", pe_state,
                        config=pe.config.to_dict())
    return ModelSources(dit=dit_path, text_encoder=text_path, vae=vae_path, pe=pe_path)  # the DiT file says its variant
