"""Where the text encoder's tokenizer comes from: a diffusers `tokenizer/` folder (the model folder's, or the one beside
the text_encoder/ folder a text encoder was given from), an explicit tokenizer path,
or (ComfyUI single files) the Tekken tokenizer embedded in the text-encoder file as the uint8 tensor `tekken_model`."""
from __future__ import annotations

from pathlib import Path
from typing import Any, Optional

from ..core.errors import ModelFileError
from ..core.json_text import JSON_ERRORS, RepeatedKey, json_fault, load_json
from ..files.file_kind import is_there, not_there, refuse_special_file
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


class NoTokenizerFound(ModelFileError):
    """None of the places a tokenizer may be holds one (a damaged one is a ModelFileError of its own)."""


def load_tokenizer(sources):
    """The text encoder's tokenizer: the one given (`tokenizer`), the model folder's tokenizer/, the one beside the
    text encoder's folder, else the Tekken tokenizer its file embeds; where it came from is recorded for a refusal
    of a tokenizer that does not fit the text encoder (tokenizer_fit.py)."""
    from .tokenizer_fit import embedded_origin, folder_origin, given_origin, remember_origin

    encoder = _text_encoder_shown(sources)
    candidates = []
    if sources.tokenizer is not None:
        candidates.append(sources.tokenizer)
    if sources.model_dir is not None:
        candidates.append(sources.model_dir / "tokenizer")
    beside = diffusers_tokenizer_beside(sources.text_encoder)
    if beside is not None:
        candidates.append(beside)
    for candidate in candidates:
        given = candidate == sources.tokenizer
        if candidate.is_symlink() and not candidate.exists():
            if given:
                raise ModelFileError(f"tokenizer {candidate} {not_there(candidate)}").naming("tokenizer")
            raise ModelFileError(f"the tokenizer folder {candidate} {not_there(candidate)}")
        if not given and candidate.is_file():  # model_dir/tokenizer, or the one beside the text encoder
            raise ModelFileError(f"{candidate} is a file, not the tokenizer folder: download the model's tokenizer/ "
                                 "folder again")
        folder = candidate.parent if candidate.is_file() else candidate
        if holds_tokenizer(folder, "download the model's tokenizer/ folder again"):
            tokenizer = read_tokenizer_folder(folder, "download the model's tokenizer/ folder again")
            origin = given_origin(candidate, encoder) if given else folder_origin(folder, "tokenizer", encoder)
            return remember_origin(tokenizer, origin)
        if given:  # asked for explicitly: never fall back silently to another tokenizer
            raise ModelFileError(f"tokenizer {candidate} has no tokenizer.json or tokenizer_config.json: give the "
                                 "model's tokenizer/ folder (or its tokenizer.json), or leave the tokenizer out"
                                 ).naming("tokenizer")
    if sources.text_encoder is not None:
        from .tekken import tokenizer_from_text_encoder_file

        tokenizer = tokenizer_from_text_encoder_file(Path(sources.text_encoder))
        if tokenizer is not None:
            return remember_origin(tokenizer, embedded_origin(sources.text_encoder, encoder))
    raise NoTokenizerFound(
        "no vocabulary for the text encoder found (a tokenizer.json, or one its file embeds): give a text encoder "
        f"file that embeds one (text_encoder: ministral-3-3b.safetensors), a diffusers folder with tokenizer/ "
        f"(model_dir){TOKENIZER_FOLDER}"
    ).naming(TOKENIZER_FOLDER, "text_encoder", "model_dir", "tokenizer")


def _text_encoder_shown(sources) -> Optional[str]:
    """The text encoder a tokenizer is found for, as a message names it (None: none given)."""
    try:
        return str(sources.component("text_encoder"))
    except ModelFileError:
        return None


# The JSON files transformers reads from a tokenizer folder.
TOKENIZER_JSON = ("tokenizer_config.json", "special_tokens_map.json", "added_tokens.json", "tokenizer.json",
                  "chat_template.json")
_JSON_KINDS = {list: "an array", str: "a string", int: "a number", float: "a number", bool: "true or false",
               type(None): "null"}


def holds_tokenizer(folder: Path, fix: str) -> bool:
    """Whether `folder` holds a transformers tokenizer (its tokenizer.json or tokenizer_config.json). A broken link
    in their place (a download cut short into a cache of links) is refused with `fix`, not taken for no tokenizer."""
    return any([is_there(folder / name, f"{folder / name}", fix) for name in ("tokenizer.json", "tokenizer_config.json")])


def read_tokenizer_folder(folder: Path, fix: str) -> Any:
    """transformers' tokenizer of `folder`; a folder it cannot read is one line naming the folder, the damaged file
    where one is (JSON that does not parse, nested too deep, not an object, empty, not UTF-8), and `fix`."""
    from transformers import AutoTokenizer

    for entry in sorted(Path(folder).iterdir()):  # a FIFO among them would block transformers' read for ever
        refuse_special_file(entry, f"the tokenizer in {folder}: its {entry.name}", f"remove it; {fix}")
    try:
        str(folder).encode("utf-8")
    except UnicodeEncodeError:  # bytes of another encoding, kept by the file system API as lone surrogates
        raise ModelFileError(f"the tokenizer in {folder} cannot be opened: its path holds bytes that are not UTF-8 "
                             "text, which the tokenizer library cannot open: rename the folders on its path in "
                             "UTF-8") from None
    damaged = damaged_json(folder)  # before the library reads it: it would take a key given twice as its last copy
    if damaged:
        raise ModelFileError(f"the tokenizer in {folder} cannot be read ({damaged}): {fix}")
    try:
        return AutoTokenizer.from_pretrained(str(folder))
    except MemoryError:
        raise
    except Exception as error:  # tokenizers refuses a tokenizer.json as a bare Exception; JSON nested too deep
        # is a RecursionError; transformers lets through the AttributeError of a JSON list where it wants an object
        cause = damaged_json(folder) or _library_reason(error)
        raise ModelFileError(f"the tokenizer in {folder} cannot be read ({cause}): {fix}") from None


def damaged_json(folder: Path) -> Optional[str]:
    """What is wrong with the first of the tokenizer JSON files in `folder` that is damaged (None: none is)."""
    for name in TOKENIZER_JSON:
        path = folder / name
        if not path.exists():
            continue
        try:
            data = path.read_bytes()
        except OSError as error:
            return f"its {name} cannot be opened: {error.strerror or 'an I/O error'}"
        if not data:
            return f"its {name} is empty (0 bytes)"
        try:
            value = load_json(data.decode("utf-8"))
        except RepeatedKey as error:
            return f"its {name} is damaged: {json_fault(error)}"
        except JSON_ERRORS as error:
            return f"its {name} is damaged: not valid JSON ({json_fault(error)})"
        if not isinstance(value, dict):
            return f"its {name} is damaged: it holds {_JSON_KINDS.get(type(value), 'a value')}, not a JSON object"
    return None


def _library_reason(error: BaseException, limit: int = 160) -> str:
    """The library's words for a failure, on one line and cut at a word (never its exception's class name)."""
    text = " ".join(str(error).replace("`", "").split())
    if len(text) > limit:
        text = text[:limit].rsplit(" ", 1)[0] + " ..."
    return f"the tokenizer library refused its files: {text}" if text else "the tokenizer library refused its files"
