"""A node of plain files shaped like cgroup v2, acted on by the real executor and levers, its ticks recorded by the
real recorder: where this host has no cgroup v2 lever (memory.high), the history is fed real plans and changes."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from collections.abc import Coroutine, Iterable
from pathlib import Path
from typing import Any

from nodeguard.actuators import levers
from nodeguard.actuators.cgroup_writer import CgroupWriter
from nodeguard.actuators.executor import Executor
from nodeguard.actuators.ledger import Ledger
from nodeguard.daemon import given_back
from nodeguard.guard_tick import Settled, settle
from nodeguard.history.recorder import Recorder
from nodeguard.history.settings import HistorySettings
from nodeguard.model.snapshot import Snapshot, WorkloadUsage
from nodeguard.policy.settings import GuardSettings
from nodeguard.policy.state import GuardState

REPO = Path(__file__).resolve().parents[2]


class PlainFiles(CgroupWriter):
    """The daemon's writer on plain files: each write replaces the file's value, as a cgroup file's write does."""

    def write(self, workload_id: str, filename: str, value: str, **context: object) -> bool:
        os.truncate(self.path_of(workload_id, filename), 0)
        return super().write(workload_id, filename, value, **context)


class Evictions:
    """The evictor: remembers whom it was asked to evict (the executor runs it as a task; here it is not run)."""

    def __init__(self) -> None:
        self.asked: list[str] = []

    async def evict(self, workload_id: str, **context: object) -> bool:
        return True

    def spawn(self, coro: Coroutine[Any, Any, None], name: str) -> None:
        self.asked.append(name.removeprefix("evict:"))
        coro.close()


class FileNode:
    """The workloads' cgroup files under ``tmp/cgroup``, the ledger and the history beside them."""

    def __init__(self, tmp: Path, **history: Any) -> None:
        self.tmp = tmp
        self.root = tmp / "cgroup"
        self.root.mkdir()
        self.history = HistorySettings.model_validate({"path": str(tmp / "history"), **history})
        self.evictions = Evictions()
        self.executor = Executor(levers.build(PlainFiles(str(self.root)), "v2"), self.evictions,
                                 Ledger(str(tmp / "ledger.json")), self.evictions.spawn)  # fmt: skip
        self.state = GuardState()
        self.recorder = self._recorder()
        self.recorder.lifecycle("start", "restore")

    def _recorder(self) -> Recorder:
        recorder = Recorder(self.history)
        recorder.start()
        return recorder

    def add(self, usages: Iterable[WorkloadUsage]) -> None:
        """Each workload's group, and its parents', with the kernel's defaults (or the snapshot's memory.high)."""
        for usage in usages:
            parts = usage.workload.id.split("/")
            for depth in range(1, len(parts) + 1):
                group = self.root.joinpath(*parts[:depth])
                if group.is_dir():
                    continue
                group.mkdir()
                for name, value in (("cpu.max", "max 100000"), ("cpu.weight", "100"), ("cpu.idle", "0"),
                                    ("memory.high", "max")):  # fmt: skip
                    (group / name).write_text(value + "\n")
            high = usage.memory_high
            if high is not None and not math.isinf(high):
                (self.root / usage.workload.id / "memory.high").write_text(f"{int(high)}\n")

    def read(self, group: str, name: str) -> str:
        return (self.root / group / name).read_text().strip()

    def tick(self, snapshot: Snapshot, guard: GuardSettings) -> Settled:
        """One tick as the daemon runs it: settled, recorded, handed to the writer, written."""
        settled = settle(snapshot, self.state, guard, self.executor)
        self.state = settled.state
        self.recorder.record(settled.plan, snapshot, settled.every_change, guard.candidates)
        self.recorder.flush()
        assert self.recorder.drain(), "the writer wrote the tick's entries"
        return settled

    def restart(self) -> None:
        """Stop as the daemon does (every lever put back, recorded), then start again with a new recorder."""
        self.recorder.lifecycle("stop", "restore", restored=given_back(self.executor.restore_everything()))
        self.recorder.close()
        self.state = GuardState()
        self.recorder = self._recorder()
        self.recorder.lifecycle("start", "restore")
        assert self.recorder.drain()

    def close(self) -> None:
        self.recorder.close()


def why(*args: str) -> subprocess.CompletedProcess[str]:
    """``nodeguard why ARGS`` as its own process, as an operator runs it."""
    return subprocess.run([sys.executable, "-m", "nodeguard", "why", *args], capture_output=True, text=True,
                          timeout=60, cwd=REPO)  # fmt: skip


def why_json(*args: str) -> dict[str, Any]:
    """``nodeguard why ARGS --json``'s answer; the command exits 0 with nothing on stderr."""
    done = why(*args, "--json")
    assert done.returncode == 0 and not done.stderr, done
    answer: dict[str, Any] = json.loads(done.stdout)
    return answer
