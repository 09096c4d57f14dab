"""What the user asked for: LoRA files and their strengths, in order (checked before any weights are read)."""
from __future__ import annotations

import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Union

from ..errors import InvalidInputError

MAX_STRENGTH = 10.0
_NUMBER = re.compile(r"[-+]?(\d+\.?\d*|\.\d+)([eE][-+]?\d+)?|[-+]?(nan|inf|infinity)", re.IGNORECASE)


def check_strength(strength: float, name: str = "") -> float:
    label = f"LoRA {name} strength" if name else "LoRA strength"
    try:
        value = float(strength)
    except (TypeError, ValueError):
        raise InvalidInputError(f"{label} {strength!r} is not a number: use a value from -10 to 10 (1.0 = as "
                                f"trained)") from None
    if not math.isfinite(value) or abs(value) > MAX_STRENGTH:
        raise InvalidInputError(f"{label} {value} is not allowed: use a finite value from -{MAX_STRENGTH:g} to "
                                f"{MAX_STRENGTH:g} (1.0 = as trained)")
    return value


@dataclass(frozen=True)
class LoraEntry:
    path: Path
    strength: float = 1.0

    def __post_init__(self) -> None:
        object.__setattr__(self, "path", Path(self.path))
        object.__setattr__(self, "strength", check_strength(self.strength, Path(self.path).name))

    @property
    def name(self) -> str:
        return self.path.name


EntryLike = Union[LoraEntry, str, Path, tuple]


@dataclass(frozen=True)
class LoraStack:
    """LoRAs applied together, in order; the empty stack is the base model."""

    entries: tuple[LoraEntry, ...] = ()

    @classmethod
    def of(cls, items: Union["LoraStack", Iterable[EntryLike], None]) -> "LoraStack":
        """From a stack, or from entries, paths, or (path, strength) pairs."""
        if items is None:
            return cls()
        if isinstance(items, LoraStack):
            return items
        if isinstance(items, (str, Path, LoraEntry)):
            items = [items]
        entries = []
        for item in items:
            if isinstance(item, LoraEntry):
                entries.append(item)
            elif isinstance(item, (str, Path)):
                entries.append(LoraEntry(Path(item)))
            else:
                path, strength = item
                entries.append(LoraEntry(Path(path), strength))
        return cls(tuple(entries))

    def plus(self, other: Union["LoraStack", Iterable[EntryLike]]) -> "LoraStack":
        return LoraStack(self.entries + LoraStack.of(other).entries)

    def __bool__(self) -> bool:
        return bool(self.entries)

    def __len__(self) -> int:
        return len(self.entries)

    def metadata(self) -> list[dict]:
        """File names and strengths, for PNG text and result info (names only: full paths may hold a user name)."""
        return [{"name": entry.name, "strength": entry.strength} for entry in self.entries]


def parse_lora_argument(text: str) -> LoraEntry:
    """`PATH[:STRENGTH]` (the CLI's --lora): strength 1.0 when left out; a drive colon (C:\\x) is part of the path."""
    path, sep, tail = text.rpartition(":")
    if sep and path and _NUMBER.fullmatch(tail.strip()) and not (len(path) == 1 and path.isalpha()):
        return LoraEntry(Path(path), check_strength(tail, Path(path).name))
    if not text:
        raise InvalidInputError("--lora needs a file: give --lora PATH or --lora PATH:STRENGTH")
    if sep and Path(path).suffix.lower() == ".safetensors":
        raise InvalidInputError(f"LoRA {Path(path).name} strength {tail!r} is not a number: give --lora "
                                f"{path}:0.8 (or leave ':STRENGTH' out for 1.0)")
    return LoraEntry(Path(text))
