"""Bare coordination nodes (``python -m tests.coordination.node_process``) and the auditor of their loads' own
reports, for the MQTT integration tests."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from tests.support.cluster import coordination_config
from tests.support.poll import wait_until

REPO = Path(__file__).resolve().parents[2]


class NodeProcess:
    """``python -m tests.coordination.node_process`` with its JSON events collected from stdout."""

    def __init__(self, name: str, config: dict[str, Any], workdir: Path) -> None:
        self.name = name
        self.workdir = workdir
        self.config_path = workdir / f"{name}.json"
        self.config_path.write_text(json.dumps(config))
        self.stderr_path = workdir / f"{name}.log"
        self.events: list[dict[str, Any]] = []
        self.lock = threading.Lock()
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> NodeProcess:
        stderr = self.stderr_path.open("ab")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tests.coordination.node_process", "--config", str(self.config_path), "--node",
             self.name, "--stdin"],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=stderr, cwd=REPO,
        )  # fmt: skip
        stderr.close()
        threading.Thread(target=self._read, args=(self.proc,), daemon=True).start()
        return self

    def _read(self, proc: subprocess.Popen[bytes]) -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            try:
                event = json.loads(line)
            except ValueError:
                continue
            with self.lock:
                self.events.append(event)

    def send(self, **cmd: Any) -> None:
        assert self.proc is not None and self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(cmd).encode() + b"\n")
        self.proc.stdin.flush()

    def burst(self, count: int, hold: float, semaphore: str) -> None:
        self.send(cmd="burst", count=count, hold=hold, semaphore=semaphore)

    def snapshot(self) -> list[dict[str, Any]]:
        with self.lock:
            return list(self.events)

    def count(self, event: str) -> int:
        return sum(1 for e in self.snapshot() if e["ev"] == event)

    def wait_started(self, timeout: float = 30.0) -> None:
        """Until the process runs its event loop (ten interpreters starting at once on two cores take a while)."""
        wait_until(lambda: self.count("started") >= 1, timeout, f"{self.name} started", detail=self.log_tail)

    def wait_admitting(self, timeout: float = 20.0, detail: Callable[[], str] | None = None) -> None:
        """Until it runs and its coordination admits (``detail``: what a timeout shows, its own log by default)."""
        self.wait_started()
        wait_until(
            lambda: self.status()["admitting"], timeout, f"{self.name} admitting", detail=detail or self.log_tail
        )

    def status(self, timeout: float = 5.0) -> dict[str, Any]:
        before = self.count("status")
        self.send(cmd="status")
        wait_until(lambda: self.count("status") > before, timeout, f"status of {self.name}")
        return [e for e in self.snapshot() if e["ev"] == "status"][-1]["status"]

    def kill(self) -> None:
        assert self.proc is not None
        os.kill(self.proc.pid, signal.SIGKILL)
        self.proc.wait(5)
        with self.lock:  # after it is surely dead: its loads held until then
            self.events.append({"ev": "killed", "t": time.monotonic(), "node": self.name})

    def terminate(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGTERM)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGTERM)
        if self.proc is not None:
            try:
                self.proc.wait(10)  # it drains first: up to drainSeconds (3) and a second for its last record
            except subprocess.TimeoutExpired:
                os.kill(self.proc.pid, signal.SIGUSR2)  # its tasks' stacks go to its log
                time.sleep(0.3)  # kept: a failing test's diagnostics, time for the stacks to be written
                os.kill(self.proc.pid, signal.SIGKILL)
                self.proc.wait(5)
                raise AssertionError(f"{self.name} did not stop on SIGTERM\n{self.log_tail(60)}") from None

    def log_tail(self, lines: int = 25) -> str:
        try:
            text = self.stderr_path.read_text().splitlines()
        except OSError:
            return ""
        return f"--- {self.name} ---\n" + "\n".join(text[-lines:])


def start_nodes(
    port: int, names: list[str], seeds: list[str], semaphores: dict[str, int], workdir: Path
) -> dict[str, NodeProcess]:
    """One node process per name on the broker at ``port``, each with its own state directory."""
    return {
        name: NodeProcess(name, coordination_config(port, seeds, semaphores, workdir / "state" / name), workdir).start()
        for name in names
    }


class LoadAuditor:
    """The loads' own reports: the sum held at every instant, from CLOCK_MONOTONIC timestamps."""

    def __init__(self, nodes: list[NodeProcess]) -> None:
        self.nodes = nodes

    def intervals(self, sem: str) -> list[tuple[float, float, str]]:
        spans = []
        now = time.monotonic()
        for node in self.nodes:
            open_: dict[str, float] = {}
            for e in node.snapshot():
                if e["ev"] == "killed":
                    spans += [(start, e["t"], load) for load, start in open_.items()]
                    open_.clear()
                if e.get("sem") != sem:
                    continue
                if e["ev"] == "hold":
                    open_[e["load"]] = e["t"]
                elif e["ev"] in ("free", "revoked") and e["load"] in open_:
                    spans.append((open_.pop(e["load"]), e["t"], e["load"]))
            spans += [(start, max(start, now), load) for load, start in open_.items()]
        return spans

    def max_held(self, sem: str, since: float = 0.0) -> int:
        points = []
        for start, end, _ in self.intervals(sem):
            if end >= since:
                points += [(start, 1), (end, -1)]
        held = peak = 0
        for _, delta in sorted(points, key=lambda p: (p[0], p[1])):  # at equal times a release comes first
            held += delta
            peak = max(peak, held)
        return peak

    def requested(self, sem: str) -> set[str]:
        return {e["load"] for n in self.nodes for e in n.snapshot() if e["ev"] == "request" and e["sem"] == sem}

    def done(self, sem: str) -> set[str]:
        return {e["load"] for n in self.nodes for e in n.snapshot() if e["ev"] == "done" and e["sem"] == sem}
