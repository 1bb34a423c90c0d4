"""``nodeguard`` processes forked from an interpreter that has already imported the daemon: for the QEMU VM.

Under emulation every ``python -m nodeguard run`` spends 12-16 s importing its
modules before its first tick, and the kernel tests start about ten daemons.
There, ``DaemonProcess`` forks them instead from a multiprocessing forkserver
that imported the same modules once, at the start of the session (while pytest
collects): the child runs ``nodeguard.entry.main`` with the test's arguments,
environment, working directory and log file, exactly as the exec'd command
would after its imports. Only the import itself is skipped; the start-up path
(``early_signals``, signals before and during the imports) is what
``tests/integration/test_start_signals.py`` checks, and it always execs.
"""

from __future__ import annotations

import multiprocessing
import multiprocessing.context
import os
import signal
import subprocess
import sys
from collections.abc import Mapping, Sequence

_context = multiprocessing.get_context("forkserver")
_context.set_forkserver_preload(["tests.preloaded_modules"])  # what ``nodeguard run`` imports before a tick


def warm() -> None:
    """Start the forkserver now: it imports in the background while the caller goes on."""
    from multiprocessing import forkserver

    forkserver.ensure_running()


def _run(argv: list[str], log_path: str, env: dict[str, str], cwd: str) -> None:
    """The child: the exec'd command's stdio, environment and directory, then nodeguard's own entry point."""
    log = os.open(log_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    os.dup2(log, 1)
    os.dup2(log, 2)
    os.close(log)
    os.environ.clear()
    os.environ.update(env)
    os.chdir(cwd)
    sys.argv = ["nodeguard", *argv]
    from nodeguard.entry import main

    sys.exit(main(argv))


class Forked:
    """The part of ``subprocess.Popen`` the tests use, for a process the forkserver started."""

    def __init__(self, process: multiprocessing.context.ForkServerProcess) -> None:
        self._process = process
        assert process.pid is not None
        self.pid: int = process.pid

    @property
    def returncode(self) -> int | None:
        return self._process.exitcode

    def poll(self) -> int | None:
        return self._process.exitcode

    def wait(self, timeout: float | None = None) -> int:
        self._process.join(timeout)
        code = self._process.exitcode
        if code is None:
            raise subprocess.TimeoutExpired(f"nodeguard (pid {self.pid})", timeout or 0)
        return code

    def send_signal(self, signum: int) -> None:
        if self.poll() is None:  # as Popen: never a signal to a pid that may have been reused
            os.kill(self.pid, signum)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


def start(argv: Sequence[str], log_path: str, env: Mapping[str, str], cwd: str) -> Forked:
    """``nodeguard ARGV`` forked from the preloaded interpreter, its output appended to ``log_path``."""
    process = _context.Process(target=_run, args=(list(argv), log_path, dict(env), cwd), name="nodeguard")
    process.start()
    return Forked(process)
