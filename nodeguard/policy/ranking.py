"""Composable comparators: which workload the guard acts on first.

Each comparator maps a workload to one part of a sort key; lower sorts first,
and first means *least important*: the first to be throttled or evicted.
``ordered_by(a, b, c)`` compares by ``a``, then ``b`` on ties, then ``c``, and
always breaks the last tie by workload id so the order never depends on the
order of the input (kubelet's ``orderedBy``, crane's ``executor/sort``). The
sort is one stable pass per key part, last part first: the same order as
sorting by the key tuples, without building a thousand of them each tick.

The comparators:

- ``class_and_priority``: BestEffort before Burstable before Guaranteed, then
  lower priority first.
- ``qos_class`` and ``priority``: each half of that on its own.
- ``cpu_usage``: more cores used first (throttling it releases most).
- ``ext_cpu_usage``: more CPU used *beyond the workload's request* first, i.e.
  ``max(0, cores - cpu_request_cores)`` with a missing request counted as 0: a
  workload bursting past what it asked for goes before one within its request.
- ``memory_usage``: more memory first.
- ``running_time``: the most recently started first (the shortest running, as
  kubelet and crane pick); an unknown start time counts as the longest running.

A usage that is not known (``None``) counts as 0; the planner refuses to act
on a metric while a candidate's usage for it is unknown, so that only matters
for display.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass

from nodeguard.model.snapshot import WorkloadUsage
from nodeguard.model.workloads import QOS_RANK

KeyPart = int | float | tuple[int, int]
SortKey = tuple[KeyPart | str, ...]  # the comparators' parts, then the workload id
Comparator = Callable[[WorkloadUsage], KeyPart]
Ranked = list[WorkloadUsage]  # least important first


def class_and_priority(usage: WorkloadUsage) -> tuple[int, int]:
    workload = usage.workload
    return (-QOS_RANK[workload.qos_class], workload.priority)


def qos_class(usage: WorkloadUsage) -> int:
    return -QOS_RANK[usage.workload.qos_class]


def priority(usage: WorkloadUsage) -> int:
    return usage.workload.priority


def cpu_usage(usage: WorkloadUsage) -> float:
    return -(usage.cores or 0.0)


def ext_cpu_usage(usage: WorkloadUsage) -> float:
    # -max(0.0, over) without the call to max (half this part's sort time), -0.0 included.
    over = (usage.cores or 0.0) - (usage.workload.cpu_request_cores or 0.0)
    return -over if over > 0.0 else -0.0


def memory_usage(usage: WorkloadUsage) -> int:
    return -(usage.memory_bytes or 0)


def running_time(usage: WorkloadUsage) -> float:
    # Wall-clock start times are positive, so 0.0 (unknown) sorts after all known ones.
    return -(usage.workload.started_at or 0.0)


COMPARATORS: dict[str, Comparator] = {
    fn.__name__: fn
    for fn in (class_and_priority, qos_class, priority, cpu_usage, ext_cpu_usage, memory_usage, running_time)
}


def workload_id(usage: WorkloadUsage) -> str:
    return usage.workload.id


# A comparator whose part is a tuple sorts as its own parts (flat keys sort on CPython's fast paths).
PARTS: dict[Comparator, tuple[Comparator, ...]] = {class_and_priority: (qos_class, priority)}


@dataclass(frozen=True, slots=True)
class Ordering:
    """A composed comparator: sorts workloads least important first."""

    comparators: tuple[Comparator, ...]

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(c.__name__ for c in self.comparators)

    def key(self, usage: WorkloadUsage) -> SortKey:
        return (*(c(usage) for c in self.comparators), usage.workload.id)

    def sort(self, usages: Iterable[WorkloadUsage]) -> Ranked:
        """Least important first: ordered as by ``key``."""
        ranked = list(usages)
        ranked.sort(key=workload_id)
        for comparator in reversed(self.comparators):  # stable sorts: each earlier part decides over the later ones
            for part in reversed(PARTS.get(comparator, (comparator,))):
                ranked.sort(key=part)
        return ranked


def ordered_by(*comparators: Comparator) -> Ordering:
    return Ordering(comparators)


def ordering(names: Iterable[str]) -> Ordering:
    """The ordering named in a config; ValueError names an unknown comparator."""
    comparators = []
    for name in names:
        if name not in COMPARATORS:
            raise ValueError(f"unknown comparator {name!r}; expected one of {', '.join(COMPARATORS)}")
        comparators.append(COMPARATORS[name])
    return Ordering(tuple(comparators))


# crane's GeneralSorter and CpuUsageSorter; the memory one is kubelet's eviction order.
GENERAL_SORTER = ordered_by(class_and_priority, running_time)
CPU_USAGE_SORTER = ordered_by(class_and_priority, cpu_usage, ext_cpu_usage, running_time)
