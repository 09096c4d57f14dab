"""What the user asked for: LoRA files and their strengths, in order (checked before any weights are read)."""
from __future__ import annotations

import math
import os
from collections.abc import Mapping
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Iterable, Optional, Union

from ..core.errors import InvalidInputError

MAX_STRENGTH = 10.0
# How a LoRA reaches the DiT: "merge" adds its delta into the resident weights in place (merge.py; no cost per
# step), "branch" runs it beside each Linear (attach.py; its own buffers, a few % per step). None: the pipe's
# LoadOptions.lora_mode.
LORA_MODES = ("merge", "branch")


def check_strength(strength: float, name: str = "") -> float:
    label = f"LoRA {name} strength" if name else "LoRA strength"
    try:
        if isinstance(strength, (bool, str, bytes)):  # float("1") would pass a config's text through unread
            raise TypeError("not a number")
        value = float(strength)
    except OverflowError:
        value = math.inf  # an integer beyond float range: refused below as out of range
    except (TypeError, ValueError):
        raise InvalidInputError(f"{label} {strength!r} is not a number: use a value from -10 to 10 (1.0 = as "
                                f"trained)") from None
    if not math.isfinite(value) or abs(value) > MAX_STRENGTH:
        raise InvalidInputError(f"{label} {value} is not allowed: use a finite value from -{MAX_STRENGTH:g} to "
                                f"{MAX_STRENGTH:g} (1.0 = as trained)")
    return value


def check_mode(mode: Optional[str]) -> Optional[str]:
    if mode is not None and mode not in LORA_MODES:
        raise InvalidInputError(f"LoRA mode {mode!r} is not known: use merge (into the weights, no cost per step) or "
                                f"branch (beside the weights)")
    return mode


@dataclass(frozen=True)
class LoraEntry:
    path: Path
    strength: float = 1.0
    mode: Optional[str] = None  # "merge", "branch"; None: the pipe's LoadOptions.lora_mode

    def __post_init__(self) -> None:
        object.__setattr__(self, "path", Path(self.path))
        object.__setattr__(self, "strength", check_strength(self.strength, Path(self.path).name))
        object.__setattr__(self, "mode", check_mode(self.mode))

    @property
    def name(self) -> str:
        return self.path.name


EntryLike = Union[LoraEntry, str, Path, tuple]


@dataclass(frozen=True)
class LoraStack:
    """LoRAs applied together, in order; the empty stack is the base model."""

    entries: tuple[LoraEntry, ...] = ()

    def __post_init__(self) -> None:
        refuse_repeated_files(self.entries)

    @classmethod
    def of(cls, items: Union["LoraStack", Iterable[EntryLike], None], mode: Optional[str] = None) -> "LoraStack":
        """From a stack, or from entries, paths, (path, strength) or (path, strength, mode) tuples; `mode` is given
        to the entries that name none."""
        check_mode(mode)
        if items is None:
            return cls()
        if isinstance(items, LoraStack):
            items = items.entries
        if isinstance(items, (str, Path, LoraEntry)):
            items = [items]
        if isinstance(items, Mapping):  # {path: strength}
            items = list(items.items())
        if not isinstance(items, Iterable):
            raise InvalidInputError(f"LoRAs {items!r:.80} are not a list: give e.g. [('style.safetensors', 0.8)], "
                                    f"{{'style.safetensors': 0.8}} or one path")
        entries = []
        for item in items:
            entry = _entry(item)
            entries.append(entry if entry.mode is not None or mode is None else replace(entry, mode=mode))
        return cls(tuple(entries))

    def plus(self, other: Union["LoraStack", Iterable[EntryLike]], mode: Optional[str] = None) -> "LoraStack":
        return LoraStack(self.entries + LoraStack.of(other, mode).entries)

    def __bool__(self) -> bool:
        return bool(self.entries)

    def __len__(self) -> int:
        return len(self.entries)

    def display_names(self) -> list[str]:
        """Each entry's file name, with its folder's name where two entries share a file name (names only: full
        paths may hold a user name)."""
        names = [entry.name for entry in self.entries]
        return [f"{entry.path.parent.name}/{name}" if names.count(name) > 1 and entry.path.parent.name else name
                for entry, name in zip(self.entries, names)]

    def metadata(self) -> list[dict]:
        """File names and strengths, for PNG text and result info."""
        return [{"name": name, "strength": entry.strength} for entry, name in zip(self.entries, self.display_names())]


def _entry(item: object) -> LoraEntry:
    """One LoRA as the Python API takes it: a LoraEntry, a path, or (path, strength[, mode])."""
    if isinstance(item, LoraEntry):
        return item
    path = item[0] if isinstance(item, (tuple, list)) and item else item
    if isinstance(path, str) and not path:
        raise InvalidInputError("a LoRA entry has an empty path: give the LoRA's .safetensors file")
    if isinstance(item, (str, Path)):
        return LoraEntry(Path(item))
    if isinstance(item, (tuple, list)) and 1 <= len(item) <= 3 and isinstance(item[0], (str, Path)):
        return LoraEntry(*item)
    raise InvalidInputError(f"LoRA entry {item!r:.80} is not a path, (path, strength) or (path, strength, mode): "
                            f"give e.g. ('style.safetensors', 0.8)")


def file_identity(path: Path) -> tuple:
    """The file a path names, the same through links (symbolic or hard) and relative parts; a missing file is
    named by its absolute path (refused later, when it is opened). A path that cannot be followed: one line."""
    try:
        found = os.stat(path.expanduser())
    except FileNotFoundError:
        return ("path", os.path.abspath(path.expanduser()))
    except (OSError, ValueError) as error:  # a symlink loop, a NUL character, no permission on a folder
        reason = getattr(error, "strerror", None) or str(error)
        raise InvalidInputError(f"LoRA {path.name!r}: its path cannot be followed ({reason}): give the path of the "
                                f".safetensors file itself") from None
    return ("file", found.st_dev, found.st_ino)


def refuse_repeated_files(entries: Iterable[LoraEntry]) -> None:
    """The same file twice in one stack would apply it at the sum of its strengths, which nobody means by chaining
    a node twice: refused, naming both strengths and the one strength that gives the same result."""
    seen: dict[tuple, LoraEntry] = {}
    for entry in entries:
        key = file_identity(entry.path)
        first = seen.get(key)
        if first is not None:
            raise InvalidInputError(f"LoRA {entry.name} is given twice (strengths {first.strength:g} and "
                                    f"{entry.strength:g}), which would apply it at {first.strength + entry.strength:g}:"
                                    f" give it once, with the strength you want")
        seen[key] = entry


def describe_stack(loras: LoraStack) -> str:
    if not loras:
        return "LoRA: none"
    return "LoRA: " + ", ".join(f"{name} ({entry.strength:g})" for entry, name in zip(loras.entries,
                                                                                     loras.display_names()))
