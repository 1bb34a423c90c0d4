"""The process's first code: which command runs, and signals remembered while the daemon starts."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from collections.abc import Iterator

import pytest

from nodeguard.early_signals import STOPS, EarlySignals
from nodeguard.entry import command_of


@pytest.mark.parametrize(
    ("argv", "command"),
    [
        (["run", "--config", "x.json"], "run"),
        (["--log-level", "debug", "run"], "run"),
        (["--log-level=debug", "run"], "run"),
        (["gate", "--name", "run", "--", "run"], "gate"),
        (["--version"], None),
        ([], None),
    ],
)
def test_the_command_is_the_first_word_that_is_no_top_level_option(argv: list[str], command: str | None) -> None:
    """The subcommand is found past top-level options and their values, and later words never count."""
    assert command_of(argv) == command


@pytest.fixture
def restored_handlers() -> Iterator[None]:
    saved = {signum: signal.getsignal(signum) for signum in (*STOPS, signal.SIGHUP)}
    try:
        yield
    finally:
        for signum, handler in saved.items():
            signal.signal(signum, handler)


@pytest.mark.usefixtures("restored_handlers")
def test_early_signals_are_remembered_not_fatal() -> None:
    """SIGHUP is remembered as a reload and the first SIGTERM or SIGINT as the stop; neither ends the process."""
    early = EarlySignals().install()
    os.kill(os.getpid(), signal.SIGHUP)
    assert early.reload and early.stop is None
    os.kill(os.getpid(), signal.SIGTERM)
    os.kill(os.getpid(), signal.SIGINT)
    assert early.stop is signal.SIGTERM


def test_nodeguard_run_takes_its_signals_before_loading_anything_heavy() -> None:
    """The entry installs the handlers before the command line, config or daemon code is imported."""
    probe = (
        "import signal, sys\n"
        "import nodeguard.early_signals as e\n"
        "def install(self):\n"
        "    print(sorted(m for m in sys.modules if m.startswith('nodeguard')), flush=True)\n"
        "    raise SystemExit(0)\n"
        "e.EarlySignals.install = install\n"
        "from nodeguard.entry import main\n"
        "main(['run'])\n"
    )
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60, check=True)
    assert out.stdout.strip() == "['nodeguard', 'nodeguard.early_signals', 'nodeguard.entry']"
