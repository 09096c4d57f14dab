"""The `ernie-image` command line: every command module. Nothing in the runtime imports it.

`main` is the `ernie-image` script's entry point (pyproject.toml) and `python -m ernie_image`'s."""
from .commands import CANCELLED_EXIT_CODES, main

__all__ = ["CANCELLED_EXIT_CODES", "main"]
