"""The argument parser every `ernie-image` command uses: a usage error is this CLI's one line, not a usage block."""
from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any, NoReturn, Optional, Sequence, Union

from ..core.errors import InvalidInputError

class OneLineParser(argparse.ArgumentParser):
    """argparse, with its usage errors raised as InvalidInputError (the CLI prints `error: ...` and exits 2)."""

    def error(self, message: str) -> NoReturn:
        raise InvalidInputError(f"{message}: see '{self.prog} --help'")


class OutputPath(argparse.Action):
    """A path option that stores a Path and refuses an empty value (`--out=`), which Path would read as `.`.
    `metavar` names what to give, e.g. "PNG" ("--out is empty: give a .png path")."""

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace,
                 values: Union[str, Sequence[Any], None], option_string: Optional[str] = None) -> None:
        text = str(values)
        if not text.strip():
            raise InvalidInputError(f"{option_string} is empty: give a .{str(self.metavar).lower()} path")
        setattr(namespace, self.dest, Path(text))
