"""Refused restores are counted apart from other refused actions, and exported as nodeguard_restore_failures_total."""

from __future__ import annotations

from pathlib import Path

from prometheus_client import generate_latest

from nodeguard.actuators import levers
from nodeguard.actuators.cgroup_writer import CgroupWriter, WriteCounters
from nodeguard.actuators.evictors import Evictor
from nodeguard.actuators.executor import Executor
from nodeguard.actuators.ledger import Ledger
from nodeguard.actuators.levers.base import WriteRefused
from nodeguard.daemon import DaemonView
from nodeguard.model.samples import CpuMax
from nodeguard.policy.actions import Restore, Reweigh, Throttle
from nodeguard.policy.metrics import Metric
from nodeguard.policy.state import GuardState
from nodeguard.surfaces.metrics import Metrics
from tests.policy.builders import usage


class NoEvictions(Evictor):
    async def evict(self, workload_id: str, **context: object) -> bool:
        raise AssertionError("no eviction here")


def refusal() -> WriteRefused:
    return WriteRefused("/sys/fs/cgroup/cpu/kp/pod0", "cpu.cfs_quota_us", "EINVAL", "Invalid argument")


def test_only_refused_restores_count_as_restore_failures(tmp_path: Path) -> None:
    """A refused throttle or weight lowering counts as a failed action only; a refused quota restore or weight
    put back counts as a failed action and a failed restore."""
    executor = Executor(levers.build(CgroupWriter(str(tmp_path)), "v1"), NoEvictions(), Ledger(str(tmp_path / "l")),
                        lambda coro, name: None)  # fmt: skip
    workload = usage("kp/pod0").workload
    quota = {"quota": CpuMax(50000), "previous": CpuMax(100000), "original": CpuMax(100000), "dry_run": False}
    throttle = Throttle(workload, Metric.CPU_TOTAL_USAGE, "test", 1.0, 0.5, 0.5, **quota)  # type: ignore[arg-type]
    restore = Restore(workload, Metric.CPU_TOTAL_USAGE, "test", 0.5, -0.5, full=True, **quota)  # type: ignore[arg-type]
    lower = Reweigh("kp/burstable", Metric.PROTECTED_CPU_STALL, "test", True, ("kp/pod0",), False)
    back = Reweigh("kp/burstable", Metric.PROTECTED_CPU_STALL, "test", False, ("kp/pod0",), False)
    for action in (throttle, lower):
        executor._refused(action, refusal())
    assert (executor.counters.failed, executor.counters.failed_restores) == (2, 0)
    for action in (restore, back):
        executor._refused(action, refusal())
    assert (executor.counters.failed, executor.counters.failed_restores) == (4, 2)


def test_restore_failures_are_exported() -> None:
    """/metrics carries the daemon's count of failed restores as nodeguard_restore_failures_total."""
    view = DaemonView(None, None, GuardState(), {}, 5, WriteCounters(), 0, 1, 0, {}, {}, {}, {}, failed_restores=3)
    text = generate_latest(Metrics(lambda: view).registry).decode()
    assert "nodeguard_restore_failures_total 3.0" in text
    assert "nodeguard_action_failures_total 5.0" in text
