"""The gate's cluster slots: asking the coordination service for a load's semaphore slot and giving it back."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from nodeguard.coordination.settings import CoordinationError
from nodeguard.gate.loads import LoadTable
from nodeguard.gate.states import Load

if TYPE_CHECKING:
    from nodeguard.coordination.switch import Coordination


def slot_id(name: str, seq: int) -> str:
    """The coordination service's id for a load's cluster slot: a replaced load never shares its predecessor's."""
    return f"{name}#{seq}"


class ClusterSlots:
    def __init__(self, coordination: Coordination | None, table: LoadTable, after: Callable[[], None]) -> None:
        self.coordination = coordination
        self.table = table
        self.after = after  # the table changed: re-arm the hold timer
        self._acquiring: dict[tuple[str, int], asyncio.Task[None]] = {}  # (load, seq) -> its acquire

    def want(self, load: Load, group: asyncio.TaskGroup) -> None:
        key = (load.name, load.seq)
        if key not in self._acquiring:
            self._acquiring[key] = group.create_task(self._acquire(load), name=f"gate-slot-{load.name}")

    def done(self, load: Load) -> None:
        task = self._acquiring.pop((load.name, load.seq), None)
        if task is not None and not task.done():
            task.cancel()  # acquire gives the slot back if it was granted meanwhile
        elif self.coordination is not None and load.spec.semaphore is not None:
            self.coordination.release(load.spec.semaphore, slot_id(load.name, load.seq))

    def revoked(self, semaphore: str, slot: str) -> None:
        name, _, seq = slot.rpartition("#")
        if seq.isdigit():
            self.table.slot_revoked(name, int(seq), time.monotonic())
            self.after()

    async def _acquire(self, load: Load) -> None:
        name, seq, semaphore = load.name, load.seq, load.spec.semaphore
        assert self.coordination is not None and semaphore is not None
        try:
            await self.coordination.acquire(semaphore, slot_id(name, seq))
        except CoordinationError as exc:
            self._acquiring.pop((name, seq), None)
            current = self.table.loads.get(name)
            if current is not None and current.seq == seq and current.state.active:
                self.table.cancel(name, time.monotonic(), f"no cluster slot: {exc}")
                self.after()
            return
        self._acquiring.pop((name, seq), None)
        if not self.table.slot_granted(name, seq, time.monotonic()):
            self.coordination.release(semaphore, slot_id(name, seq))
        self.after()

    def stop(self) -> None:
        """Not serving any more: the acquires are tasks of the gate's group, cancelled with it; asked again on
        serving again."""
        self._acquiring.clear()
