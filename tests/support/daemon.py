"""The real daemon as a child process, for end-to-end tests."""

from __future__ import annotations

import copy
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from tests.support.poll import wait_until


def in_workdir(config: dict[str, Any], workdir: Path) -> dict[str, Any]:
    """The config with the decision history in the test's directory unless it names one: never the host's."""
    found = copy.deepcopy(config)
    section = found.setdefault("global", {})
    if isinstance(section, dict) and "path" not in section.get("history", {}):
        section["history"] = {**section.get("history", {}), "path": str(workdir / "history")}
    return found


class DaemonProcess:
    """``nodeguard run`` (under ``wrapper``, if given) with JSON logs to a file the test reads."""

    def __init__(self, config: dict[str, Any], workdir: Path, *extra: str, wrapper: Sequence[str] = ()) -> None:
        self.workdir = workdir
        self.config_path = workdir / "nodeguard.json"
        self.config_path.write_text(json.dumps(in_workdir(config, workdir)))
        self.argv = ["--log-level", "debug", "run", "--config", str(self.config_path), *extra]  # nodeguard's own
        self.wrapper = list(wrapper)
        self._unstarted()

    def _unstarted(self) -> None:
        """No process yet, and a log file of its own."""
        self.log_path = self.workdir / f"daemon-{time.monotonic_ns()}.log"
        self.proc: subprocess.Popen[bytes] | None = None
        self._events: list[dict[str, Any]] = []
        self._parsed_bytes = 0

    def successor(self) -> DaemonProcess:
        """Another daemon with this one's config, arguments and wrapper, logging to a file of its own."""
        other = copy.copy(self)
        other._unstarted()
        return other

    @property
    def args(self) -> list[str]:
        """The command line exec'd."""
        return [*self.wrapper, sys.executable, "-m", "nodeguard", *self.argv]

    def start(self, env: dict[str, str] | None = None) -> DaemonProcess:
        with self.log_path.open("ab") as log:
            self.proc = subprocess.Popen(self.args, stdout=log, stderr=log, env={**os.environ, **(env or {})},
                                         cwd=str(Path(__file__).parents[2]))  # fmt: skip
        return self

    def events(self) -> list[dict[str, Any]]:
        """Every complete line of the log so far, parsed; each line is parsed once, however often tests poll."""
        with self.log_path.open("rb") as log:
            log.seek(self._parsed_bytes)
            new = log.read()
        complete = new if self.exited() else new[: new.rfind(b"\n") + 1]  # a line still being written waits
        self._parsed_bytes += len(complete)
        for line in complete.decode(errors="replace").splitlines():
            try:
                self._events.append(json.loads(line))
            except ValueError:
                self._events.append({"event": "<unparsed>", "line": line})
        return list(self._events)

    def wait_for(self, predicate: Callable[[], object], timeout: float, what: str) -> float:
        """Seconds until ``predicate`` held; fails with the daemon's log when it did not in time or the daemon exited."""
        start = time.monotonic()
        wait_until(predicate, timeout, what, interval=0.2,  # slow polling: the test's CPU use is noise the daemon measures
                   give_up=self.exited, detail=lambda: f"daemon log:\n{self.log_path.read_text()[-4000:]}")  # fmt: skip
        return time.monotonic() - start

    def exited(self) -> bool:
        """The process ran and is gone."""
        return self.proc is not None and self.proc.poll() is not None

    def logged(self, event: str) -> bool:
        """Whether the daemon has logged ``event`` yet."""
        return any(e.get("event") == event for e in self.events())

    def ticks_after(self, event: str) -> int:
        """How many ticks the daemon logged after it first logged ``event``; 0 until it has."""
        names = [e.get("event") for e in self.events()]
        return names[names.index(event) :].count("tick") if event in names else 0

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
            self.proc.wait()
