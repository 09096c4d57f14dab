"""What a command shows on stderr: progress and notices, each line whole, and the host the runtime reports to.

On a terminal, progress is a tqdm bar with its rate and the time left, redrawn in place; a notice is printed above
it. Anywhere else (a log file, a pipe) progress is plain lines: the first count, one each tenth of the way or every
few seconds, and the last; nothing is rewritten in place, so no two counts run together in a log. Each count names
what it counts ("sampling: step 3/8", "prompt enhancer: token 64/512"), as the runtime announces it
(core.host.show_progress_phase).
"""
from __future__ import annotations

import os
import sys
import time
from typing import Optional, TextIO

from tqdm import tqdm

from ..core.errors import named_settings
from ..core.host import NullHost
from .interrupts import Interrupts
from .names import cli_words
from .terminal_text import plain_terminal_lines

PLAIN_LINE_EVERY_S = 5.0  # in a log, a count at least this often while the work goes on
PLAIN_LINES_PER_RUN = 10  # ... and one each tenth of the way
FALLBACK_SIZE = (100, 24)  # columns, rows
clock = time.monotonic  # the seconds progress is timed by


def plain_count(name: str, unit: str, value: int, total: int, elapsed_s: float) -> str:
    """"sampling: step 3/8 (38%), 2.05 steps/s, 00:02 left": the count, its rate and the time left (once known)."""
    text = f"{name}: {unit} {value}/{total} ({100 * value // max(total, 1)}%)"
    if value <= 0 or elapsed_s <= 0:
        return text
    rate = value / elapsed_s
    speed = f"{rate:.2f} {unit}s/s" if rate >= 1 else f"{1 / rate:.2f} s/{unit}"
    return f"{text}, {speed}, {tqdm.format_interval((total - value) / rate)} left"


class Console:
    """stderr as a command shows it (the module docstring says how)."""

    def __init__(self, stream: Optional[TextIO] = None) -> None:
        self._stream = stream  # None: sys.stderr as it is at each write (tests capture it)
        self.name, self.unit = "progress", "step"
        self._bar: Optional[tqdm] = None
        self._total: Optional[int] = None
        self._last_value = -1
        self._started: Optional[float] = None
        self._last_line_at: Optional[float] = None
        self._last_part = -1

    @property
    def stream(self) -> TextIO:
        return self._stream if self._stream is not None else sys.stderr

    def phase(self, name: str, unit: str) -> None:
        """The counts that follow are `unit`s of `name`; a count still shown ends here."""
        self.end_progress()
        self.name, self.unit = name, unit
        self._started = clock()

    def progress(self, value: int, total: int) -> None:
        if total != self._total or value < self._last_value:  # a new count (the next image, the next prompt)
            started = self._started
            self.end_progress()
            self._total, self._started = total, started or clock()
        if value == self._last_value:
            return  # the same count again (a remote estimate is polled every 0.1 s)
        self._last_value = value
        if self.stream.isatty():
            self._show_bar(value, total)
        else:
            self._show_line(value, total)
        if value >= total:
            self.end_progress()

    def _show_bar(self, value: int, total: int) -> None:
        if self._bar is None:
            # A terminal that reports no size (a bare pty) gets a fixed one: tqdm would hide the bar in zero rows.
            sized = _columns(self.stream) > 0
            self._bar = tqdm(total=total, desc=self.name, unit=self.unit, file=self.stream, leave=True,
                             dynamic_ncols=sized, ncols=None if sized else FALLBACK_SIZE[0],
                             nrows=None if sized else FALLBACK_SIZE[1])
            # The rate counts from the phase's start, not from its first count (tqdm keeps wall-clock times).
            self._bar.start_t = self._bar._time() - (clock() - (self._started or clock()))
        self._bar.update(value - self._bar.n)

    def _show_line(self, value: int, total: int) -> None:
        now = clock()
        part = value * PLAIN_LINES_PER_RUN // max(total, 1)
        due = (self._last_line_at is None or value >= total or part > self._last_part
               or now - self._last_line_at >= PLAIN_LINE_EVERY_S)
        if due:
            self._write(plain_count(self.name, self.unit, value, total, now - (self._started or now)) + "\n")
            self._last_line_at, self._last_part = now, part

    def end_progress(self) -> None:
        """Stop showing the current count (a bar stays on the screen as it last was)."""
        if self._bar is not None:
            self._bar.close()
            self._bar = None
        self._total, self._last_value, self._started, self._last_line_at, self._last_part = None, -1, None, None, -1

    def line(self, text: str) -> None:
        """A whole line: above the bar while one is shown."""
        if self._bar is not None:
            with self._bar.external_write_mode(file=self.stream):
                self._write(text + "\n")
        else:
            self._write(text + "\n")

    def _write(self, text: str) -> None:
        # One write per line (print writes the text and its end separately: a Ctrl-C between them lost the newline)
        self.stream.write(text)
        self.stream.flush()


def _columns(stream: TextIO) -> int:
    try:
        return os.get_terminal_size(stream.fileno()).columns
    except (AttributeError, OSError, ValueError):  # no file descriptor (a test's stream), or not a terminal
        return 0


STDERR = Console()


class ConsoleHost(NullHost):
    """Progress and notices on stderr; Ctrl-C is the cancel (`interrupts`; None: Python's own KeyboardInterrupt)."""

    def __init__(self, interrupts: Optional[Interrupts] = None, console: Console = STDERR) -> None:
        super().__init__()
        self.interrupts = interrupts
        self.console = console

    def progress_phase(self, name: str, unit: str) -> None:
        self.console.phase(name, unit)

    def progress(self, value: int, total: int, preview=None) -> None:
        self.console.progress(value, total)

    def log(self, message: str) -> None:
        # The settings a notice names, as flags; an escape sequence inside it shown as plain text.
        self.console.line(plain_terminal_lines(cli_words(message, named_settings(message))))

    def check_cancel(self) -> None:
        if self.interrupts is not None:
            self.interrupts.raise_if_interrupted()
