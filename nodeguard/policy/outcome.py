"""What carrying out a plan did, in the policy's terms, and the guard state that follows from it.

The planner's state assumes every change happened. The executor reports what
did not (a write the kernel refused, a change the ledger could not record
first, a group that left) and what moved behind nodeguard; the folds here
turn that into the next state, the same way for every lever. Pure: no I/O,
so every path is a unit test.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace

from nodeguard.model.levers import LeverKey
from nodeguard.policy.holds import KIND_OF, AnyHold, updated
from nodeguard.policy.planner import Plan
from nodeguard.policy.state import GuardState, HeldBack, held_back_after


@dataclass(frozen=True, slots=True)
class HoldTimes:
    """How long a group whose write was refused is held back: doubling from ``first`` to ``longest`` seconds."""

    first: float = 30.0
    longest: float = 600.0


@dataclass(frozen=True, slots=True)
class Refusal:
    """A write the kernel refused: the errno name (or the refusal's kind), the file, what it said."""

    error: str
    file: str
    detail: str


@dataclass(frozen=True, slots=True)
class Applied:
    """What became of one pass's lever changes, every lever alike."""

    written: Mapping[LeverKey, str] = field(default_factory=dict)  # the values now in the kernel
    refused: Mapping[LeverKey, Refusal] = field(default_factory=dict)
    withheld: frozenset[LeverKey] = frozenset()  # not written: the ledger could not be saved first
    gone: frozenset[LeverKey] = frozenset()  # the group left
    released: frozenset[LeverKey] = frozenset()  # records that left the ledger with the write


@dataclass(frozen=True, slots=True)
class MovedOriginals:
    """Held values someone changed behind nodeguard: the new originals (the lever's canonical text), and the
    holds they ended (the new original holds the group back as much)."""

    originals: Mapping[LeverKey, str] = field(default_factory=dict)
    released: frozenset[LeverKey] = frozenset()


@dataclass(frozen=True, slots=True)
class Kept:
    """A value the ledger says nodeguard holds, which a restarting daemon keeps holding (``onStart: adopt``)."""

    lever: str
    group: str
    reason: str  # the metric behind it
    original: str  # the lever's canonical text
    applied: str


@dataclass(frozen=True, slots=True)
class Folded:
    state: GuardState  # the state as the kernel now is
    refused: Mapping[str, HeldBack]  # groups whose lowering was refused in this pass: plan again without them


def _hold(state: GuardState, key: LeverKey) -> AnyHold | None:
    lever, group = key
    return state.holds.get(lever, {}).get(group)


def fold_moves(state: GuardState, moved: MovedOriginals) -> GuardState:
    """A moved original replaces the hold's; a released hold is no longer held."""
    changes: dict[LeverKey, AnyHold | None] = {}
    for key, original in moved.originals.items():
        hold = _hold(state, key)
        if hold is not None:
            changes[key] = hold.moved(original)
    for key in moved.released:
        changes[key] = None
    return replace(state, holds=updated(state.holds, changes)) if changes else state


def fold(plan: Plan, before: GuardState, applied: Applied, holds: HoldTimes = HoldTimes()) -> Folded:
    """The plan's state less what did not happen, for every lever: a refused or withheld write keeps the hold the
    group had before (a refused lowering also holds the group back), a group that left is forgotten, and a
    successful write ends the group's hold-back."""
    asked = {change.key: change for change in plan.changes if not change.dry_run}
    changes: dict[LeverKey, AnyHold | None] = {}
    refused: dict[str, HeldBack] = {}
    for key, refusal in applied.refused.items():
        change = asked.get(key)
        group = key[1]
        if change is not None and change.holds_back:
            refused[group] = held_back_after(
                before.held_back.get(group), group, error=refusal.error, file=refusal.file,
                detail=refusal.detail, now=plan.monotonic, first=holds.first, longest=holds.longest,
            )  # fmt: skip
        changes[key] = _hold(before, key)
    for key in applied.withheld:
        changes[key] = _hold(before, key)
    for key in applied.gone:
        changes[key] = None
    for key in applied.released:
        change = asked.get(key)
        if change is None or not change.release:
            changes[key] = None  # a step up the ledger could not record went all the way
    state = plan.state
    if changes:
        state = replace(state, holds=updated(state.holds, changes))
    state = state.with_held_back(refused).without_held_back(group for _, group in applied.written)
    return Folded(state, refused)


def without_failed_evictions(state: GuardState, failed: Iterable[str]) -> GuardState:
    """Evictions that did not go through are pending no more: their workloads count again."""
    for workload_id in failed:
        state = state.without_eviction(workload_id)
    return state


def adopted(records: Iterable[Kept], now: float) -> GuardState:
    """The state of a daemon that keeps holding what its ledger records."""
    holds = [
        KIND_OF[kept.lever].adopted(kept.group, kept.original, kept.applied, kept.reason, now)
        for kept in records
        if kept.lever in KIND_OF
    ]
    return GuardState.holding(*holds)
