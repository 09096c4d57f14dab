"""Ctrl-C and SIGTERM as a cancel for a command: remembered, raised where Python runs, held off inside a file step
that must not be cut in half (files/uninterrupted.py), and ignored once the outputs are written."""
from __future__ import annotations

import sys
import threading
from typing import Any, Optional

from ..files.uninterrupted import interrupt_now


class Interrupts:
    """SIGINT (Ctrl-C) and SIGTERM as a cancel: the first raises KeyboardInterrupt wherever Python runs (a file step
    that must not be cut in half raises it once done: uninterrupted.py), and is remembered, so code that swallowed
    the KeyboardInterrupt still ends as cancelled (host.check_cancel)."""

    def __init__(self) -> None:
        self.signal_number: Optional[int] = None
        self.ignoring = False  # outputs_written: the signals are ignored from now on
        self._previous: Optional[tuple[dict[int, Any], Any]] = None  # the handlers and unraisable hook install replaced

    def install(self) -> None:
        import signal

        if threading.current_thread() is threading.main_thread():
            previous_hook = sys.unraisablehook
            self._previous = ({number: signal.getsignal(number) for number in (signal.SIGINT, signal.SIGTERM)},
                              previous_hook)
            for number in (signal.SIGINT, signal.SIGTERM):
                signal.signal(number, self._handle)

            def quiet_interrupts(unraisable) -> None:
                # A signal that lands in a finalizer or weakref callback (importlib's module-lock callbacks, say)
                # is printed by Python as "Exception ignored ... KeyboardInterrupt" and dropped; it is remembered
                # here and the run ends as cancelled at its next check, so nothing needs printing.
                if isinstance(unraisable.exc_value, KeyboardInterrupt) and self.signal_number is not None:
                    return
                # A signal that arrived just before outputs_written ignored it: Python reports the handler it no
                # longer finds ("Signal 2 ignored due to race condition"); ignoring it was the point.
                if self.ignoring and isinstance(unraisable.exc_value, OSError) and \
                        "ignored due to race condition" in str(unraisable.exc_value):
                    return
                previous_hook(unraisable)

            sys.unraisablehook = quiet_interrupts

    def restore(self) -> None:
        """Put back the signal handlers and the unraisable hook that `install` replaced (for a caller that goes on
        running in this process: main(argv) from Python or a test)."""
        import signal

        if self._previous is not None and threading.current_thread() is threading.main_thread():
            handlers, hook = self._previous
            for number, handler in handlers.items():
                signal.signal(number, handler if handler is not None else signal.SIG_DFL)
            sys.unraisablehook = hook
            self._previous = None

    def _handle(self, number: int, frame) -> None:
        self.signal_number = number
        if interrupt_now():  # else a file step under way raises it once it is over
            raise KeyboardInterrupt

    @property
    def exit_code(self) -> int:
        import signal

        return 128 + (self.signal_number or signal.SIGINT)

    def raise_if_interrupted(self) -> None:
        if self.signal_number is not None:
            raise KeyboardInterrupt

    def outputs_written(self) -> None:
        """The run's files are complete and about to replace the targets: from now on Ctrl-C and SIGTERM have
        nothing to undo and are ignored while the files are renamed, the command finishes printing and the process
        exits (with the run's own exit code)."""
        import signal

        if threading.current_thread() is threading.main_thread() and self.signal_number is None:
            self.ignoring = True
            for number in (signal.SIGINT, signal.SIGTERM):
                signal.signal(number, signal.SIG_IGN)
