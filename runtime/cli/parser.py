"""The argument parser every `ernie-image` command uses: a usage error is this CLI's one line, not a usage block.

Options whose value is a number read it with `WholeNumber` / `DecimalNumber`: plain decimal forms only
(core/number_text), so `--cfg 4_5` is refused instead of running at CFG 45. An option that names one thing (a file,
the prompt, the seed, the step cache's settings) is added with `once=True`: given again with another value it is
refused, since the command would silently keep the last one and drop the other the user meant. Values are compared
as read (a number by its value, a path made absolute, the step cache by its settings), so `--seed 7 --seed 07`,
`--model-dir m --model-dir m/` and `--step-cache dbcache:threshold=0.1 --step-cache dbcache:threshold=.1` are one value
given twice, which is harmless. A setting a later value may override (a size, a step count, a budget: how
a command kept in a script is adjusted) keeps argparse's rule, the last one wins.
"""
from __future__ import annotations

import argparse
import os
import re
from pathlib import Path
from typing import Any, NoReturn, Optional, Sequence, Union

from ..core.errors import InvalidInputError, quoted_shortly
from ..core.number_text import DECIMAL_RULE, WHOLE_RULE, Range, decimal_from_text, whole_from_text
from .terminal_text import holds_control_character, one_terminal_line, undecodable_byte


class OneLineParser(argparse.ArgumentParser):
    """argparse, with its usage errors raised as InvalidInputError (the CLI prints `error: ...` and exits 2)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.given_once: dict[str, tuple[Any, str]] = {}  # this parse's `once` options: dest -> (meaning, text)

    def parse_known_args(self, args: Optional[Sequence[str]] = None,  # type: ignore[override]
                         namespace: Optional[argparse.Namespace] = None) -> tuple[argparse.Namespace, list[str]]:
        self.given_once = {}
        try:
            return super().parse_known_args(args, namespace)
        finally:
            self.given_once = {}

    def error(self, message: str) -> NoReturn:
        missing = re.fullmatch(r"argument (--[\w-]+)(?:/\S+)?: expected one argument", message)
        if missing:  # argparse takes `--cfg -1e2`'s value for an option: `--cfg=-1e2` is read as the value
            flag = missing.group(1)
            message = f"{flag} needs a value: give one after it (one that starts with '-' as {flag}=VALUE)"
        raise InvalidInputError(f"{message}: see '{self.prog} --help'")


class Option(argparse.Action):
    """A single-valued option: its text read by `read` (the text itself here); `once`: refused when given again
    with another value (the module docstring says which options are), `repeat_hint` ending that refusal, which
    quotes both values unless `quiet` (an API key option: a key pasted by mistake is never printed). `example`: a
    value the fixes show. An error raised here reaches the user as it is (argparse rewords only the errors of a
    `type`)."""

    def __init__(self, option_strings: Sequence[str], dest: str, once: bool = False, example: str = "",
                 repeat_hint: str = "", quiet: bool = False, **kwargs: Any) -> None:
        super().__init__(option_strings, dest, **kwargs)
        self.once = once
        self.example = example
        self.repeat_hint = repeat_hint
        self.quiet = quiet

    @property
    def flag(self) -> str:
        return self.option_strings[0]

    def read(self, text: str) -> Any:
        return text

    def meaning(self, value: Any) -> Any:
        """What two values given for a `once` option are compared by: the value as read."""
        return value

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace,
                 values: Union[str, Sequence[Any], None], option_string: Optional[str] = None) -> None:
        text = str(values)
        value = self.read(text)
        if self.once:
            self._refuse_another_value(parser, text, value)
        setattr(namespace, self.dest, value)

    def _refuse_another_value(self, parser: argparse.ArgumentParser, text: str, value: Any) -> None:
        if not isinstance(parser, OneLineParser):
            raise TypeError(f"{self.flag} is added with once=True, which needs a OneLineParser")
        meaning = self.meaning(value)
        earlier = parser.given_once.get(self.dest)
        if earlier is not None and earlier[0] != meaning:
            values = "with two values" if self.quiet else f"({quoted_shortly(earlier[1])} and {quoted_shortly(text)})"
            raise InvalidInputError(f"{self.flag} is given twice {values} and the command takes one: give it "
                                    f"once{self.repeat_hint}")
        parser.given_once[self.dest] = (meaning, text)


def _path_meaning(path: Path) -> str:
    """A path as the file system reads it: `~` expanded, relative to the working folder, `m/`, `./m`, `m` and its
    absolute form one path (links are not followed)."""
    return os.path.abspath(os.path.expanduser(str(path)))


class PathOption(Option):
    """A path option that stores a Path and refuses an empty value, which Path would read as the current folder."""

    def read(self, text: str) -> Path:
        if not text.strip():
            raise InvalidInputError(f"{self.flag} is empty: give a path")
        return Path(text)

    def meaning(self, value: Path) -> str:
        return _path_meaning(value)


class OutputPath(Option):
    """A path option that stores a Path and refuses an empty value (`--out=`), which Path would read as `.`.
    `metavar` names what to give, e.g. "PNG" ("--out is empty: give a .png path"), unless `what` says it."""

    def __init__(self, *args: Any, what: str = "", **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.what = what or f"a .{str(self.metavar).lower()} path"

    def read(self, text: str) -> Path:
        if not text.strip():
            raise InvalidInputError(f"{self.flag} is empty: give {self.what}")
        if text.endswith("/") and not os.path.isdir(text):  # Path() drops the '/': a file would take the name
            raise InvalidInputError(f"{self.flag} {text} ends in '/', as a folder's name does, and is no folder: "
                                    f"give {self.what} without the '/'")
        undecodable = undecodable_byte(text)
        if undecodable:
            raise InvalidInputError(f"{self.flag} {one_terminal_line(text)} holds the byte {undecodable}, which is not "
                                    "UTF-8 text: give a name in UTF-8")
        if holds_control_character(text):
            # The command prints the paths it wrote, one a line: a name holding a line break would read as two.
            raise InvalidInputError(f"{self.flag} {text!r} holds a control character (a line break, a tab, an "
                                    "escape, a direction override): give a name without one")
        return Path(text)

    def meaning(self, value: Path) -> str:
        return _path_meaning(value)


class NumberOption(Option):
    """An option whose value is a number. `allowed`: the range (low, high) the command's check holds it to; a number
    past what Python reads (`1e999`, 41 digits; `1e-400` where the range has no 0) is refused quoting what was typed,
    with that range, in the check's words. Without it, such a number is refused as too large."""

    def __init__(self, *args: Any, allowed: Optional[Range] = None, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.allowed = allowed


class WholeNumber(NumberOption):
    """A whole number in plain digits (a sign allowed); the range is the command's check."""

    def read(self, text: str) -> int:
        number = whole_from_text(text, self.flag, self.allowed)
        if number is None:
            raise InvalidInputError(f"{self.flag} {text!r} is not a whole number: give {WHOLE_RULE}, e.g. "
                                    f"{self.flag} {self.example or 1}")
        return number


class DecimalNumber(NumberOption):
    """A number in plain decimal form (core/number_text); the range is the command's check."""

    def read(self, text: str) -> float:
        number = decimal_from_text(text, self.flag, self.allowed)
        if number is None:
            raise InvalidInputError(f"{self.flag} {text!r} is not a number: give a plain decimal, e.g. "
                                    f"{self.flag} {self.example or 1.0} ({DECIMAL_RULE})")
        return number
