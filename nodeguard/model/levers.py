"""Levers as data: what each lever is called, and the one change type that goes from the plan to the kernel.

A *lever* is one way of holding a cgroup back (a CPU quota, a CPU weight,
memory.high). Its code lives in ``nodeguard.actuators.levers``, one module
each; what the rest of nodeguard calls it (ledger key, noun, Kubernetes Event
reasons, metric names) is declared here once, as a ``LeverTerms``, so that
the policy, which is below the actuators, can name it, and Events, metrics,
/status and the trace iterate over the levers instead of naming them.

Every change the plan asks of any lever is a ``LeverChange``: which lever,
which group, the value to write and the value to give back, as the lever's
canonical text (the form the ledger keeps), with the metric and reason.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Literal, NamedTuple, Protocol

from nodeguard.model.workloads import Workload

EventType = Literal["Normal", "Warning"]


@dataclass(frozen=True, slots=True)
class EventKind:
    """A Kubernetes Event's reason, type and action."""

    reason: str
    type: EventType
    action: str


@dataclass(frozen=True, slots=True)
class LeverTerms:
    """What one lever is called wherever nodeguard shows it."""

    name: str  # its key in the ledger, its label in metrics, e.g. "cpu.max"
    noun: str  # its value in messages: "quota"
    holds: EventKind  # the Event of a change that holds the group back more
    gives_back: EventKind  # the Event of a change that gives some or all of it back
    # Gauges of what it holds, from the ledger: how many groups, and each group's value and original in the
    # lever's unit (None: no such gauge).
    count_metric: str | None = None
    value_metric: str | None = None
    original_metric: str | None = None
    unit: str = ""  # of the gauges' values, for their help text


CPU_QUOTA = LeverTerms(
    "cpu.max",
    "quota",
    EventKind("NodeguardThrottled", "Warning", "Throttle"),
    EventKind("NodeguardRestored", "Normal", "Restore"),
    count_metric="nodeguard_throttled_workloads",
    value_metric="nodeguard_throttle_quota_cores",
    original_metric="nodeguard_throttle_original_quota_cores",
    unit="cores",
)
CPU_WEIGHT = LeverTerms(
    "cpu.weight",
    "weight",
    EventKind("NodeguardWeightLowered", "Warning", "LowerWeight"),
    EventKind("NodeguardWeightRestored", "Normal", "RestoreWeight"),
    count_metric="nodeguard_lowered_weights",
)
MEMORY_HIGH = LeverTerms(
    "memory.high",
    "memory.high",
    EventKind("NodeguardMemoryThrottled", "Warning", "ThrottleMemory"),
    EventKind("NodeguardMemoryRestored", "Normal", "RestoreMemory"),
    count_metric="nodeguard_memory_throttled_workloads",
    value_metric="nodeguard_memory_high_bytes",
    original_metric="nodeguard_memory_high_original_bytes",
    unit="bytes",
)
LEVERS: tuple[LeverTerms, ...] = (CPU_QUOTA, CPU_WEIGHT, MEMORY_HIGH)
# The weight lever's value for cgroup v2's cpu.idle (its least weight where the kernel has none).
WEIGHT_IDLE = "0"
TERMS: dict[str, LeverTerms] = {terms.name: terms for terms in LEVERS}

LeverKey = tuple[str, str]  # (lever name, group)


class Details(Protocol):
    """The lever's own view of a change for the decision trace, worked out when the trace asks."""

    def fields(self) -> Iterable[tuple[str, object]]: ...


@dataclass(frozen=True, slots=True)
class NoDetails:
    def fields(self) -> Iterable[tuple[str, object]]:
        return ()


NO_DETAILS = NoDetails()


class LeverChange(NamedTuple):
    """Set one group's value with one lever: what the plan asks, what the executor applies, what Events tell.

    A named tuple: a plan makes one per throttle, a hundred in a busy tick,
    and a tuple is made four times faster than a frozen dataclass of as many
    fields. Values are the lever's canonical text. ``target`` None asks for the
    lever's strongest hold on the group (a weight's least, which only the
    kernel's files tell), or, for a release, the original the ledger keeps.
    """

    lever: str
    group: str  # the cgroup, relative to the hierarchy root: a workload's id, or a group such as a QoS tier
    target: str | None
    give_back: str | None  # the value before nodeguard first changed it (None: what the group has now)
    release: bool  # back to the original: the ledger forgets the group after
    holds_back: bool  # holds the group back more (a throttle, a lowered weight); False gives back
    kind: str  # throttle, restore, memory_throttle, memory_restore, reweigh; reassert, give_back (history only)
    metric: str  # the metric behind it
    reason: str
    dry_run: bool = False
    workload: Workload | None = None  # the workload it changes; None for a group that is not one
    gap_before: float | None = None  # the gap still open before it, in the metric's unit
    predicted_release: float | None = None  # in the metric's unit (negative: usage it may add back)
    previous: str | None = None  # the value the plan took the group to have
    releases: float | None = None  # what it frees in its resource's own unit (cores, bytes)
    workloads: tuple[str, ...] = ()  # a group's change: the candidates under it it holds back
    # The lever's own view of the change for the decision trace, as the planner worked it out (the values
    # in their unit, whether it released).
    details: Details = NO_DETAILS

    @property
    def key(self) -> LeverKey:
        return (self.lever, self.group)

    @property
    def workload_id(self) -> str:
        return self.group
