"""The argument parser every `ernie-image` command uses: a usage error is this CLI's one line, not a usage block."""
from __future__ import annotations

import argparse
from typing import NoReturn

from .errors import InvalidInputError


class OneLineParser(argparse.ArgumentParser):
    """argparse, with its usage errors raised as InvalidInputError (the CLI prints `error: ...` and exits 2)."""

    def error(self, message: str) -> NoReturn:
        raise InvalidInputError(f"{message}: see '{self.prog} --help'")
