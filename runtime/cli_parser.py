"""The argument parser every `ernie-image` command uses: a usage error is this CLI's one line, not a usage block."""
from __future__ import annotations

import argparse
from typing import NoReturn

from .errors import InvalidInputError

# How the key options of `enhance` and `check-remote` are named in messages (the nodes name their widgets).
CLI_KEY_LABELS = dict(env_label="--api-key-env", file_label="--api-key-file", program="ernie-image")


class OneLineParser(argparse.ArgumentParser):
    """argparse, with its usage errors raised as InvalidInputError (the CLI prints `error: ...` and exits 2)."""

    def error(self, message: str) -> NoReturn:
        raise InvalidInputError(f"{message}: see '{self.prog} --help'")
