"""What the planner's features decide, and what the tick has planned so far.

Each feature (throttle, evict, restore and refill, memory, protection) takes
the tick's context and what was planned before it (``Planned``, immutable)
and returns a ``Decision``: its actions, what it blocked and why, the holds
it sets or drops, the cool-downs it starts and what it releases. It works
out its decision in a ``Draft`` of its own. ``planner.plan`` folds the
decisions in one fixed order (``Planned.then``): that order is the only
place where one feature sees another's.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, TypeVar

from nodeguard.model.levers import LeverKey
from nodeguard.model.samples import CpuMax
from nodeguard.model.snapshot import WorkloadUsage
from nodeguard.policy.actions import Action, Blocked, Cause
from nodeguard.policy.holds import AnyHold, H, HeldMemory, HeldThrottle, Holds, updated
from nodeguard.policy.metrics import Metric
from nodeguard.policy.protect_state import ProtectState
from nodeguard.policy.state import Direction, MetricDirection, PendingEviction

_EMPTY: Mapping[Any, Any] = MappingProxyType({})
_UNSET = object()
T = TypeVar("T", int, float)


@dataclass(frozen=True, slots=True)
class Decision:
    """One feature's decision: what it adds to the tick."""

    actions: tuple[Action, ...] = ()
    blocked: tuple[Blocked, ...] = ()
    cooldowns: Mapping[MetricDirection, int] = field(default_factory=dict)  # started (ticks to wait)
    holds: Mapping[LeverKey, AnyHold | None] = field(default_factory=dict)  # set, or dropped (None)
    quotas: Mapping[str, CpuMax] = field(default_factory=dict)  # quotas lowered this tick
    # Running totals of the tick after it (None: it released nothing), summed in the order the releases were
    # decided: cores by throttles and evictions, memory by evictions, what memory.high cuts may release.
    released_cores: float | None = None
    released_memory: int | None = None
    throttled_memory: int | None = None
    evictions: Mapping[str, PendingEviction] = field(default_factory=dict)  # asked to leave (not dry runs)
    evicted: tuple[tuple[str, bool], ...] = ()  # (workload, dry run) asked to leave, dry runs included
    last_eviction: Mapping[bool, float] = field(default_factory=dict)  # a new eviction round, by dry run
    protect: ProtectState | None = None  # protection's state after it


NOTHING = Decision()  # what most features decide on a calm tick


@dataclass(frozen=True, slots=True)
class Planned:
    """What the tick has planned so far: the holds as they will be, and everything decided."""

    holds: Holds
    protect: ProtectState
    evictions: Mapping[str, PendingEviction]  # pending: still here from earlier ticks, and asked now
    last_eviction: Mapping[bool, float]
    actions: tuple[Action, ...] = ()
    blocked: tuple[Blocked, ...] = ()
    cooldowns: Mapping[MetricDirection, int] = field(default_factory=dict)
    quotas: Mapping[str, CpuMax] = field(default_factory=dict)
    released_cores: float = 0.0
    released_memory: int = 0
    throttled_memory: int = 0
    evicted: frozenset[str] = frozenset()
    evicted_count: Mapping[bool, int] = field(default_factory=lambda: {False: 0, True: 0})

    def held(self, kind: type[H]) -> Mapping[str, H]:
        groups = self.holds.get(kind.lever)
        return _EMPTY if groups is None else groups  # type: ignore[return-value]

    def then(self, decision: Decision) -> Planned:
        """This plan with ``decision`` folded in after everything before it."""
        d = decision
        if d is NOTHING:
            return self
        count = dict(self.evicted_count)
        for _, dry in d.evicted:
            count[dry] += 1
        return Planned(
            holds=updated(self.holds, d.holds) if d.holds else self.holds,
            protect=d.protect if d.protect is not None else self.protect,
            evictions={**self.evictions, **d.evictions} if d.evictions else self.evictions,
            last_eviction={**self.last_eviction, **d.last_eviction} if d.last_eviction else self.last_eviction,
            actions=self.actions + d.actions,
            blocked=self.blocked + d.blocked,
            cooldowns={**self.cooldowns, **d.cooldowns} if d.cooldowns else self.cooldowns,
            quotas={**self.quotas, **d.quotas} if d.quotas else self.quotas,
            released_cores=self.released_cores if d.released_cores is None else d.released_cores,
            released_memory=self.released_memory if d.released_memory is None else d.released_memory,
            throttled_memory=self.throttled_memory if d.throttled_memory is None else d.throttled_memory,
            evicted=self.evicted | {wid for wid, _ in d.evicted} if d.evicted else self.evicted,
            evicted_count=count,
        )


class Draft:
    """A feature's decision while it makes it: what it changes, read through to what was planned before."""

    __slots__ = (
        "actions", "before", "blocked", "cooldowns", "evicted", "evictions", "holds", "last_eviction", "protect",
        "quotas", "released_cores", "released_memory", "throttled_memory",
    )  # fmt: skip

    def __init__(self, before: Planned) -> None:
        self.before = before
        self.actions: list[Action] = []
        self.blocked: list[Blocked] = []
        self.cooldowns: dict[MetricDirection, int] = {}
        self.holds: dict[LeverKey, AnyHold | None] = {}
        self.quotas: dict[str, CpuMax] = {}
        # Running totals over the whole tick so far.
        self.released_cores = before.released_cores
        self.released_memory = before.released_memory
        self.throttled_memory = before.throttled_memory
        self.evictions: dict[str, PendingEviction] = {}
        self.evicted: list[tuple[str, bool]] = []
        self.last_eviction: dict[bool, float] = {}
        self.protect: ProtectState | None = None

    # --- reading through ----------------------------------------------------------

    def hold(self, kind: type[H], group: str) -> H | None:
        """The group's hold of this lever as it stands now (this draft's change, else what was planned)."""
        if self.holds:
            found = self.holds.get((kind.lever, group), _UNSET)
            if found is not _UNSET:
                return found  # type: ignore[return-value]
        groups = self.before.holds.get(kind.lever)
        return None if groups is None else groups.get(group)  # type: ignore[return-value]

    def current(self, kind: type[H]) -> dict[str, H]:
        """Every hold of this lever as it stands now, in the order they were first held."""
        out = dict(self.before.held(kind))
        for (lever, group), hold in self.holds.items():
            if lever != kind.lever:
                continue
            if hold is None:
                out.pop(group, None)
            else:
                out[group] = hold  # type: ignore[assignment]
        return out

    def throttle(self, group: str) -> HeldThrottle | None:
        # ``hold(HeldThrottle, group)`` inlined: the throttle pass asks it of every candidate it lowers.
        if self.holds:
            found = self.holds.get((HeldThrottle.lever, group), _UNSET)
            if found is not _UNSET:
                return found  # type: ignore[return-value]
        groups = self.before.holds.get(HeldThrottle.lever)
        return None if groups is None else groups.get(group)  # type: ignore[return-value]

    def memory(self, group: str) -> HeldMemory | None:
        return self.hold(HeldMemory, group)

    def quota(self, group: str) -> CpuMax | None:
        """The quota this tick lowered it to, if it did."""
        found = self.quotas.get(group) if self.quotas else None
        return found if found is not None else self.before.quotas.get(group)

    def limit(self, usage: WorkloadUsage) -> CpuMax | None:
        """A workload's CPU limit as this tick has planned it so far: the quota lowered now, else nodeguard's
        hold, else its own."""
        wid = usage.workload.id
        planned = self.quota(wid)
        if planned is not None:
            return planned
        held = self.throttle(wid)
        return held.quota if held is not None else usage.cpu_max

    def pending(self, group: str) -> bool:
        """Asked to leave (earlier or in this tick): its holds are not raised."""
        return group in self.evictions or group in self.before.evictions

    def evicted_count(self, dry: bool) -> int:
        return self.before.evicted_count[dry] + sum(1 for _, d in self.evicted if d == dry)

    def was_evicted(self, group: str) -> bool:
        return group in self.before.evicted or any(wid == group for wid, _ in self.evicted)

    def pending_evictions(self) -> dict[str, PendingEviction]:
        return {**self.before.evictions, **self.evictions}

    def last_eviction_at(self, dry: bool) -> float | None:
        return self.last_eviction.get(dry, self.before.last_eviction.get(dry))

    # --- deciding -----------------------------------------------------------------

    def act(self, action: Action) -> None:
        self.actions.append(action)

    def block(self, metric: Metric, direction: Direction, cause: Cause, detail: str) -> None:
        self.blocked.append(Blocked(metric, direction, cause, detail))

    def missing_sample(self, metric: Metric, direction: Direction) -> None:
        self.block(metric, direction, "missing-sample", f"no {metric} sample (first tick, or not available here)")

    def cool(self, metric: Metric, direction: Direction, ticks: int) -> None:
        self.cooldowns[(metric, direction)] = ticks

    def set_hold(self, hold: AnyHold) -> None:
        self.holds[(hold.lever, hold.group)] = hold

    def drop_hold(self, kind: type[AnyHold], group: str) -> None:
        self.holds[(kind.lever, group)] = None

    @staticmethod
    def _changed(total: T, before: T) -> T | None:
        return None if total == before else total

    def decision(self) -> Decision:
        if not (
            self.actions or self.blocked or self.cooldowns or self.holds or self.quotas or self.evictions
            or self.evicted or self.last_eviction or self.protect is not None
            or self.released_cores != self.before.released_cores
            or self.released_memory != self.before.released_memory
            or self.throttled_memory != self.before.throttled_memory
        ):  # fmt: skip
            return NOTHING
        return Decision(
            actions=tuple(self.actions),
            blocked=tuple(self.blocked),
            cooldowns=self.cooldowns or _EMPTY,
            holds=self.holds or _EMPTY,
            quotas=self.quotas or _EMPTY,
            released_cores=self._changed(self.released_cores, self.before.released_cores),
            released_memory=self._changed(self.released_memory, self.before.released_memory),
            throttled_memory=self._changed(self.throttled_memory, self.before.throttled_memory),
            evictions=self.evictions or _EMPTY,
            evicted=tuple(self.evicted),
            last_eviction=self.last_eviction or _EMPTY,
            protect=self.protect,
        )
