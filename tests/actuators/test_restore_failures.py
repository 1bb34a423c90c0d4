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
from nodeguard.model.levers import CPU_QUOTA, CPU_WEIGHT, LeverChange
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
    cpu, stall = Metric.CPU_TOTAL_USAGE, Metric.PROTECTED_CPU_STALL
    throttle = LeverChange(CPU_QUOTA.name, "kp/pod0", "50000 100000", "100000 100000", release=False,
                           holds_back=True, kind="throttle", metric=cpu, reason="test", workload=workload)  # fmt: skip
    restore = LeverChange(CPU_QUOTA.name, "kp/pod0", "100000 100000", "100000 100000", release=True,
                          holds_back=False, kind="restore", metric=cpu, reason="test", workload=workload)  # fmt: skip
    lower = LeverChange(CPU_WEIGHT.name, "kp/burstable", None, None, release=False, holds_back=True,
                        kind="reweigh", metric=stall, reason="test", workloads=("kp/pod0",))  # fmt: skip
    back = LeverChange(CPU_WEIGHT.name, "kp/burstable", None, None, release=True, holds_back=False,
                       kind="reweigh", metric=stall, reason="test", workloads=("kp/pod0",))  # fmt: skip
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
