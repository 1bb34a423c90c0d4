"""The capability registry: what each node metric allows the guard to do.

A metric is *quantified* for an action when the release of acting on one
workload can be predicted from that workload's own usage; only then can the
planner act on a precise prefix of candidates. Other metrics act on one
workload at a time and measure again (closed loop).
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum


class Metric(StrEnum):
    CPU_TOTAL_USAGE = "cpu_total_usage"
    CPU_TOTAL_UTILIZATION = "cpu_total_utilization"
    MEMORY_TOTAL_USAGE = "memory_total_usage"
    MEMORY_TOTAL_UTILIZATION = "memory_total_utilization"
    CPU_PRESSURE = "cpu_pressure"
    LOAD_AVERAGE = "load_average"


class Unit(StrEnum):
    CORES = "cores"
    BYTES = "bytes"
    PERCENT = "percent"
    LOAD_PER_CORE = "load per core"


class Resource(StrEnum):
    """The workload resource that acting on this metric releases."""

    CPU = "cpu"
    MEMORY = "memory"


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
    # The figure a percentage threshold is a percentage of, if any.
    percent_of: str | None = None


_CPU_SORT = ("class_and_priority", "cpu_usage", "ext_cpu_usage", "running_time")
_MEMORY_SORT = ("class_and_priority", "memory_usage", "running_time")

CAPABILITIES: dict[Metric, Capability] = {
    cap.metric: cap
    for cap in (
        Capability(
            Metric.CPU_TOTAL_USAGE,
            Unit.CORES,
            Resource.CPU,
            True,
            True,
            True,
            True,
            _CPU_SORT,
            compressible=True,
            percent_of="node cores",
        ),
        Capability(
            Metric.CPU_TOTAL_UTILIZATION,
            Unit.PERCENT,
            Resource.CPU,
            True,
            True,
            True,
            True,
            _CPU_SORT,
            compressible=True,
        ),
        Capability(
            Metric.MEMORY_TOTAL_USAGE,
            Unit.BYTES,
            Resource.MEMORY,
            False,
            False,
            True,
            True,
            _MEMORY_SORT,
            compressible=False,
            percent_of="node memory",
        ),
        Capability(
            Metric.MEMORY_TOTAL_UTILIZATION,
            Unit.PERCENT,
            Resource.MEMORY,
            False,
            False,
            True,
            True,
            _MEMORY_SORT,
            compressible=False,
        ),
        Capability(
            Metric.CPU_PRESSURE, Unit.PERCENT, Resource.CPU, True, False, True, False, _CPU_SORT, compressible=True
        ),
        Capability(
            Metric.LOAD_AVERAGE,
            Unit.LOAD_PER_CORE,
            Resource.CPU,
            True,
            False,
            True,
            False,
            _CPU_SORT,
            compressible=True,
            percent_of="one runnable task per core",
        ),
    )
}
