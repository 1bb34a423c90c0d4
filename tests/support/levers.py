"""Levers driven by hand on a real hierarchy, as an earlier tick (or an earlier daemon) would have left them."""

from __future__ import annotations

from nodeguard.actuators import levers
from nodeguard.actuators.cgroup_writer import CgroupWriter
from nodeguard.actuators.changes import recorded
from nodeguard.actuators.evictors import Evictor
from nodeguard.actuators.executor import Executor
from nodeguard.actuators.ledger import Ledger
from nodeguard.actuators.levers.base import Lever
from nodeguard.model.levers import CPU_QUOTA, LeverChange
from nodeguard.model.samples import CpuMax


class NoEvictions(Evictor):
    """An evictor a test never expects to be asked."""

    async def evict(self, workload_id: str, **context: object) -> bool:
        raise AssertionError("no eviction in these tests")


def executor_for(root: str, version: str, ledger: Ledger) -> Executor:
    """The daemon's executor on the hierarchy at ``root``: every lever, no evictions, no background tasks."""
    return Executor(levers.build(CgroupWriter(root), version), NoEvictions(), ledger, lambda coro, name: None)


def quota_lever(executor: Executor) -> Lever:
    return executor.levers[CPU_QUOTA.name]


def throttle_by_hand(executor: Executor, ledger: Ledger, pod: str, original: CpuMax, to: CpuMax) -> None:
    """Hold a pod's quota (its containers' too, as the lever does) as an earlier tick would have, its record in
    the ledger."""
    quota = quota_lever(executor)
    current, writes = quota.plan(pod, to.render_v2(), {})
    quota.perform(writes)
    change = LeverChange(CPU_QUOTA.name, pod, to.render_v2(), original.render_v2(), release=False, holds_back=True,
                         kind="throttle", metric="cpu_total_usage", reason="by hand")  # fmt: skip
    ledger.record(recorded(ledger, quota, change, current, writes, pending=False))
