"""One immutable view of the node per tick, with rates against the previous one."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass
from typing import NamedTuple

from nodeguard.model.samples import CpuMax, CpuStat, LoadAverage, MemInfo, ProcStatCpu, Psi, PsiTotals
from nodeguard.model.workloads import Workload


class WorkloadUsage(NamedTuple):
    """One workload in one snapshot (a NamedTuple: built a thousand times per tick)."""

    workload: Workload
    cpu: CpuStat
    cpu_max: CpuMax | None  # None where the cpu controller is not enabled
    cpu_pressure: PsiTotals | None
    memory_bytes: int | None
    cores: float | None  # CPU used since the previous snapshot; None on first sight
    throttled_fraction: float | None  # of CFS periods since the previous snapshot
    cpu_stall_pct: float | None  # PSI "some" stall over the last interval, percent of time
    # Cores' worth of time its threads were runnable but not running (their
    # run-queue delay, CFS throttling included); None when not known (first
    # sight, or idle). ``starved_cores``: the part of it from threads runnable
    # the whole tick, work that would take CPU freed elsewhere.
    waiting_cores: float | None = None
    starved_cores: float | None = None
    # Cores' worth of time a CFS bandwidth limit held it back: its own cpu.max
    # (cpu.stat throttled time, summed over CPUs) or, where that is more, a
    # container's own limit (its threads' throttled time); None on first sight.
    throttled_cores: float | None = None
    # Its memory.high in bytes, math.inf for "max"; None where it has none (cgroup v1, no memory controller).
    memory_high: float | None = None
    # memory.pressure totals, and its "some" stall over the last interval, percent of time (cgroup v2).
    memory_pressure: PsiTotals | None = None
    memory_stall_pct: float | None = None
    # The part of throttled_cores its own cpu.max held back: what a hold on this cgroup decides.
    own_throttled_cores: float | None = None


@dataclass(frozen=True, slots=True)
class NodeUsage:
    """The node in one snapshot; a figure whose /proc file could not be read this tick is None."""

    cpus: int
    cpu: ProcStatCpu | None
    cores_used: float | None  # None on the first snapshot
    cpu_utilization: float | None  # percent of all cores
    load: LoadAverage | None
    memory: MemInfo | None
    cpu_pressure: Psi | None  # None before kernel 4.20 or with psi=0
    memory_pressure: Psi | None
    io_pressure: Psi | None
    # A what-if's value for the protected workloads' worst CPU stall (percent); None: computed from the
    # workloads (policy.stall), which only the policy can do, as it knows which workloads are protected.
    protected_cpu_stall: float | None = None
    protected_memory_stall: float | None = None  # likewise, their memory stall (memory.pressure "some")

    @property
    def memory_used(self) -> int | None:
        return None if self.memory is None else self.memory.total - self.memory.available

    @property
    def memory_utilization(self) -> float | None:
        if self.memory is None or self.memory.total <= 0:
            return None
        return 100.0 * (self.memory.total - self.memory.available) / self.memory.total

    @property
    def load_per_core(self) -> float | None:
        return None if self.load is None else self.load.load1 / self.cpus

    def with_cores_reserved(self, cores: float) -> NodeUsage:
        """The node as if ``cores`` more CPU were busy (room held for a start that is about to cost it)."""
        if self.cores_used is None or self.cpu_utilization is None or self.cpus <= 0:
            return self
        utilization = self.cpu_utilization + 100.0 * cores / self.cpus
        return dataclasses.replace(self, cores_used=self.cores_used + cores, cpu_utilization=utilization)


@dataclass(frozen=True, slots=True)
class Snapshot:
    monotonic: float  # when it was taken; rates use this
    wall_time: float  # for display only
    interval: float | None  # seconds since the previous snapshot
    cgroup_version: str
    node: NodeUsage
    workloads: Mapping[str, WorkloadUsage]  # by workload id; read-only view
