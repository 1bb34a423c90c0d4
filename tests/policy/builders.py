"""Snapshots and settings for policy tests, built directly from the model dataclasses; a plan's changes read back."""

from __future__ import annotations

from collections.abc import Iterable
from types import MappingProxyType
from typing import Any

from nodeguard.model.levers import CPU_QUOTA, MEMORY_HIGH, LeverChange
from nodeguard.model.samples import CpuMax, CpuStat, LoadAverage, MemInfo, ProcStatCpu, Psi, PsiLine
from nodeguard.model.snapshot import NodeUsage, Snapshot, WorkloadUsage
from nodeguard.model.workloads import QosClass, Workload
from nodeguard.policy.actions import Action
from nodeguard.policy.holds import memory_value
from nodeguard.policy.planner import Plan
from nodeguard.policy.settings import GuardSettings
from nodeguard.sources.cgroupfs import parse_cpu_max

GiB = 1 << 30
MiB = 1 << 20
UNLIMITED = CpuMax(None)


def usage(
    wid: str,
    *,
    qos: QosClass = QosClass.BEST_EFFORT,
    priority: int = 0,
    cores: float | None = 1.0,
    memory: int | None = 256 * MiB,
    cpu_max: CpuMax | None = UNLIMITED,
    request: float | None = None,
    started_at: float | None = 1_000.0,
    protected: bool = False,
    waiting: float | None = None,
    starved: float | None = None,
) -> WorkloadUsage:
    workload = Workload(
        id=wid,
        name=wid.rsplit("/", 1)[-1],
        kind="pod",
        qos_class=qos,
        priority=priority,
        protected=protected,
        started_at=started_at,
        cpu_request_cores=request,
    )
    # Fields the policy does not read stay None, so a new model field does not break the builder.
    fields: dict[str, Any] = dict.fromkeys(WorkloadUsage._fields)
    fields.update(
        workload=workload,
        cpu=CpuStat(0),
        cpu_max=cpu_max,
        memory_bytes=memory,
        cores=cores,
        waiting_cores=waiting,
        starved_cores=waiting if starved is None else starved,
    )
    return WorkloadUsage(**fields)


def node(
    *,
    cpus: int = 8,
    cores_used: float | None = 2.0,
    memory_total: int = 16 * GiB,
    memory_used: int = 4 * GiB,
    cpu_pressure: float | None = 0.0,
    load1: float | None = 1.0,
) -> NodeUsage:
    psi = None if cpu_pressure is None else Psi(PsiLine(cpu_pressure, cpu_pressure, cpu_pressure, 0), None)
    return NodeUsage(
        cpus=cpus,
        cpu=ProcStatCpu(0, 0),
        cores_used=cores_used,
        cpu_utilization=None if cores_used is None else 100.0 * cores_used / cpus,
        load=None if load1 is None else LoadAverage(load1, load1, load1, 1, 100),
        memory=MemInfo(memory_total, memory_total - memory_used),
        cpu_pressure=psi,
        memory_pressure=None,
        io_pressure=None,
    )


def snapshot(workloads: Iterable[WorkloadUsage] = (), *, monotonic: float = 100.0, **node_args: Any) -> Snapshot:
    return Snapshot(
        monotonic=monotonic,
        wall_time=1_700_000_000.0 + monotonic,
        interval=1.0,
        cgroup_version="v2",
        node=node(**node_args),
        workloads=MappingProxyType({u.workload.id: u for u in workloads}),
    )


def guard(*objectives: dict[str, Any], **settings: Any) -> GuardSettings:
    """GuardSettings from JSON-style keys, e.g. guard({"metric": ..., "threshold": 6}, minChangePercent=0)."""
    # No margin unless a test asks: the tables and properties check exact gap arithmetic.
    return GuardSettings.model_validate({"objectives": list(objectives), "targetMarginPercent": 0, **settings})


def cpu_throttle(threshold: float | str = 6.0, restore: float | str = 5.0, **extra: Any) -> dict[str, Any]:
    return {
        "metric": "cpu_total_usage",
        "threshold": threshold,
        "restoreBelow": restore,
        "action": "throttle",
        "triggerAfter": 1,
        "restoreAfter": 1,
        **extra,
    }


# --- a plan's lever changes, read back as typed values ---------------------------------------------------------


def changes(p: Plan, kind: str) -> list[LeverChange]:
    """The plan's lever changes of one kind (throttle, restore, memory_throttle, memory_restore, reweigh)."""
    return [c for c in p.changes if c.kind == kind]


def throttles(p: Plan) -> list[LeverChange]:
    return changes(p, "throttle")


def restores(p: Plan) -> list[LeverChange]:
    return changes(p, "restore")


def reweighs(p: Plan) -> list[LeverChange]:
    return changes(p, "reweigh")


def _change(action: Action, lever: str) -> LeverChange:
    assert isinstance(action, LeverChange) and action.lever == lever, action
    return action


def _given(text: str | None) -> str:
    assert text is not None, "the change names this value"
    return text


def quota(action: Action) -> CpuMax:
    """The cpu.max a quota change writes."""
    return parse_cpu_max(_given(_change(action, CPU_QUOTA.name).target))


def previous_quota(action: Action) -> CpuMax:
    """The cpu.max the plan took the workload to have before the change."""
    return parse_cpu_max(_given(_change(action, CPU_QUOTA.name).previous))


def original_quota(action: Action) -> CpuMax:
    """The cpu.max before nodeguard first changed it: what the ledger gives back."""
    return parse_cpu_max(_given(_change(action, CPU_QUOTA.name).give_back))


def released_cores(action: Action) -> float:
    """The cores a quota change releases."""
    return _given_float(_change(action, CPU_QUOTA.name).releases)


def _given_float(value: float | None) -> float:
    assert value is not None, "the change names what it releases"
    return value


def high(action: Action) -> int | None:
    """The memory.high a memory change writes (None: "max")."""
    return memory_value(_given(_change(action, MEMORY_HIGH.name).target))


def previous_high(action: Action) -> int | None:
    return memory_value(_given(_change(action, MEMORY_HIGH.name).previous))


def original_high(action: Action) -> int | None:
    return memory_value(_given(_change(action, MEMORY_HIGH.name).give_back))
