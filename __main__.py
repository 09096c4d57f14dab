"""`python -m ernie_image`: the CLI (runtime/cli/commands.py). A Ctrl-C while it is still being imported is a cancel too."""
import os
import signal
import sys

_signals_while_importing: list[int] = []


def _interrupt_while_importing(number: int, frame) -> None:
    _signals_while_importing.append(number)
    raise KeyboardInterrupt


def _leave_cancelled(code: int) -> None:
    """Exit with `code` (130 or 143) as promised. A `-m` run that handled a Ctrl-C was seen, under load, to end by
    SIGINT after printing "cancelled" (CPython re-raises SIGINT at exit once it marks a KeyboardInterrupt
    unhandled), whether the Ctrl-C came during the imports or during the run; the run's files are already gone."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


for _number in (signal.SIGINT, signal.SIGTERM):
    signal.signal(_number, _interrupt_while_importing)
try:
    from .runtime.cli.commands import CANCELLED_EXIT_CODES, main
except BaseException:
    # A Ctrl-C inside an extension module's import can surface as an ImportError: the signal decides.
    if not _signals_while_importing:
        raise
    print("\ncancelled", file=sys.stderr)
    _leave_cancelled(128 + _signals_while_importing[0])

try:
    code = main()
except KeyboardInterrupt:
    # A signal after the imports but before main() has put its own handlers in place.
    if not _signals_while_importing:
        raise
    print("\ncancelled", file=sys.stderr)
    code = 128 + _signals_while_importing[0]
if code in CANCELLED_EXIT_CODES:
    _leave_cancelled(code)
raise SystemExit(code)
