"""The first code of every ``nodeguard`` process (the console script and ``python -m nodeguard``).

``nodeguard run`` takes SIGTERM, SIGINT and SIGHUP over here, before anything
else is imported (``early_signals``): only the interpreter's own start comes
before, and the daemon honours a stop or a reload from then on. Then, while
nothing costly has run yet, a successor asks the daemon that holds the node for
room to start in (``successor_start``).
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

OPTIONS_WITH_VALUE = ("--log-level",)  # the top-level options that take a value (see surfaces/cli.py)


def command_of(argv: Sequence[str]) -> str | None:
    """The subcommand: the first word that is neither a top-level option nor its value."""
    words = iter(argv)
    for word in words:
        if word in OPTIONS_WITH_VALUE:
            next(words, None)
        elif not word.startswith("-"):
            return word
    return None


def main(argv: Sequence[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if command_of(args) == "run":
        from nodeguard.early_signals import EARLY

        EARLY.install()
        from nodeguard.successor_start import announce, start_of

        start = start_of(args)
        if start is not None:  # when a daemon holds the node, room for this start is made before it costs anything
            announce(start.ledger_path, wait_seconds=start.wait_seconds)
    from nodeguard.surfaces.cli import main as cli_main

    return cli_main(args)
