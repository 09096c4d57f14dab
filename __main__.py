"""`python -m ernie_image`: the CLI (runtime/cli.py). A Ctrl-C while it is still being imported is a cancel too."""
import os
import sys

try:
    from .runtime.cli import CANCELLED_EXIT_CODES, main
except KeyboardInterrupt:
    print("\ncancelled", file=sys.stderr)
    raise SystemExit(130) from None

code = main()
if code in CANCELLED_EXIT_CODES:
    # A `-m` run that handled a Ctrl-C was seen, under load, to end by SIGINT after printing "cancelled" (CPython
    # re-raises SIGINT at exit once it marks a KeyboardInterrupt unhandled). Leave with the promised code; the
    # run's files are already gone.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
raise SystemExit(code)
