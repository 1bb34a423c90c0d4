"""The gate's state file kept in step with its table of loads, and the replies held back until it is.

A reply that reveals an admission waits until a write that includes it is done
(group commit), so a daemon killed at any moment comes back holding at least
every slot it granted.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

from nodeguard.atomic_file import boot_id
from nodeguard.gate import store
from nodeguard.gate.loads import LoadTable
from nodeguard.gate.server import Connection
from nodeguard.gate.states import LoadState
from nodeguard.log import RateLimiter, get_logger

log = get_logger("nodeguard.gate")

_Deferred = tuple[int, Connection, dict[str, Any]]


class StateFile:
    def __init__(self, path: str, table: LoadTable, warnings: RateLimiter) -> None:
        self.path = path
        self.table = table
        self.warnings = warnings
        self.boot = boot_id()
        self.writer = store.StateWriter(path)
        self.generation = 0  # of the persisted view (starting and ready loads); bumped on every change
        self.durable = 0  # the generation last written
        self._dirty = asyncio.Event()
        self._deferred: list[_Deferred] = []  # responses that reveal an admission not yet on disk

    def restore(self, may_use: Callable[[int, int], bool]) -> None:
        # A load is restored only if its submitter may use the gate now: its exec probe runs as that uid.
        found = store.read(self.path, self.boot, may_use)
        if found.other_boot:
            log.info("gate state is from an earlier boot; its loads are gone", path=self.path)
        for problem in found.problems:
            log.error("gate state: could not restore", path=self.path, problem=problem, kept_as=found.set_aside)
        for load in found.loads:
            if not self.table.restore(load):
                log.error("gate state: a load listed twice; restored once", path=self.path, load=load.name)
        starting = [load.name for load in found.loads if load.state is LoadState.STARTING]
        if found.loads:
            log.info("gate restored admitted loads; starting ones keep their slots", starting=starting)

    def bump(self) -> None:
        self.generation += 1
        self._dirty.set()

    def defer(self, generation: int, conn: Connection, message: dict[str, Any]) -> None:
        """Send ``message`` once the state of ``generation`` is on disk."""
        self._deferred.append((generation, conn, message))

    async def run(self) -> None:
        while True:
            await self._dirty.wait()
            self._dirty.clear()
            generation = self.generation
            data = store.encode(self.table.loads.values(), self.boot)
            try:
                await asyncio.to_thread(self.writer.write, generation, data)
            except OSError as exc:
                # Admit anyway: refusing every start because /run is full would be worse.
                if self.warnings.allow("state-write"):
                    log.error("gate: cannot write its state file", path=self.path, error=str(exc))
            self.durable = max(self.durable, generation)
            self._flush_deferred()

    def _flush_deferred(self) -> None:
        due = [d for d in self._deferred if d[0] <= self.durable]
        if due:
            self._deferred = [d for d in self._deferred if d[0] > self.durable]
            for _, conn, message in due:
                conn.send(message)

    def forget_deferred(self) -> None:
        """Not serving any more: the held replies' connections are closed."""
        self._deferred.clear()

    def write_now(self) -> None:
        try:
            self.writer.write(self.generation, store.encode(self.table.loads.values(), self.boot))
        except OSError as exc:
            log.error("gate: cannot write its state file", path=self.path, error=str(exc))
