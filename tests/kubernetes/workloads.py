"""Pod workloads as discovery builds them from the cgroup tree: an id, ``pod/<uid>``, no metadata."""

from __future__ import annotations

from typing import Any

from nodeguard.model.samples import CpuMax, CpuStat
from nodeguard.model.snapshot import WorkloadUsage
from nodeguard.model.workloads import QosClass, Workload

_TIERS = {QosClass.BURSTABLE: "burstable", QosClass.BEST_EFFORT: "besteffort"}


def pod_cgroup(uid: str, qos: QosClass = QosClass.BEST_EFFORT, driver: str = "cgroupfs") -> str:
    tier = _TIERS.get(qos)
    if driver == "systemd":
        escaped = uid.replace("-", "_")
        if tier is None:
            return f"kubepods.slice/kubepods-pod{escaped}.slice"
        return f"kubepods.slice/kubepods-{tier}.slice/kubepods-{tier}-pod{escaped}.slice"
    return f"kubepods/{tier}/pod{uid}" if tier else f"kubepods/pod{uid}"


def pod_usage(
    uid: str,
    *,
    qos: QosClass = QosClass.BEST_EFFORT,
    driver: str = "cgroupfs",
    cores: float | None = 1.0,
    memory: int | None = 256 << 20,
) -> WorkloadUsage:
    workload = Workload(
        id=pod_cgroup(uid, qos, driver),
        name=f"pod/{uid}",
        kind="pod",
        qos_class=qos,
        pod_uid=uid,
        started_at=1_700_000_000.0,  # the cgroup's ctime
    )
    fields: dict[str, Any] = dict.fromkeys(WorkloadUsage._fields)
    fields.update(workload=workload, cpu=CpuStat(0), cpu_max=CpuMax(None), memory_bytes=memory, cores=cores)
    return WorkloadUsage(**fields)
