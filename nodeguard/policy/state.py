"""What the guard remembers between ticks: counters, cool-downs, throttles held, evictions pending.

The planner takes a GuardState and returns a new one; nothing here changes in
place. The new state assumes every action that is not a dry run was carried
out; the daemon drops what failed (``without_eviction``) and holds back a
workload whose write the kernel refused (``with_held_back``), then plans the
same tick again without it.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace
from enum import StrEnum

from nodeguard.backoff import doubling
from nodeguard.model.samples import CpuMax
from nodeguard.policy.metrics import Metric


class Direction(StrEnum):
    THROTTLE = "throttle"  # lower quotas: the throttle-down gap
    RESTORE = "restore"  # raise quotas back: the throttle-up gap
    REFILL = "refill"  # raise quotas of starved throttled workloads into room left under the waterline
    EVICT = "evict"


Key = tuple[Metric, Direction]

# Streaks are capped: a counter only needs to reach the largest triggerAfter/restoreAfter.
STREAK_CAP = 1000


@dataclass(frozen=True, slots=True)
class HeldThrottle:
    """A workload whose quota the guard lowered, and the limit it had before."""

    workload_id: str
    original: CpuMax  # cpu.max when first throttled; quota_us None = unlimited
    quota: CpuMax  # what the guard set last
    reasons: frozenset[Metric]  # may be empty (a throttle adopted from the ledger of an older run)
    since: float  # monotonic time of the first throttle
    # Cores it used when first throttled; a restore that lifts the quota past
    # this releases it at once. None (unknown) climbs all the way step by step.
    demand_cores: float | None = None


@dataclass(frozen=True, slots=True)
class HeldMemory:
    """A workload whose memory.high the guard lowered (policy.memory), and the value it had before."""

    workload_id: str
    original: int | None  # bytes, None for "max"
    high: int  # what the guard set last, bytes
    reasons: frozenset[Metric]  # may be empty (adopted from the ledger of an older run)
    since: float  # monotonic time of the first throttle
    # Bytes it used when first throttled: a restore that lifts memory.high past this releases it at once.
    demand_bytes: int | None = None
    # Monotonic time it was last seen pressing against the hold (policy.memory.presses); None: not yet.
    pressed: float | None = None


@dataclass(frozen=True, slots=True)
class QuotaTrial:
    """Quotas set for a protected workload's stall after the weights came down: they stay only if they cut it."""

    since: float  # monotonic time of the first of them
    before: float  # the stall (percent), the mean of the readings that brought them
    total: float = 0.0  # stall readings (percent) since, summed
    ticks: int = 0


@dataclass(frozen=True, slots=True)
class PendingEviction:
    """A workload asked to leave and not gone yet: its usage counts as released already."""

    workload_id: str
    metric: Metric
    cores: float
    memory_bytes: int
    since: float  # monotonic


@dataclass(frozen=True, slots=True)
class HeldBack:
    """A workload whose last quota write the kernel refused: no candidate until ``until``.

    A write that fails releases nothing, so the gap is closed with the next
    candidates; retrying the same write every tick would only fail again.
    """

    workload_id: str
    error: str  # errno name (EINVAL, EACCES …) or the refusal's kind
    file: str  # the file that was refused
    detail: str
    since: float  # monotonic, the first refusal in this run of refusals
    until: float  # monotonic
    failures: int  # refusals in a row: the back-off doubles with each


def held_back_after(
    previous: HeldBack | None,
    workload_id: str,
    *,
    error: str,
    file: str,
    detail: str,
    now: float,
    first: float,
    longest: float,
) -> HeldBack:
    """The hold after one more refusal: ``first`` seconds, doubled per refusal in a row, at most ``longest``."""
    failures = 1 if previous is None else previous.failures + 1
    wait = doubling(first, longest, failures)
    since = now if previous is None else previous.since
    return HeldBack(workload_id, error, file, detail, since, now + wait, failures)


@dataclass(frozen=True, slots=True)
class LoweredWeight:
    """A group whose CPU weight nodeguard holds at the least (the executor keeps its original in the ledger)."""

    group: str
    since: float  # monotonic
    stall_pct: float | None = None  # the protected stall that made it come down
    # Ticks in a row the work under it did not wait for CPU the node lacks: what lets it go back.
    quiet_ticks: int = 0


@dataclass(frozen=True, slots=True)
class GuardState:
    # Consecutive ticks past the waterline (THROTTLE, EVICT) or below the restore
    # waterline (RESTORE), per metric.
    streaks: Mapping[Key, int] = field(default_factory=dict)
    # Ticks still to wait after acting on a non-quantified metric.
    cooldowns: Mapping[Key, int] = field(default_factory=dict)
    throttles: Mapping[str, HeldThrottle] = field(default_factory=dict)
    # Workloads whose memory.high the guard holds lowered (throttle objectives on memory metrics).
    memory: Mapping[str, HeldMemory] = field(default_factory=dict)
    evictions: Mapping[str, PendingEviction] = field(default_factory=dict)
    # Monotonic time of the last eviction round; dry runs keep their own clock
    # so a logged eviction never delays a real one.
    last_eviction: Mapping[bool, float] = field(default_factory=dict)
    # Workloads whose last write the kernel refused, while their back-off lasts
    # and after it (so that a repeated refusal waits longer); a write that
    # succeeds drops the entry.
    held_back: Mapping[str, HeldBack] = field(default_factory=dict)
    # Groups whose weight is lowered for protected_cpu_stall, and when a protected workload was last harmed.
    lowered: Mapping[str, LoweredWeight] = field(default_factory=dict)
    last_harm: float | None = None
    # protected_cpu_stall after the weights: its last few readings, the quotas on trial, and how long the quota
    # lever stays off after quotas that did not cut the stall.
    recent_stall: tuple[float, ...] = ()
    quota_trial: QuotaTrial | None = None
    quotas_futile_until: float | None = None

    @classmethod
    def primed(cls) -> GuardState:
        """A state whose streaks have already held long enough, for a one-shot plan (``nodeguard plan``)."""
        return cls(streaks={(metric, direction): STREAK_CAP for metric in Metric for direction in Direction})

    def with_held_back(self, holds: Mapping[str, HeldBack]) -> GuardState:
        return replace(self, held_back={**self.held_back, **holds})

    def without_held_back(self, workload_ids: Iterable[str]) -> GuardState:
        drop = set(workload_ids) & self.held_back.keys()
        if not drop:
            return self
        return replace(self, held_back={k: v for k, v in self.held_back.items() if k not in drop})

    def without_eviction(self, workload_id: str) -> GuardState:
        return replace(self, evictions={k: v for k, v in self.evictions.items() if k != workload_id})
