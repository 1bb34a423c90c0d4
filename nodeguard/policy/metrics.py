"""The capability registry: what each node metric allows the guard to do.

A metric is *quantified* for an action when the release of acting on one
workload can be predicted from that workload's own usage; only then can the
planner act on a precise prefix of candidates. Other metrics act on one
workload at a time and measure again (closed loop).

Each entry also says how to read the metric from a snapshot's node, what
100 % of it is, how a workload's own usage converts into it, and how a what-if
overrides it: everything the policy knows about a metric lives here.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass
from enum import StrEnum

from nodeguard.model.samples import LoadAverage, MemInfo, Psi, PsiLine
from nodeguard.model.snapshot import NodeUsage
from nodeguard.quantity import Unit


class Metric(StrEnum):
    CPU_TOTAL_USAGE = "cpu_total_usage"
    CPU_TOTAL_UTILIZATION = "cpu_total_utilization"
    MEMORY_TOTAL_USAGE = "memory_total_usage"
    MEMORY_TOTAL_UTILIZATION = "memory_total_utilization"
    CPU_PRESSURE = "cpu_pressure"
    LOAD_AVERAGE = "load_average"
    PROTECTED_CPU_STALL = "protected_cpu_stall"
    PROTECTED_MEMORY_STALL = "protected_memory_stall"


class Resource(StrEnum):
    """The workload resource that acting on this metric releases."""

    CPU = "cpu"
    MEMORY = "memory"


Reader = Callable[[NodeUsage], "float | None"]
Scale = Callable[[NodeUsage], float]
Override = Callable[[NodeUsage, float], NodeUsage]


@dataclass(frozen=True, slots=True)
class Capability:
    metric: Metric
    unit: Unit
    resource: Resource
    throttleable: bool
    throttle_quantified: bool
    evictable: bool
    evict_quantified: bool
    sort_by: tuple[str, ...]  # comparator names, see policy.ranking
    # Incompressible resources (memory) are evicted before compressible ones.
    compressible: bool
    read: Reader  # the node's value now; None when there is no (fresh) sample or its /proc file is unreadable
    capacity: Scale  # what a "100%" threshold means, in the metric's unit
    override: Override  # the node with this metric set to a value (what-if)
    # Metric units per unit of the workload resource (cores or bytes), for
    # quantified metrics: how much one workload's usage moves the node figure.
    per_resource_unit: Scale | None = None
    # nodeguard's own throttles raise it (a CFS-throttled task is runnable, so
    # PSI counts its wait up to the node's figure): acting on it feeds on itself.
    raised_by_throttling: bool = False
    # Read from the protected workloads, not the node (policy.stall): the node only carries a what-if's value.
    protected: bool = False

    def quantified(self, action: str) -> bool:
        return self.throttle_quantified if action == "throttle" else self.evict_quantified


def _memory_total(node: NodeUsage) -> int | None:
    """None when /proc/meminfo could not be read this tick."""
    return node.memory.total if node.memory is not None and node.memory.total > 0 else None


def _memory_capacity(node: NodeUsage) -> float:
    # 0 while meminfo is unreadable: a percentage then resolves to 0, but the
    # metric reads None too, so no waterline is compared with it (missing-sample).
    return float(_memory_total(node) or 0)


def _memory_used(node: NodeUsage) -> float | None:
    used = node.memory_used
    return None if _memory_total(node) is None or used is None else float(used)


def _memory_utilization(node: NodeUsage) -> float | None:
    return None if _memory_total(node) is None else node.memory_utilization


def _memory_percent_per_byte(node: NodeUsage) -> float:
    total = _memory_total(node)
    return 0.0 if total is None else 100.0 / total


def _set_memory_used(node: NodeUsage, used: float) -> NodeUsage:
    total = _memory_total(node)
    if total is None:
        raise ValueError("no memory reading on this node to set (/proc/meminfo unreadable)")
    return dataclasses.replace(node, memory=MemInfo(total, max(0, round(total - used))))


def _cpu_pressure(node: NodeUsage) -> float | None:
    psi = node.cpu_pressure
    return None if psi is None or psi.some is None else psi.some.avg10


def _set_cpu_pressure(node: NodeUsage, value: float) -> NodeUsage:
    some = node.cpu_pressure.some if node.cpu_pressure is not None else None
    line = PsiLine(value, some.avg60, some.avg300, some.total_usec) if some else PsiLine(value, value, value, 0)
    full = node.cpu_pressure.full if node.cpu_pressure is not None else None
    return dataclasses.replace(node, cpu_pressure=Psi(line, full))


def _load_per_core(node: NodeUsage) -> float | None:
    return node.load_per_core if node.cpus > 0 else None  # None when /proc/loadavg is unreadable


def _set_load_per_core(node: NodeUsage, value: float) -> NodeUsage:
    load1 = value * node.cpus
    load = node.load or LoadAverage(load1, load1, load1, 0, 0)
    return dataclasses.replace(node, load=LoadAverage(load1, load.load5, load.load15, load.runnable, load.threads))


def _hundred(node: NodeUsage) -> float:
    return 100.0


_CPU_SORT = ("class_and_priority", "cpu_usage", "ext_cpu_usage", "running_time")
_MEMORY_SORT = ("class_and_priority", "memory_usage", "running_time")

CAPABILITIES: dict[Metric, Capability] = {
    cap.metric: cap
    for cap in (
        Capability(
            Metric.CPU_TOTAL_USAGE,
            Unit.CORES,
            Resource.CPU,
            throttleable=True,
            throttle_quantified=True,
            evictable=True,
            evict_quantified=True,
            sort_by=_CPU_SORT,
            compressible=True,
            read=lambda node: node.cores_used,
            capacity=lambda node: float(node.cpus),
            override=lambda node, value: dataclasses.replace(node, cores_used=value),
            per_resource_unit=lambda node: 1.0,
        ),
        Capability(
            Metric.CPU_TOTAL_UTILIZATION,
            Unit.PERCENT,
            Resource.CPU,
            throttleable=True,
            throttle_quantified=True,
            evictable=True,
            evict_quantified=True,
            sort_by=_CPU_SORT,
            compressible=True,
            read=lambda node: node.cpu_utilization,
            capacity=_hundred,
            override=lambda node, value: dataclasses.replace(node, cpu_utilization=value),
            per_resource_unit=lambda node: 100.0 / node.cpus,
        ),
        Capability(
            Metric.MEMORY_TOTAL_USAGE,
            Unit.BYTES,
            Resource.MEMORY,
            throttleable=True,  # memory.high on cgroup v2 (policy.memory)
            throttle_quantified=True,
            evictable=True,
            evict_quantified=True,
            sort_by=_MEMORY_SORT,
            compressible=False,
            read=_memory_used,
            capacity=_memory_capacity,
            override=_set_memory_used,
            per_resource_unit=lambda node: 1.0,
        ),
        Capability(
            Metric.MEMORY_TOTAL_UTILIZATION,
            Unit.PERCENT,
            Resource.MEMORY,
            throttleable=True,  # memory.high on cgroup v2 (policy.memory)
            throttle_quantified=True,
            evictable=True,
            evict_quantified=True,
            sort_by=_MEMORY_SORT,
            compressible=False,
            read=_memory_utilization,
            capacity=_hundred,
            override=lambda node, value: _set_memory_used(node, value * _memory_capacity(node) / 100.0),
            per_resource_unit=_memory_percent_per_byte,
        ),
        Capability(
            Metric.CPU_PRESSURE,
            Unit.PERCENT,
            Resource.CPU,
            throttleable=True,
            throttle_quantified=False,
            evictable=True,
            evict_quantified=False,
            sort_by=_CPU_SORT,
            compressible=True,
            read=_cpu_pressure,  # "some" avg10 of /proc/pressure/cpu
            capacity=_hundred,
            override=_set_cpu_pressure,
            raised_by_throttling=True,
        ),
        Capability(
            Metric.LOAD_AVERAGE,
            Unit.LOAD_PER_CORE,
            Resource.CPU,
            throttleable=True,
            throttle_quantified=False,
            evictable=True,
            evict_quantified=False,
            sort_by=_CPU_SORT,
            compressible=True,
            read=_load_per_core,  # load1 / cores
            capacity=lambda node: 1.0,
            override=_set_load_per_core,
        ),
        Capability(
            Metric.PROTECTED_CPU_STALL,
            Unit.PERCENT,
            Resource.CPU,
            throttleable=True,
            throttle_quantified=False,
            # Harm to one workload is no reason to evict another: throttling frees its CPU as well.
            evictable=False,
            evict_quantified=False,
            sort_by=_CPU_SORT,
            compressible=True,
            read=lambda node: node.protected_cpu_stall,
            capacity=_hundred,
            override=lambda node, value: dataclasses.replace(node, protected_cpu_stall=value),
            protected=True,
        ),
        Capability(
            Metric.PROTECTED_MEMORY_STALL,
            Unit.PERCENT,
            Resource.MEMORY,
            throttleable=True,  # lowers the candidates' memory.high (policy.memory), cgroup v2 only
            throttle_quantified=False,
            evictable=False,
            evict_quantified=False,
            sort_by=_MEMORY_SORT,
            compressible=False,
            read=lambda node: node.protected_memory_stall,
            capacity=_hundred,
            override=lambda node, value: dataclasses.replace(node, protected_memory_stall=value),
            protected=True,
        ),
    )
}
