"""What a plan asks the actuators to do, as data; and why it did not do more.

Gaps and releases are in the unit of the action's metric (cores, bytes,
percent, load per core). ``predicted_release`` is None for a non-quantified
metric, where the release cannot be predicted; a restore's is negative: the
usage it may add back.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from nodeguard.model.samples import CpuMax
from nodeguard.model.workloads import Workload
from nodeguard.policy.metrics import Metric
from nodeguard.policy.state import Direction


@dataclass(frozen=True, slots=True)
class Throttle:
    workload: Workload
    metric: Metric
    reason: str
    gap_before: float  # still open before this action
    predicted_release: float | None
    release_cores: float
    quota: CpuMax  # the cpu.max to write
    previous: CpuMax  # the limit before this action
    original: CpuMax  # the limit before the guard first touched it: for the ledger
    dry_run: bool
    kind: Literal["throttle"] = "throttle"

    @property
    def workload_id(self) -> str:
        return self.workload.id


@dataclass(frozen=True, slots=True)
class Restore:
    workload: Workload
    metric: Metric
    reason: str
    gap_before: float | None  # the throttle-up gap still open; None if no objective is left on the metric
    predicted_release: float | None  # negative
    quota: CpuMax  # the cpu.max to write: exactly ``original`` when ``full``
    previous: CpuMax
    original: CpuMax
    full: bool  # the workload is released: drop it from the ledger after writing
    dry_run: bool
    kind: Literal["restore"] = "restore"

    @property
    def workload_id(self) -> str:
        return self.workload.id


@dataclass(frozen=True, slots=True)
class Evict:
    workload: Workload
    metric: Metric
    reason: str
    gap_before: float
    predicted_release: float | None
    cores: float  # what it uses now (after this plan's throttles)
    memory_bytes: int
    dry_run: bool
    kind: Literal["evict"] = "evict"

    @property
    def workload_id(self) -> str:
        return self.workload.id


@dataclass(frozen=True, slots=True)
class MemoryThrottle:
    """Lower a workload's memory.high (policy.memory): the kernel reclaims from it and slows its allocations."""

    workload: Workload
    metric: Metric
    reason: str
    gap_before: float  # still open before this action, in the metric's unit
    predicted_release: float | None  # in the metric's unit: at most what it uses above the new memory.high
    release_bytes: int
    high: int  # the memory.high to write, bytes
    previous: int | None  # memory.high before this action (None: "max")
    original: int | None  # memory.high before the guard first touched it: for the ledger
    dry_run: bool
    kind: Literal["memory_throttle"] = "memory_throttle"

    @property
    def workload_id(self) -> str:
        return self.workload.id


@dataclass(frozen=True, slots=True)
class MemoryRestore:
    """Raise a held memory.high a step, or write its original back (``full``)."""

    workload: Workload
    metric: Metric
    reason: str
    gap_before: float | None  # the throttle-up gap still open
    predicted_release: float | None  # negative: the usage it may add back
    high: int | None  # the memory.high to write: exactly ``original`` when ``full``
    previous: int | None
    original: int | None
    full: bool
    dry_run: bool
    kind: Literal["memory_restore"] = "memory_restore"

    @property
    def workload_id(self) -> str:
        return self.workload.id


MemoryAction = MemoryThrottle | MemoryRestore
Action = Throttle | Restore | Evict | MemoryThrottle | MemoryRestore


@dataclass(frozen=True, slots=True)
class Reweigh:
    """Lower a group's CPU weight to the kernel's least, or put its original back (protected_cpu_stall).

    The group need not be a workload: it is where CFS weighs the candidates
    against the protected workload (policy.stall.competing_group), often a
    kubelet QoS tier. Work-conserving: the group still gets every idle cycle.
    """

    group: str  # cgroup path relative to the root
    metric: Metric
    reason: str
    lower: bool  # False: the original weight back
    workloads: tuple[str, ...]  # the candidates it holds back (for the record)
    dry_run: bool
    kind: Literal["reweigh"] = "reweigh"


Cause = Literal[
    "missing-sample",  # the circuit breaker: no fresh value for the metric or a candidate
    "confirming",  # past (or below) the line for fewer ticks than triggerAfter (restoreAfter)
    "cooldown",  # waiting to measure the effect of the last closed-loop action
    "throttling",  # no restore while any throttle waterline is past
    "dead-band",  # between the restore waterline and the waterline: nothing to do
    "eviction-budget",  # maxPerTick or minIntervalSeconds
    "eviction-pending",  # an evicted workload is still terminating
    "exhausted",  # candidates cannot release enough: part of the gap stays open
    "step-too-small",  # the change would be under minChangePercent
    "futile",  # quotas did not cut the protected stall: given back, the quota lever off for a while
    "contended",  # a lowered weight or memory.high stays: its work still wants what it holds from the protected
    "needs-cgroup-v2",  # memory throttling writes memory.high, which cgroup v1 does not have
]


@dataclass(frozen=True, slots=True)
class Blocked:
    """A metric and direction the plan did not (fully) act on, and why."""

    metric: Metric
    direction: Direction
    cause: Cause
    detail: str
