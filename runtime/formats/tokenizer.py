"""Where the text encoder's tokenizer comes from: a diffusers `tokenizer/` folder (the model folder's, or the one beside
the text_encoder/ folder a text encoder was given from), an explicit tokenizer path,
or (ComfyUI single files) the Tekken tokenizer embedded in the text-encoder file as the uint8 tensor `tekken_model`."""
from __future__ import annotations

from pathlib import Path
from typing import Optional

from ..core.errors import ModelFileError, one_line
from .sources import component_folder

# The option of a tokenizer folder of its own, which a front end without one (ComfyUI's Loader) leaves out.
TOKENIZER_FOLDER = ", or a tokenizer/ folder alone (tokenizer)"


def diffusers_tokenizer_beside(text_encoder) -> Optional[Path]:
    """The tokenizer/ folder of the diffusers folder a text encoder was given from (`m/text_encoder/model.safetensors`
    or `m/text_encoder`), when there is one."""
    folder = component_folder(Path(text_encoder), "text_encoder") if text_encoder is not None else None
    if folder is None or folder.name != "text_encoder":
        return None
    beside = folder.parent / "tokenizer"
    return beside if beside.is_dir() else None


def load_tokenizer(sources):
    from transformers import AutoTokenizer

    candidates = []
    if sources.tokenizer is not None:
        candidates.append(sources.tokenizer)
    if sources.model_dir is not None:
        candidates.append(sources.model_dir / "tokenizer")
    beside = diffusers_tokenizer_beside(sources.text_encoder)
    if beside is not None:
        candidates.append(beside)
    for candidate in candidates:
        folder = candidate.parent if candidate.is_file() else candidate
        if (folder / "tokenizer.json").exists() or (folder / "tokenizer_config.json").exists():
            try:
                return AutoTokenizer.from_pretrained(str(folder))
            except (OSError, ValueError, TypeError, KeyError) as error:
                raise ModelFileError(f"the tokenizer in {folder} cannot be read ({one_line(error)}): "
                                     "download the model's tokenizer/ folder again") from None
        if candidate == sources.tokenizer:  # asked for explicitly: never fall back silently to another tokenizer
            raise ModelFileError(f"tokenizer {candidate} has no tokenizer.json or tokenizer_config.json: give the "
                                 "model's tokenizer/ folder (or its tokenizer.json), or leave the tokenizer out"
                                 ).naming("tokenizer")
    if sources.text_encoder is not None:
        from .tekken import tokenizer_from_text_encoder_file

        tokenizer = tokenizer_from_text_encoder_file(Path(sources.text_encoder))
        if tokenizer is not None:
            return tokenizer
    raise ModelFileError(
        "no vocabulary for the text encoder found (a tokenizer.json, or one its file embeds): give a text encoder "
        f"file that embeds one (text_encoder: ministral-3-3b.safetensors), a diffusers folder with tokenizer/ "
        f"(model_dir){TOKENIZER_FOLDER}"
    ).naming(TOKENIZER_FOLDER, "text_encoder", "model_dir", "tokenizer")
