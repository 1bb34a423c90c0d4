"""What the guard remembers between ticks: streaks, cool-downs, every lever's holds, evictions pending, protection.

The planner takes a GuardState and returns a new one; nothing here changes in
place. The new state assumes every change that is not a dry run was carried
out; the fold (``policy.outcome``) keeps what the executor says did not
happen, drops failed evictions and holds back a group whose write the kernel
refused, and the daemon plans the same tick again without it.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace
from enum import StrEnum
from types import MappingProxyType
from typing import cast

from nodeguard.backoff import doubling
from nodeguard.policy.holds import AnyHold, H, Holds, holding
from nodeguard.policy.metrics import Metric
from nodeguard.policy.protect_state import ProtectState
from nodeguard.policy.tuning import STREAK_CAP

_NONE: Mapping[str, AnyHold] = MappingProxyType({})


class Direction(StrEnum):
    THROTTLE = "throttle"  # lower quotas: the throttle-down gap
    RESTORE = "restore"  # raise quotas back: the throttle-up gap
    REFILL = "refill"  # raise quotas of starved throttled workloads into room left under the waterline
    EVICT = "evict"


MetricDirection = tuple[Metric, Direction]  # what a streak or a cool-down counts for


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
    """A group whose last write the kernel refused: no candidate (nor group to lower) until ``until``.

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
class GuardState:
    # Consecutive ticks past the waterline (THROTTLE, EVICT) or below the restore
    # waterline (RESTORE), per metric.
    streaks: Mapping[MetricDirection, int] = field(default_factory=dict)
    # Ticks still to wait after acting on a non-quantified metric.
    cooldowns: Mapping[MetricDirection, int] = field(default_factory=dict)
    # What every lever holds back, by lever and group (policy.holds).
    holds: Holds = field(default_factory=dict)
    evictions: Mapping[str, PendingEviction] = field(default_factory=dict)
    # Monotonic time of the last eviction round; dry runs keep their own clock
    # so a logged eviction never delays a real one.
    last_eviction: Mapping[bool, float] = field(default_factory=dict)
    # Groups whose last write the kernel refused, while their back-off lasts
    # and after it (so that a repeated refusal waits longer); a write that
    # succeeds drops the entry.
    held_back: Mapping[str, HeldBack] = field(default_factory=dict)
    protect: ProtectState = field(default_factory=ProtectState)

    @classmethod
    def primed(cls) -> GuardState:
        """A state whose streaks have already held long enough, for a one-shot plan (``nodeguard plan``)."""
        return cls(streaks={(metric, direction): STREAK_CAP for metric in Metric for direction in Direction})

    @classmethod
    def holding(cls, *holds: AnyHold, **fields: object) -> GuardState:
        """A state that holds ``holds`` (and has ``fields``): for adoption at start, and tests."""
        return replace(cls(), holds=holding(holds), **fields)  # type: ignore[arg-type]

    def held(self, kind: type[H]) -> Mapping[str, H]:
        """One lever's holds, by group."""
        return cast(Mapping[str, H], self.holds.get(kind.lever, _NONE))

    def every_hold(self) -> Iterable[AnyHold]:
        for groups in self.holds.values():
            yield from groups.values()

    def with_held_back(self, holds: Mapping[str, HeldBack]) -> GuardState:
        return replace(self, held_back={**self.held_back, **holds})

    def without_held_back(self, workload_ids: Iterable[str]) -> GuardState:
        drop = set(workload_ids) & self.held_back.keys()
        if not drop:
            return self
        return replace(self, held_back={k: v for k, v in self.held_back.items() if k not in drop})

    def without_eviction(self, workload_id: str) -> GuardState:
        return replace(self, evictions={k: v for k, v in self.evictions.items() if k != workload_id})
