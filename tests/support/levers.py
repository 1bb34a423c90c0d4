"""Levers driven by hand on a real hierarchy, as an earlier tick (or an earlier daemon) would have left them."""

from __future__ import annotations

from nodeguard.actuators import levers
from nodeguard.actuators.cgroup_writer import CgroupWriter
from nodeguard.actuators.changes import Change, recorded
from nodeguard.actuators.evictors import Evictor
from nodeguard.actuators.executor import Executor
from nodeguard.actuators.ledger import Ledger
from nodeguard.model.samples import CpuMax


class NoEvictions(Evictor):
    """An evictor a test never expects to be asked."""

    async def evict(self, workload_id: str, **context: object) -> bool:
        raise AssertionError("no eviction in these tests")


def executor_for(root: str, version: str, ledger: Ledger) -> Executor:
    """The daemon's executor on the hierarchy at ``root``: every lever, no evictions, no background tasks."""
    return Executor(levers.build(CgroupWriter(root), version), NoEvictions(), ledger, lambda coro, name: None)


def throttle_by_hand(executor: Executor, ledger: Ledger, pod: str, original: CpuMax, to: CpuMax) -> None:
    """Throttle a pod (and cap its children) as an earlier tick would have, its record in the ledger."""
    current, writes = executor.quota.plan(pod, to.render_v2(), {})
    executor.quota.perform(writes)
    change = Change("cpu.max", pod, to.render_v2(), original.render_v2(), False, "throttle", "cpu_total_usage")
    ledger.record(recorded(ledger, executor.quota, change, current, writes, pending=False))
