"""Snapshots and settings for policy tests, built directly from the model dataclasses; a plan's changes read back;
and what a plan leaves of a node."""

from __future__ import annotations

import math
from collections.abc import Iterable
from dataclasses import replace
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


# --- shapes of nodes and objectives that several policy test modules share ---------------------------------


def stall_objective(**extra: Any) -> dict[str, Any]:
    """A protected_cpu_stall objective: 5 % over, 1 % back, after one tick each."""
    return {
        "metric": "protected_cpu_stall",
        "threshold": "5%",
        "restoreBelow": "1%",
        "action": "throttle",
        "triggerAfter": 1,
        "restoreAfter": 1,
        **extra,
    }


def kubelet_node(
    important_waiting: float, burner_cores: float = 0.3, burner_waiting: float = 0.7
) -> list[WorkloadUsage]:
    """kubelet's layout: burners in the Burstable and BestEffort tiers, the Guaranteed pod at the top level."""
    burners = [
        usage(f"kp/{tier}/pod{i}", cores=burner_cores, waiting=burner_waiting, priority=-i, cpu_max=CpuMax(None),
              qos=QosClass.BURSTABLE if tier == "burstable" else QosClass.BEST_EFFORT)
        for i, tier in enumerate(["burstable", "burstable", "besteffort"])
    ]  # fmt: skip
    important = usage("kp/podg", qos=QosClass.GUARANTEED, cores=0.4, waiting=important_waiting, starved=0.0,
                      cpu_max=CpuMax(50000))  # fmt: skip
    return [*burners, important]


def predicted_node(p: Plan, workloads: list) -> float:  # type: ignore[type-arg]
    """Node CPU once everyone took what they wanted within their (new) limits: demand = usage + wait."""
    quotas = {a.workload_id: quota(a).cores for a in throttles(p)}
    total = 0.0
    for u in workloads:
        demand = u.cores + ((u.waiting_cores if u.workload.id == "g" else u.starved_cores) or 0.0)
        limit = quotas.get(u.workload.id, u.cpu_max.cores)
        total += min(demand, limit if limit is not None else demand)
    return total


def mem(wid: str, used: int, *, high: float = math.inf, request: int | None = None, **extra: Any) -> WorkloadUsage:
    """A workload using ``used`` bytes, its memory.high ``high`` (math.inf: "max")."""
    found = usage(wid, memory=used, **extra)
    workload = replace(found.workload, memory_request_bytes=request)
    return found._replace(workload=workload, memory_high=high)


def mem_throttle(threshold: str = "80%", restore: str = "70%", **extra: Any) -> dict[str, Any]:
    """A memory_total_utilization throttle objective, after one tick each way."""
    return {"metric": "memory_total_utilization", "threshold": threshold, "restoreBelow": restore,
            "action": "throttle", "triggerAfter": 1, "restoreAfter": 1, **extra}  # fmt: skip


def settings(*objectives: dict[str, Any], step: float = 100.0, min_high: str = "64Mi") -> GuardSettings:
    """Guard settings with the memory lever's step and floor."""
    return guard(*objectives, memory={"stepPercent": step, "minHigh": min_high})


def at(used: int, *workloads: WorkloadUsage, version: str = "v2", **node: Any) -> Snapshot:
    """A 16 GiB node with ``used`` bytes in use."""
    found = snapshot(workloads, memory_total=16 * GiB, memory_used=used, **node)
    return replace(found, cgroup_version=version)
