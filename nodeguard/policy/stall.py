"""The protected workloads' own CPU stall: the share of the last tick they were runnable but not running.

This is harm, measured on the workload that suffers it, where node CPU is only
a proxy for it (a node 99 % busy with batch work at kubelet's weights barely
delays a Guaranteed pod; one 70 % busy may still delay it). Sources, per tick:

- cgroup v2: the workload's own ``cpu.pressure`` ("some" total, as a share of
  the tick);
- cgroup v1 (no per-cgroup PSI): its threads' run-queue delay
  (``/proc/<tid>/schedstat``, see sources.taskwait), in cores, at most one.

Either way its own CFS throttling is taken off: a throttled thread is runnable,
and throttling others cannot fix a limit of its own. A candidate's stall is
never read: throttling it inflates it.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import NamedTuple

from nodeguard.model.snapshot import WorkloadUsage
from nodeguard.model.workloads import Workload
from nodeguard.policy.selection import protected_for
from nodeguard.policy.settings import ProtectEntry
from nodeguard.policy.tuning import IDLE_CORES


class Stall(NamedTuple):
    usage: WorkloadUsage
    share: float | None  # of the last tick, 0..1; None before it has a usage rate


def is_protected(workload: Workload, patterns: tuple[ProtectEntry, ...]) -> bool:
    """Protected for the stall objective: taken by one of its ``protect`` entries (a glob on the name or cgroup
    path, or a pod selector), or, with none, a Guaranteed pod or a workload protected by what it is."""
    return protected_for(workload, patterns)


def stall_share(usage: WorkloadUsage) -> float | None:
    """Its stall over the last tick, its own throttling taken off; None before it has a usage rate."""
    if usage.cores is None:
        return None
    if usage.cpu_stall_pct is not None:
        waited = usage.cpu_stall_pct / 100.0
    elif usage.waiting_cores is not None:
        waited = usage.waiting_cores
    else:
        return 0.0  # idle: its threads are not followed, and it waited for nothing
    own = usage.throttled_cores or 0.0
    return min(1.0, max(0.0, waited - own))


def stalls(workloads: Mapping[str, WorkloadUsage], patterns: tuple[ProtectEntry, ...]) -> list[Stall]:
    """Each protected workload's stall."""
    return [Stall(u, stall_share(u)) for u in workloads.values() if is_protected(u.workload, patterns)]


def competing_group(candidate: str, protected: str) -> str | None:
    """The cgroup on the candidate's path that CFS weighs against the protected workload's: the child, on the
    candidate's side, of their deepest common ancestor (a kubelet pod's QoS tier, against a Guaranteed pod).

    Only the weight there counts: lowering a pod's weight inside its tier changes nothing against a pod
    outside it. None when one path contains the other.
    """
    ours, theirs = candidate.split("/"), protected.split("/")
    common = 0
    while common < min(len(ours), len(theirs)) and ours[common] == theirs[common]:
        common += 1
    if common >= len(ours) or common >= len(theirs):
        return None
    return "/".join(ours[: common + 1])


def covers(group: str, workload_id: str) -> bool:
    """Whether ``workload_id`` is the group or inside it."""
    return workload_id == group or workload_id.startswith(group + "/")


class Harmed(NamedTuple):
    usage: WorkloadUsage
    share: float


def worst(found: Iterable[Stall]) -> Harmed | None:
    """The most stalled protected workload with a stall known (it drives the objective)."""
    known = [Harmed(s.usage, s.share) for s in found if s.share is not None]
    return max(known, key=lambda h: (h.share, h.usage.workload.id), default=None)


def competing_demand(competitors: Iterable[WorkloadUsage], idle_cores: float) -> float | None:
    """Cores the competitors wait for past the node's idle CPU (their own CFS limits' share taken off): what a
    lowered weight holds from them, and what putting it back would take from the protected workloads.

    Without their threads' waits, a node with no idle CPU counts their whole use as demand; None when not even
    their use is known (first sight).
    """
    found = list(competitors)
    if all(u.cores is None for u in found):
        return None
    known = [u for u in found if u.waiting_cores is not None]
    if not known:
        return 0.0 if idle_cores >= IDLE_CORES else sum(u.cores or 0.0 for u in found)
    waited = sum(max(0.0, (u.waiting_cores or 0.0) - (u.throttled_cores or 0.0)) for u in known)
    return max(0.0, waited - idle_cores)


@dataclass(frozen=True, slots=True)
class ProtectedStall:
    workload_id: str
    name: str
    stall_pct: float | None  # None before it has a usage rate
    waiting_cores: float | None  # all its threads' run-queue wait (v1), for the record


class ProtectedStalls:
    """The protected workloads' stalls for one tick, worked out when first asked for: a tick that neither acts
    for them nor reports them does nothing per workload."""

    def __init__(self, workloads: Mapping[str, WorkloadUsage], patterns: tuple[ProtectEntry, ...]) -> None:
        self._workloads = workloads
        self._patterns = patterns
        self._found: list[Stall] | None = None
        self._worst: tuple[Harmed | None] | None = None
        self._report: tuple[ProtectedStall, ...] | None = None

    def all(self) -> list[Stall]:
        if self._found is None:
            self._found = stalls(self._workloads, self._patterns)
        return self._found

    def worst(self) -> Harmed | None:
        if self._worst is None:
            self._worst = (worst(self.all()),)
        return self._worst[0]

    def reading(self) -> float | None:
        """The worst protected stall in percent; 0 with nothing protected (nobody harmed); None while every
        protected workload is too new to have one."""
        harmed = self.worst()
        if harmed is not None:
            return 100.0 * harmed.share
        return None if self.all() else 0.0

    def __eq__(self, other: object) -> bool:
        return isinstance(other, ProtectedStalls) and self.report() == other.report()

    __hash__ = None  # type: ignore[assignment]  # equal by their report, like the tuple plans held before

    def __repr__(self) -> str:
        return f"ProtectedStalls({self.report()!r})"

    def report(self) -> tuple[ProtectedStall, ...]:
        if self._report is None:
            self._report = tuple(
                ProtectedStall(
                    s.usage.workload.id,
                    s.usage.workload.name,
                    None if s.share is None else 100.0 * s.share,
                    s.usage.waiting_cores,
                )
                for s in self.all()
            )
        return self._report
