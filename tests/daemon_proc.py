"""The real daemon as a child process, for end-to-end tests."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from tests import preloaded
from tests.kernel.vm import IN_VM
from tests.preloaded import Forked


class DaemonProcess:
    """``nodeguard run`` with JSON logs to a file the test reads.

    In the QEMU VM it is forked from an interpreter that has imported the daemon already (tests/preloaded.py),
    unless ``exec_it`` (a test of the start itself) or a ``wrapper`` command runs it.
    """

    def __init__(
        self, config: dict[str, Any], workdir: Path, *extra: str, exec_it: bool = False, wrapper: Sequence[str] = ()
    ) -> None:
        self.workdir = workdir
        self.config_path = workdir / "nodeguard.json"
        self.config_path.write_text(json.dumps(config))
        self.log_path = workdir / f"daemon-{time.monotonic_ns()}.log"
        self.argv = ["--log-level", "debug", "run", "--config", str(self.config_path), *extra]  # nodeguard's own
        self.wrapper = list(wrapper)
        self.exec_it = exec_it or bool(wrapper) or not IN_VM
        self.proc: subprocess.Popen[bytes] | Forked | None = None

    @property
    def args(self) -> list[str]:
        """The command line exec'd."""
        return [*self.wrapper, sys.executable, "-m", "nodeguard", *self.argv]

    def start(self, env: dict[str, str] | None = None) -> DaemonProcess:
        environment = {**os.environ, **(env or {})}
        cwd = str(Path(__file__).parents[1])
        with self.log_path.open("ab") as log:  # there from the start, whichever way the daemon starts
            if self.exec_it:
                self.proc = subprocess.Popen(self.args, stdout=log, stderr=log, env=environment, cwd=cwd)
            else:
                self.proc = preloaded.start(self.argv, str(self.log_path), environment, cwd)
        return self

    def events(self) -> list[dict[str, Any]]:
        found = []
        for line in self.log_path.read_text().splitlines():
            try:
                found.append(json.loads(line))
            except ValueError:
                found.append({"event": "<unparsed>", "line": line})
        return found

    def wait_for(self, predicate: Callable[[], bool], timeout: float, what: str) -> float:
        """Seconds until ``predicate`` held; fails with the daemon's log otherwise."""
        start = time.monotonic()
        while time.monotonic() - start < timeout:
            if predicate():
                return time.monotonic() - start
            if self.proc is not None and self.proc.poll() is not None:
                break
            time.sleep(0.2)  # slow polling: the test's own CPU use is noise the daemon measures
        raise AssertionError(f"timed out waiting for {what}; daemon log:\n{self.log_path.read_text()[-4000:]}")

    def ticks(self) -> list[str]:
        """The daemon's view of each tick (debug log), for failure messages."""
        return [
            f"{e.get('readings')} down={e.get('throttle_down')} actions={e.get('actions')}"
            for e in self.events()
            if e.get("event") == "tick"
        ]

    def signal(self, signum: signal.Signals) -> None:
        assert self.proc is not None
        self.proc.send_signal(signum)

    def wait(self, timeout: float = 10) -> int:
        assert self.proc is not None
        return self.proc.wait(timeout)

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(60)  # bounded: a forked daemon's status comes through its forkserver
