"""One tick of the guard, settled in one place: sense, plan, apply, fold, plan again, evict, drift.

1. Sense: a snapshot of the node (and what Kubernetes says of its pods).
2. Originals that moved behind a hold (an in-place resize) are taken first:
   the plan keeps the hold under the new value.
3. Plan (pure), apply every lever's changes in one batch (the ledger saved
   once, before the kernel), fold what happened into the state (pure). A
   lowering the kernel refused, of any lever, holds its group back: plan
   the tick again without it, so the next candidates close the gap; what an
   earlier pass wrote is not written again. At most ``MAX_PASSES`` passes.
4. Then the plan's evictions, and last the drift: every held value someone
   reset is put back, once.

The executor is entered once per pass; everything it reports is folded by
``policy.outcome``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from nodeguard.actuators.changes import Done
from nodeguard.actuators.executor import Executor
from nodeguard.model.levers import LeverKey
from nodeguard.model.snapshot import Snapshot
from nodeguard.policy import outcome, planner
from nodeguard.policy.actions import Evict
from nodeguard.policy.outcome import HoldTimes
from nodeguard.policy.planner import Plan
from nodeguard.policy.settings import GuardSettings
from nodeguard.policy.state import GuardState
from nodeguard.policy.tuning import LONGEST_HOLD_FACTOR, MAX_PASSES
from nodeguard.sources.sensor import Sensor


def hold_times(guard: GuardSettings) -> HoldTimes:
    seconds = guard.failed_write_backoff_seconds
    return HoldTimes(seconds, LONGEST_HOLD_FACTOR * seconds)


@dataclass(frozen=True, slots=True)
class Settled:
    """A tick's outcome: its last plan, the state for the next tick, every lever change it planned and made, and
    the upkeep of its holds (holds of workloads gone given back, values put back after drift)."""

    snapshot: Snapshot
    plan: Plan
    state: GuardState
    done: list[Done] = field(default_factory=list)
    passes: int = 1
    upkeep: list[Done] = field(default_factory=list)

    @property
    def every_change(self) -> list[Done]:
        """Every value the tick wrote (what the decision history records): its planned changes, then its upkeep."""
        return [*self.done, *self.upkeep]


def sense(sensor: Sensor, follow_memory: bool, enrich: Callable[[Snapshot], Snapshot] | None) -> Snapshot:
    """The tick's snapshot; held memory.high is read until it is given back, whatever the objectives say now."""
    sensor.follow_memory(follow_memory)
    snapshot = sensor.sense()
    return snapshot if enrich is None else enrich(snapshot)  # no I/O: the cache the refresh task keeps


def settle(snapshot: Snapshot, state: GuardState, guard: GuardSettings, executor: Executor) -> Settled:
    """Plan and act on one snapshot until nothing refused is left to plan around (see the module docstring)."""
    holds = hold_times(guard)
    # A value resized behind a hold is the new original before anything is planned on it.
    start = outcome.fold_moves(state, executor.moved_originals(snapshot))
    written: dict[LeverKey, str] = {}
    done: list[Done] = []
    upkeep: list[Done] = executor.ended_holds()
    planning = start
    for passes in range(1, MAX_PASSES + 1):
        plan = planner.plan(snapshot, planning, guard)
        if passes == 1:
            upkeep.extend(executor.give_back(plan.departed))
        applied = executor.apply(plan.changes, written)
        folded = outcome.fold(plan, planning, applied.applied, holds)
        written.update(applied.applied.written)
        done.extend(applied.done)
        if not folded.refused:
            break
        planning = planning.with_held_back(folded.refused)
    executor.dry_run(plan.actions)
    executor.evict(a for a in plan.actions if isinstance(a, Evict))
    after = folded.state.without_held_back(group for _, group in written)
    after = outcome.without_failed_evictions(after, executor.failed_evictions())
    upkeep.extend(executor.reassert(snapshot, skip=written.keys()))
    if written or plan.departed:
        executor.save("after the tick's changes")
    return Settled(snapshot, plan, after, done, passes, upkeep)
