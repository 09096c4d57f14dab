"""`python -m ernie_image`: the CLI (runtime/cli/commands.py). A Ctrl-C while it is still being imported is a cancel too."""
import os
import signal
import sys

_signals_while_importing: list[int] = []


def _interrupt_while_importing(number: int, frame) -> None:
    _signals_while_importing.append(number)
    raise KeyboardInterrupt


for _number in (signal.SIGINT, signal.SIGTERM):
    signal.signal(_number, _interrupt_while_importing)
try:
    from .runtime.cli.commands import CANCELLED_EXIT_CODES, main
except BaseException:
    # A Ctrl-C inside an extension module's import can surface as an ImportError: the signal decides.
    if not _signals_while_importing:
        raise
    print("\ncancelled", file=sys.stderr)
    raise SystemExit(128 + _signals_while_importing[0]) from None

try:
    code = main()
except KeyboardInterrupt:
    # A signal after the imports but before main() has put its own handlers in place.
    if not _signals_while_importing:
        raise
    print("\ncancelled", file=sys.stderr)
    code = 128 + _signals_while_importing[0]
if code in CANCELLED_EXIT_CODES:
    # A `-m` run that handled a Ctrl-C was seen, under load, to end by SIGINT after printing "cancelled" (CPython
    # re-raises SIGINT at exit once it marks a KeyboardInterrupt unhandled). Leave with the promised code; the
    # run's files are already gone.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
raise SystemExit(code)
