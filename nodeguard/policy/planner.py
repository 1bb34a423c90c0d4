"""The precise planner: (snapshot, state, settings) -> Plan, with no side effects.

One tick, in order (each feature's module says how it decides):

1. Throttle (decrease fast; policy.throttle): per throttle waterline past for
   triggerAfter ticks, lower the sorted candidates' quotas just enough to
   close the gap, quantified lines first; the protected_cpu_stall line takes
   its turn among them (policy.protect, policy.protection).
2. Evict (last resort; policy.evict): incompressible metrics first, the
   fewest candidates that close what this tick's throttles and the evictions
   still terminating leave open, within the eviction budget.
3. Restore (increase slowly; policy.restore) when every throttle metric is
   calm, else refill the dead-band's room to starved throttled workloads.
   Memory throttle lines lower and raise memory.high instead of quotas
   (policy.memory), with their own restore.
4. Protect's end: lowered weights back once the harm is gone and the work
   under them no longer waits for CPU, and the phase protection is left in
   (policy.protection). Its start, the reading remembered and the quotas on
   trial judged, comes before step 1.

The features read the plan's context (policy.context: readings, waterlines,
gaps, the candidates and their rankings; a calm tick computes no candidates
and reads no workload) and what was planned before them, and each returns
its decision (policy.decisions); the order below is the only place where one
sees another's.

A workload whose last write the kernel refused is held back (no candidate)
for its back-off; the daemon plans the tick again without it, so the next
candidates close the gap. A missing sample never widens an action: the metric
is blocked and the plan says so. Dry-run actions are planned like real ones but leave the throttles
held and the evictions pending as they were: nothing changed on the node.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from nodeguard.model.levers import LeverChange
from nodeguard.model.snapshot import Snapshot
from nodeguard.policy import protection
from nodeguard.policy.actions import Action, Blocked
from nodeguard.policy.context import METRIC_ORDER, PlanContext
from nodeguard.policy.decisions import Draft, Planned
from nodeguard.policy.evict import evict
from nodeguard.policy.gaps import Gaps
from nodeguard.policy.memory import is_memory, memory_protect, memory_restore, memory_throttle
from nodeguard.policy.metrics import CAPABILITIES, Metric
from nodeguard.policy.protect_state import ProtectState
from nodeguard.policy.ranking import Ranked
from nodeguard.policy.restore import refill, restore
from nodeguard.policy.selection import Choices
from nodeguard.policy.settings import GuardSettings
from nodeguard.policy.stall import ProtectedStall, ProtectedStalls
from nodeguard.policy.state import Direction, GuardState, HeldBack, PendingEviction
from nodeguard.policy.throttle import throttle
from nodeguard.policy.waterlines import ActionKind, Waterline

__all__ = ["Plan", "ProtectedStall", "plan"]


@dataclass(frozen=True, slots=True)
class Plan:
    monotonic: float
    readings: Mapping[Metric, float | None]  # every metric's node value, in its unit
    waterlines: Mapping[tuple[Metric, ActionKind], Waterline]
    gaps: Gaps
    actions: tuple[Action, ...]  # every lever change and eviction, in the order planned
    blocked: tuple[Blocked, ...]
    rankings: Mapping[tuple[str, ...], Ranked]  # the candidate orders this plan used, by comparator names
    departed: tuple[str, ...]  # held workloads that left the node: their holds are given back
    expired: tuple[PendingEviction, ...]  # evictions that outlived evictions.terminationTimeoutSeconds
    held_back: tuple[HeldBack, ...]  # groups left out: their last write was refused
    stalls: ProtectedStalls  # the protected workloads' stalls, worked out when first read (``protected``)
    workloads: int
    candidates: int | None  # None when no action needed them
    state: GuardState  # for the next tick
    choices: Choices | None = None  # every workload's role and the rule behind it (policy.selection), read lazily

    @property
    def protected(self) -> tuple[ProtectedStall, ...]:
        """Each protected workload's CPU stall (protected_cpu_stall)."""
        return self.stalls.report()

    @property
    def changes(self) -> tuple[LeverChange, ...]:
        """The lever changes, in the order planned."""
        return tuple(a for a in self.actions if isinstance(a, LeverChange))

    @property
    def protection(self) -> ProtectState:
        return self.state.protect


def plan(snapshot: Snapshot, state: GuardState, guard: GuardSettings) -> Plan:
    """Decide this tick's actions; the returned plan carries the state for the next tick."""
    ctx = PlanContext(snapshot, state, guard)
    planned = Planned(holds=ctx.holds, protect=state.protect, evictions=ctx.evictions,
                      last_eviction=state.last_eviction, cooldowns=ctx.cooldowns)  # fmt: skip
    planned = planned.then(protection.begin(ctx, planned))
    lines = sorted(ctx.lines.values(), key=lambda w: (not w.quantified, METRIC_ORDER[w.metric]))
    stall_acted = False
    for line in lines:
        if line.action != "throttle":
            continue
        ready = Draft(planned)
        gap = ctx.gap_to_close(line, Direction.THROTTLE, ready)
        planned = planned.then(ready.decision())
        if gap is None:
            continue
        ranked = ctx.ranked(line.sort_by)
        if line.metric is Metric.PROTECTED_MEMORY_STALL:
            planned = planned.then(memory_protect(ctx, planned, line, gap, ranked))
        elif CAPABILITIES[line.metric].protected:
            planned = planned.then(protection.act(ctx, planned, line, gap, ranked))
            stall_acted = True
        elif is_memory(line):
            planned = planned.then(memory_throttle(ctx, planned, line, gap, ranked))
        else:
            planned = planned.then(throttle(ctx, planned, line, gap, ranked))
    # Incompressible first: memory cannot wait for CPU to be released.
    for line in sorted(lines, key=lambda w: CAPABILITIES[w.metric].compressible):
        if line.action == "evict":
            planned = planned.then(evict(ctx, planned, line))
    throttle_lines = [line for line in lines if line.action == "throttle" and not is_memory(line)]
    restored, calm = restore(ctx, planned, throttle_lines)
    planned = planned.then(restored)
    if not calm:
        planned = planned.then(refill(ctx, planned, throttle_lines))
    memory_lines = [line for line in lines if line.action == "throttle" and is_memory(line)]
    planned = planned.then(memory_restore(ctx, planned, memory_lines))
    planned = planned.then(protection.end(ctx, planned, stall_acted))
    new_state = GuardState(
        streaks=ctx.streaks,
        cooldowns=planned.cooldowns,
        holds=planned.holds,
        evictions=planned.evictions,
        last_eviction=planned.last_eviction,
        held_back=ctx.held_back,
        protect=planned.protect,
    )
    return Plan(
        monotonic=ctx.now,
        readings=ctx.readings,
        waterlines=ctx.lines,
        gaps=ctx.gaps,
        actions=planned.actions,
        blocked=planned.blocked,
        rankings=ctx.rankings,
        departed=ctx.departed,
        expired=ctx.expired,
        held_back=tuple(ctx.held_back[wid] for wid in sorted(ctx.holding)),
        stalls=ctx.stalls,
        workloads=len(ctx.workloads),
        candidates=ctx.candidate_count(),
        state=new_state,
        choices=ctx.choices,
    )
