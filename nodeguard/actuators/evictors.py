"""Evictors: make a workload leave, behind one interface.

On cgroup v2: optionally freeze the group (no new forks while we list it),
SIGTERM every process, thaw so they can exit cleanly, wait a grace period,
then ``cgroup.kill``. On v1: SIGTERM, grace, SIGKILL to every pid listed.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import time
from typing import Protocol

from nodeguard.actuators.cgroup_writer import CgroupWriter
from nodeguard.errors import CgroupGone
from nodeguard.log import get_logger
from nodeguard.sources.cgroupfs import parse_pids

log = get_logger("nodeguard.evictor")


class Evictor(Protocol):
    async def evict(self, workload_id: str, **context: object) -> bool:
        """Make the workload leave; True once it is gone (or would be, in dry run)."""
        ...


class CgroupEvictor:
    def __init__(self, writer: CgroupWriter, version: str, grace_seconds: float = 10.0, freeze: bool = True) -> None:
        self.writer = writer
        self.version = version
        self.grace_seconds = grace_seconds
        self.freeze = freeze and version == "v2"

    def pids(self, workload_id: str) -> list[int]:
        """Every process in the workload's cgroup and its descendants."""
        top = self.writer.path_of(workload_id, "cgroup.freeze").rsplit("/", 1)[0]
        found: list[int] = []
        for directory, _, _ in os.walk(top):
            with (
                contextlib.suppress(OSError, ValueError),
                open(os.path.join(directory, "cgroup.procs"), encoding="ascii") as handle,
            ):
                found += parse_pids(handle.read())
        return found

    def _signal(self, pids: list[int], signum: signal.Signals) -> int:
        sent = 0
        for pid in pids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signum)
                sent += 1
        return sent

    def _freeze(self, workload_id: str, value: str, context: dict[str, object]) -> bool:
        try:
            return self.writer.write(workload_id, "cgroup.freeze", value, **context)
        except OSError as exc:  # no cgroup.freeze before 5.2: signal without freezing
            if value == "1":
                log.info("cannot freeze; signalling without", workload=workload_id, error=str(exc))
                return False
            raise

    async def evict(self, workload_id: str, **context: object) -> bool:
        if self.writer.dry_run:
            log.warning("dry run: would evict", workload=workload_id, processes=len(self.pids(workload_id)), **context)
            return True
        log.warning("evicting", workload=workload_id, **context)
        try:
            frozen = self.freeze and self._freeze(workload_id, "1", context)
            pids = self.pids(workload_id)
            self._signal(pids, signal.SIGTERM)
            if frozen:  # thawed, the processes run their SIGTERM handlers and exit
                self._freeze(workload_id, "0", context)
            deadline = time.monotonic() + self.grace_seconds
            while self.pids(workload_id) and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
            remaining = self.pids(workload_id)
            if remaining:
                if self.version == "v2":
                    self.writer.write(workload_id, "cgroup.kill", "1", **context)
                else:
                    self._signal(remaining, signal.SIGKILL)
                log.warning("grace period over; killed", workload=workload_id, processes=len(remaining))
            while self.pids(workload_id) and time.monotonic() < deadline + 5:
                await asyncio.sleep(0.02)
        except CgroupGone:
            return True
        return not self.pids(workload_id)
