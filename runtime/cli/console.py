"""What a command shows on stderr: progress and notices, each on a line of its own, and the host the runtime reports
to while a command runs."""
from __future__ import annotations

import sys

from ..core.host import NullHost
from ..core.variant import VARIANT_SETTING
from .interrupts import Interrupts
from .names import cli_words


class _Stderr:
    """stderr as the console shows it: a progress line (`step 3/8`, rewritten in place) stays open until a full
    line follows, which first ends it; so no notice lands inside a step count, and no blank line opens one."""

    def __init__(self) -> None:
        self.progress_open = False
        self.progress_text = ""

    def progress(self, text: str, done: bool) -> None:
        if self.progress_open and text == self.progress_text and not done:
            return  # the same count again (a remote estimate polled every 0.1 s): nothing new to show
        self._write(f"\r{text}" + ("\n" if done else ""))
        self.progress_open, self.progress_text = not done, text

    def line(self, text: str) -> None:
        self._write(("\n" if self.progress_open else "") + text + "\n")
        self.progress_open = False

    @staticmethod
    def _write(text: str) -> None:
        # One write per line (print writes the text and its end separately: a Ctrl-C between them lost the newline)
        sys.stderr.write(text)
        sys.stderr.flush()


STDERR = _Stderr()


class ConsoleHost(NullHost):
    """Progress and notices on stderr; Ctrl-C is the cancel (see Interrupts)."""

    def __init__(self, interrupts: "Interrupts") -> None:
        super().__init__()
        self.interrupts = interrupts

    def progress(self, value: int, total: int, preview=None) -> None:
        STDERR.progress(f"step {value}/{total}", done=value >= total)

    def log(self, message: str) -> None:
        STDERR.line(cli_words(message, (VARIANT_SETTING,)))  # a notice naming the variant setting names --variant

    def check_cancel(self) -> None:
        self.interrupts.raise_if_interrupted()
