"""`ernie-image check-remote URL...`: readiness, model, version and one tiny generation of each server, as a table
(remote/server_check.py does the checking)."""
from __future__ import annotations

import sys
from typing import Optional, Sequence

from ..net.credentials import ServerKeys
from ..net.settings import checked_seconds
from ..net.urls import normalize_base_url
from ..remote.server_check import GENERATION_TIMEOUT_S, check_with_keys, format_check_table
from ..remote.sglang import ENDPOINT_SUFFIXES, PROBE_READ_S
from .parser import OneLineParser
from .remote_args import cli_credentials, key_destinations


def main_check_remote(argv: Optional[Sequence[str]] = None) -> int:
    parser = OneLineParser(prog="ernie-image check-remote",
                           description="Check SGLang ERNIE-Image servers: readiness, model, version, one tiny generation.")
    parser.add_argument("urls", nargs="+", metavar="URL", help="server base URL, e.g. http://127.0.0.1:30000")
    parser.add_argument("--api-key-env", default=None, help="environment variable holding the API key")
    parser.add_argument("--api-key-file", default=None, help="file holding the API key")
    parser.add_argument("--no-generate", action="store_true", help="skip the tiny test generation")
    parser.add_argument("--connect-timeout", default=5.0, metavar="S",
                        help="seconds to wait for a server to accept the connection (default 5)")
    parser.add_argument("--read-timeout", default=None, metavar="S",
                        help=f"seconds each whole answer may take: readiness, model list, version and the tiny test "
                             f"image (default {PROBE_READ_S:g} for the first three, {GENERATION_TIMEOUT_S:g} for the "
                             f"image)")
    args = parser.parse_args(argv)
    for url in args.urls:  # a malformed URL is a usage error (exit 2), before any server is asked
        normalize_base_url(url, what="URL", endpoint_suffixes=ENDPOINT_SUFFIXES)
    connect_s = checked_seconds(args.connect_timeout, "--connect-timeout")
    read_s = None if args.read_timeout is None else checked_seconds(args.read_timeout, "--read-timeout")
    bases = [normalize_base_url(url) for url in args.urls]
    credentials = cli_credentials(bases, args.api_key_env, args.api_key_file)
    if key_destinations(credentials):
        print(key_destinations(credentials), file=sys.stderr)
    keys = ServerKeys.resolve(credentials, bases)
    rows = check_with_keys(args.urls, keys, generate=not args.no_generate, connect_timeout_s=connect_s,
                           generation_timeout_s=GENERATION_TIMEOUT_S if read_s is None else read_s,
                           probe_read_s=PROBE_READ_S if read_s is None else read_s, read_timeout_label="--read-timeout")
    print(format_check_table(rows))
    return 0 if all(row.ok for row in rows) else 1


if __name__ == "__main__":
    from .commands import main  # one-line errors and exit code 2, as `ernie-image check-remote`

    sys.exit(main(["check-remote", *sys.argv[1:]]))
