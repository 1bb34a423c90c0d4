"""What a plan asks the actuators to do, as data; and why it did not do more.

Every lever change is a ``LeverChange`` (``nodeguard.model.levers``); an
eviction is not a lever and has its own ``Evict``. Gaps and releases are in
the unit of the action's metric (cores, bytes, percent, load per core).
``predicted_release`` is None for a non-quantified metric, where the release
cannot be predicted; a give-back's is negative: the usage it may add back.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from nodeguard.model.levers import LeverChange
from nodeguard.model.workloads import Workload
from nodeguard.policy.metrics import Metric
from nodeguard.policy.state import Direction


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


Action = LeverChange | Evict


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
