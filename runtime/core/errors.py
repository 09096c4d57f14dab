"""Errors the runtime raises, and the words they and its notices use. Every message is one line naming the cause and
the fix, in the library's words: a setting by its Python name, recorded (`naming`, `NamedLine`) so that a front end
shows its own name for it (`worded`: the CLI's flags in runtime/cli/names.py, ComfyUI's inputs in
nodes/comfy_names.py)."""
from __future__ import annotations

import re
from typing import Iterable, Mapping, TypeVar

_E = TypeVar("_E", bound="ErnieImageError")


class ErnieImageError(Exception):
    """Base class: anything the user can act on.

    A message names a setting by its Python name (a request field, a node widget: `mask_grow`); `naming` records
    which words of the message are such names, so a front end that calls them otherwise (the CLI: `--mask-grow`,
    cli/names.py; ComfyUI: the Loader's widgets, nodes/comfy_names.py) can say its own names without the checks
    knowing about it (`worded`).
    """

    settings: tuple[str, ...] = ()

    def naming(self: _E, *settings: str) -> _E:
        """This error, recording that its message names `settings` (returned, to raise in one expression)."""
        self.settings = tuple(settings)
        return self


class InvalidInputError(ErnieImageError, ValueError):
    """A setting the user chose is out of range (size, steps, prompt...)."""


class ModelFileError(ErnieImageError):
    """A weight file is missing, corrupt, or not the ERNIE-Image component that was expected."""


class MemoryBudgetError(ErnieImageError):
    """The job cannot fit the VRAM budget; raised before anything is allocated."""


class RemoteError(ErnieImageError):
    """A remote server (SGLang or a chat endpoint) failed or answered something unusable."""


class Cancelled(ErnieImageError):
    """The host asked to stop (ComfyUI's Cancel, Ctrl-C in the CLI)."""


class NamedLine(str):
    """A notice (Host.log's line) that names settings by their Python names, recorded as ErnieImageError.naming
    records them for an error, so that a front end words it as it words an error. Any other line names none: a
    front end never guesses which of its words are settings."""

    settings: tuple[str, ...] = ()


def naming_line(text: str, *settings: str) -> NamedLine:
    """`text` as a line recording that it names `settings`."""
    line = NamedLine(text)
    line.settings = tuple(settings)
    return line


def named_settings(text: object) -> tuple[str, ...]:
    """The settings an error or a line names by their Python names (none for a plain string)."""
    return tuple(getattr(text, "settings", ())) if isinstance(text, (ErnieImageError, NamedLine)) else ()


SHOWN_CHARACTERS = 40  # of a value a refusal quotes in full (a prompt or a number may be long)


def quoted_shortly(text: str) -> str:
    """`text` quoted, a long one with its middle left out (the ends tell two paths or prompts apart)."""
    if len(text) <= SHOWN_CHARACTERS:
        return repr(text)
    half = SHOWN_CHARACTERS // 2
    return repr(text[:half] + "..." + text[-half:])


SHOWN_VALUE_CHARACTERS = 80  # of a value a file holds (a config's list), shown in full up to this


def shown_shortly(shown: str) -> str:
    """A value as a message writes it (a config's list, say), a long one with its middle left out: a config holding
    100,000 numbers is refused in a line, not in 700 KB."""
    if len(shown) <= SHOWN_VALUE_CHARACTERS:
        return shown
    half = (SHOWN_VALUE_CHARACTERS - 5) // 2
    head, tail = shown[:half], shown[-half:]
    head = head[:head.rfind(", ") + 1] if ", " in head else head  # whole items of a list, not half a number
    tail = tail[tail.find(", ") + 2:] if ", " in tail else tail
    return f"{head} ... {tail}"


def one_line(error: BaseException, limit: int = 200) -> str:
    """`Type: message` of an unexpected error, whitespace collapsed and cut: the detail a one-line message quotes."""
    return " ".join(f"{type(error).__name__}: {error}".split())[:limit]


def worded(text: str, settings: Iterable[str], names: Mapping[str, str]) -> str:
    """`text` with each of `settings` (Python names it uses) written as a front end calls it (`names`), where the
    text first names it as a word: later words may be prose ("save the prompt as UTF-8"), and a name inside a path or
    a file name (`/models/vae/flux2-vae.safetensors`, `pe.safetensors`, a folder listed as `text_encoder/`) is not the
    setting. A name may be a phrase (words with spaces: never a path), such as an option a front end words its own
    way; an empty label leaves it out (an option the front end has not). A name without an entry in `names` is shown
    as it is."""
    settings = tuple(settings)
    words = set(settings) | {names[name] for name in settings if name in names}
    for name in sorted(settings, key=len, reverse=True):  # "mask_grow" before "mask"
        label = names.get(name)
        if label is None:
            continue
        # not after "." either: a dotted key such as the metadata key ernie_image.variant is no setting
        for found in re.finditer(rf"(?<![\w.-]){re.escape(name)}(?![\w-])(?!\.\w)", text):
            if " " in name or not _in_path(text, found.start(), found.end(), words):
                text = text[:found.start()] + label + text[found.end():]
                break
    return text


def _in_path(text: str, start: int, end: int, words: set[str]) -> bool:
    """Whether text[start:end] is part of a path: a word with / or \\ in it whose parts are not all setting names
    ("width/height" names two settings; "/models/vae/x" and "vae/" are paths)."""
    left = max(text.rfind(" ", 0, start), text.rfind("\t", 0, start)) + 1
    right = min((i for i in (text.find(" ", end), text.find("\t", end)) if i != -1), default=len(text))
    token = text[left:right].strip("()[]{},;:'\"`")
    if "/" not in token and "\\" not in token:
        return False
    return not all(part in words for part in re.split(r"[/\\]", token))
