"""What carrying out a plan did, in the policy's terms, and the guard state that follows from it.

The planner's state assumes every action happened. The executor reports what
did not (a write the kernel refused, a change the ledger could not record
first, a group that left) and what moved behind nodeguard; the folds here
turn that into the next state. Pure: no I/O, so every path is a unit test.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from nodeguard.model.samples import CpuMax
from nodeguard.policy.actions import MemoryRestore, MemoryThrottle, Restore, Reweigh, Throttle
from nodeguard.policy.metrics import Metric
from nodeguard.policy.planner import Plan
from nodeguard.policy.state import GuardState, HeldBack, HeldMemory, HeldThrottle, LoweredWeight, held_back_after

# The levers' names as the ledger keys them (nodeguard.actuators.levers; a test checks the two agree).
QUOTA, WEIGHT, MEMORY = "cpu.max", "cpu.weight", "memory.high"
LeverKey = tuple[str, str]  # (lever, group)


@dataclass(frozen=True, slots=True)
class HoldTimes:
    """How long a workload whose write was refused is held back: doubling from ``first`` to ``longest`` seconds."""

    first: float = 30.0
    longest: float = 600.0


@dataclass(frozen=True, slots=True)
class Refusal:
    """A write the kernel refused: the errno name (or the refusal's kind), the file, what it said."""

    error: str
    file: str
    detail: str


@dataclass(frozen=True, slots=True)
class Unchanged:
    """The groups of one lever whose planned change did not happen, by cause."""

    refused: Mapping[str, Refusal] = field(default_factory=dict)
    withheld: frozenset[str] = frozenset()  # not written: the ledger could not be saved first
    gone: frozenset[str] = frozenset()  # the cgroup left


@dataclass(frozen=True, slots=True)
class Moves:
    """Held values someone changed behind nodeguard: the new originals of quotas (a lowered weight keeps no
    original in the state), and the records they released."""

    originals: Mapping[str, CpuMax] = field(default_factory=dict)
    released: frozenset[LeverKey] = frozenset()
    memory_originals: Mapping[str, int | None] = field(default_factory=dict)  # memory.high, None for "max"


@dataclass(frozen=True, slots=True)
class QuotaOutcome:
    """One pass of a plan's quota changes (and, in the tick's last pass, its evictions and the drift checks)."""

    unchanged: Unchanged = Unchanged()
    written: Mapping[str, CpuMax] = field(default_factory=dict)  # the limits now in the kernel
    released: frozenset[str] = frozenset()  # records that left the ledger with the write (back at the original)
    moves: Moves = Moves()
    failed_evictions: frozenset[str] = frozenset()
    memory: Unchanged = Unchanged()  # the memory.high changes that did not happen
    memory_written: Mapping[str, int | None] = field(default_factory=dict)  # memory.high now in the kernel
    memory_released: frozenset[str] = frozenset()


@dataclass(frozen=True, slots=True)
class Held:
    """A value nodeguard holds, as its ledger records it: what a daemon adopts at start."""

    lever: str
    group: str
    reason: str  # the metric behind it
    original: CpuMax | None = None  # a quota's values (the state keeps a weight's in the ledger only)
    applied: CpuMax | None = None
    memory: tuple[int | None, int] | None = None  # memory.high's (original, applied), bytes; None for "max"


@dataclass(frozen=True, slots=True)
class AfterPass:
    state: GuardState  # the state as the kernel now is
    refused: dict[str, HeldBack]  # throttles refused in this pass: plan again without them
    written: Mapping[str, CpuMax]
    memory_written: Mapping[str, int | None] = field(default_factory=dict)


# Each lever's holds in the guard state, and the actions that lower and raise them.
_HOLDS = {QUOTA: "throttles", WEIGHT: "lowered", MEMORY: "memory"}
_ACTIONS: dict[str, tuple[type[Throttle | MemoryThrottle], type[Restore | MemoryRestore]]] = {
    QUOTA: (Throttle, Restore),
    MEMORY: (MemoryThrottle, MemoryRestore),
}


def _keep(state: GuardState, key: LeverKey, held: object | None) -> GuardState:
    """The lever's hold on the group set to ``held`` (None: no hold), e.g. what it had before a change that did not
    happen."""
    lever, group = key
    holds = dict(getattr(state, _HOLDS[lever]))
    if held is None:
        holds.pop(group, None)
    else:
        holds[group] = held
    changed: dict[str, Any] = {_HOLDS[lever]: holds}
    return replace(state, **changed)


def _without(state: GuardState, key: LeverKey) -> GuardState:
    return _keep(state, key, None)


def _hold(previous: HeldBack | None, group: str, refusal: Refusal, now: float, holds: HoldTimes) -> HeldBack:
    return held_back_after(
        previous, group, error=refusal.error, file=refusal.file, detail=refusal.detail, now=now,
        first=holds.first, longest=holds.longest,
    )  # fmt: skip


def fold_moves(state: GuardState, moves: Moves) -> GuardState:
    """A moved original replaces the throttle's; a released record is no longer held."""
    for group, original in moves.originals.items():
        held = state.throttles.get(group)
        if held is not None:
            state = replace(state, throttles={**state.throttles, group: replace(held, original=original)})
    for group, high in moves.memory_originals.items():
        hold = state.memory.get(group)
        if hold is not None:
            state = replace(state, memory={**state.memory, group: replace(hold, original=high)})
    for key in moves.released:
        state = _without(state, key)
    return state


def after_pass(plan: Plan, before: GuardState, outcome: QuotaOutcome, holds: HoldTimes = HoldTimes()) -> AfterPass:
    """The plan's state less what did not happen: a refused or withheld write keeps the throttle it had (a refused
    throttle also holds the workload back), a group that left is forgotten, failed evictions are pending no more."""
    refused: dict[str, HeldBack] = {}
    state = _lever_after(QUOTA, plan, before, plan.state, unchanged=outcome.unchanged, released=outcome.released,
                         refused=refused, holds=holds)  # fmt: skip
    state = _lever_after(MEMORY, plan, before, state, unchanged=outcome.memory, released=outcome.memory_released,
                         refused=refused, holds=holds)  # fmt: skip
    state = fold_moves(state, outcome.moves)
    for workload_id in outcome.failed_evictions:
        state = state.without_eviction(workload_id)
    state = state.with_held_back(refused).without_held_back([*outcome.written, *outcome.memory_written])
    return AfterPass(state, refused, outcome.written, outcome.memory_written)


def _lever_after(
    lever: str,
    plan: Plan,
    before: GuardState,
    state: GuardState,
    *,
    unchanged: Unchanged,
    released: Iterable[str],
    refused: dict[str, HeldBack],
    holds: HoldTimes,
) -> GuardState:
    """``after_pass`` for one lever that lowers and restores (quota, memory.high): a refused lowering also holds the
    workload back (into ``refused``)."""
    lowers, restores = _ACTIONS[lever]
    asked = {a.workload_id: a for a in plan.actions if isinstance(a, lowers | restores)}
    had = getattr(before, _HOLDS[lever])
    for group, refusal in unchanged.refused.items():
        if isinstance(asked.get(group), lowers):
            refused[group] = _hold(before.held_back.get(group), group, refusal, plan.monotonic, holds)
        state = _keep(state, (lever, group), had.get(group))
    for group in unchanged.withheld:
        state = _keep(state, (lever, group), had.get(group))
    for group in unchanged.gone:
        state = _without(state, (lever, group))
    for group in released:
        action = asked.get(group)
        if not (isinstance(action, restores) and action.full):
            state = _without(state, (lever, group))  # a step up the ledger could not record went all the way
    return state


def after_reweigh(plan: Plan, state: GuardState, unchanged: Unchanged, holds: HoldTimes = HoldTimes()) -> GuardState:
    """The plan's weights less what did not happen: a refused lowering holds the group back (the planner then goes
    on to the quota lever), a withheld one or a group that left is not lowered."""
    asked: dict[str, Reweigh] = {a.group: a for a in plan.reweighs}
    lowered = dict(state.lowered)
    for group in unchanged.gone | unchanged.withheld:
        lowered.pop(group, None)
    refused: dict[str, HeldBack] = {}
    for group, refusal in unchanged.refused.items():
        action = asked.get(group)
        if action is not None and action.lower:
            lowered.pop(group, None)
            refused[group] = _hold(state.held_back.get(group), group, refusal, plan.monotonic, holds)
    return replace(state, lowered=lowered).with_held_back(refused)


def _adopt_quota(state: GuardState, held: Held, now: float) -> GuardState:
    reasons = frozenset({Metric(held.reason)}) if held.reason in Metric._value2member_map_ else frozenset()
    assert held.original is not None and held.applied is not None, "a quota record carries its limits"
    throttle = HeldThrottle(held.group, held.original, held.applied, reasons, now)
    return replace(state, throttles={**state.throttles, held.group: throttle})


def _adopt_memory(state: GuardState, held: Held, now: float) -> GuardState:
    reasons = frozenset({Metric(held.reason)}) if held.reason in Metric._value2member_map_ else frozenset()
    assert held.memory is not None, "a memory.high record carries its values"
    original, applied = held.memory
    hold = HeldMemory(held.group, original, applied, reasons, now)
    return replace(state, memory={**state.memory, held.group: hold})


def _adopt_weight(state: GuardState, held: Held, now: float) -> GuardState:
    return replace(state, lowered={**state.lowered, held.group: LoweredWeight(held.group, now)})


# Each registered lever's records as the guard state holds them (tests/integration/test_lever_registry.py checks
# it names every lever).
ADOPTED: dict[str, Callable[[GuardState, Held, float], GuardState]] = {
    QUOTA: _adopt_quota,
    WEIGHT: _adopt_weight,
    MEMORY: _adopt_memory,
}


def adopted(records: Iterable[Held], now: float) -> GuardState:
    """The state of a daemon that keeps holding what its ledger records."""
    state = GuardState()
    for held in records:
        state = ADOPTED[held.lever](state, held, now)
    return state
