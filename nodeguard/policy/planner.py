"""The precise planner: (snapshot, state, settings) -> Plan, with no side effects.

One tick, in order (each feature's module says how it decides):

1. Throttle (decrease fast; policy.throttle): per throttle waterline past for
   triggerAfter ticks, lower the sorted candidates' quotas just enough to
   close the gap, quantified lines first; the protected_cpu_stall line takes
   its turn among them (policy.protect, policy.protect_levers).
2. Evict (last resort; policy.evict): incompressible metrics first, the
   fewest candidates that close what this tick's throttles and the evictions
   still terminating leave open, within the eviction budget.
3. Restore (increase slowly; policy.restore) when every throttle metric is
   calm, else refill the dead-band's room to starved throttled workloads.
   Memory throttle lines lower and raise memory.high instead of quotas
   (policy.memory), with their own restore.
4. Protect's end: lowered weights back once the harm is gone and the work
   under them no longer waits for CPU (policy.protect_levers). Its start, the
   reading remembered and the quotas on trial judged, comes before step 1.

The features share the tick context (policy.tick): readings, waterlines,
gaps, the candidates and their rankings, and what this tick has planned and
released so far; a calm tick computes no candidates and reads no workload.

A workload whose last write the kernel refused is held back (no candidate)
for its back-off; the daemon plans the tick again without it, so the next
candidates close the gap. A missing sample never widens an action: the metric
is blocked and the plan says so. Dry-run actions are planned like real ones but leave the throttles
held and the evictions pending as they were: nothing changed on the node.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from nodeguard.model.snapshot import Snapshot
from nodeguard.policy.actions import Action, Blocked, Reweigh
from nodeguard.policy.evict import evict
from nodeguard.policy.gaps import Gaps
from nodeguard.policy.memory import is_memory, memory_protect, memory_restore, memory_throttle
from nodeguard.policy.metrics import CAPABILITIES, Metric
from nodeguard.policy.protect import CONTENDED_CORES
from nodeguard.policy.protect_levers import Protection
from nodeguard.policy.ranking import Ranked
from nodeguard.policy.restore import refill, restore
from nodeguard.policy.settings import GuardSettings, ProtectSettings
from nodeguard.policy.stall import ProtectedStall, ProtectedStalls
from nodeguard.policy.state import Direction, GuardState, HeldBack, PendingEviction
from nodeguard.policy.throttle import MIN_QUOTA_US, throttle
from nodeguard.policy.tick import CLOSED_CORES, METRIC_ORDER, Tick
from nodeguard.policy.waterlines import ActionKind, Waterline

_DEFAULTS = ProtectSettings()
# guard.protect's defaults, under the names they had here.
QUOTA_STREAK_TICKS = _DEFAULTS.streak_ticks
QUOTA_TRIAL_TICKS = _DEFAULTS.trial_ticks
QUOTA_FUTILE = _DEFAULTS.futile_share
WEIGHT_WORKING = _DEFAULTS.drain_share
WEIGHT_PATIENCE_TICKS = _DEFAULTS.drain_patience_ticks

__all__ = [
    "CLOSED_CORES",
    "CONTENDED_CORES",
    "MIN_QUOTA_US",
    "QUOTA_FUTILE",
    "QUOTA_STREAK_TICKS",
    "QUOTA_TRIAL_TICKS",
    "WEIGHT_PATIENCE_TICKS",
    "WEIGHT_WORKING",
    "Plan",
    "ProtectedStall",
    "plan",
]


@dataclass(frozen=True, slots=True)
class Plan:
    monotonic: float
    readings: Mapping[Metric, float | None]  # every metric's node value, in its unit
    waterlines: Mapping[tuple[Metric, ActionKind], Waterline]
    gaps: Gaps
    actions: tuple[Action, ...]
    blocked: tuple[Blocked, ...]
    rankings: Mapping[tuple[str, ...], Ranked]  # the candidate orders this plan used, by comparator names
    departed: tuple[str, ...]  # throttled workloads that left the node: drop them from the ledger
    expired: tuple[PendingEviction, ...]  # evictions that outlived evictions.terminationTimeoutSeconds
    held_back: tuple[HeldBack, ...]  # workloads left out as candidates: their last write was refused
    stalls: ProtectedStalls  # the protected workloads' stalls, worked out when first read (``protected``)
    reweighs: tuple[Reweigh, ...]  # CPU weights to lower or put back (protected_cpu_stall)
    workloads: int
    candidates: int | None  # None when no action needed them
    state: GuardState  # for the next tick

    @property
    def protected(self) -> tuple[ProtectedStall, ...]:
        """Each protected workload's CPU stall (protected_cpu_stall)."""
        return self.stalls.report()


def plan(snapshot: Snapshot, state: GuardState, guard: GuardSettings) -> Plan:
    """Decide this tick's actions; the returned plan carries the state for the next tick."""
    tick = Tick(snapshot, state, guard)
    protection = Protection(tick)
    protection.begin()
    lines = sorted(tick.lines.values(), key=lambda w: (not w.quantified, METRIC_ORDER[w.metric]))
    for line in lines:
        if line.action == "throttle":
            gap = tick.gap_to_close(line, Direction.THROTTLE)
            if gap is None:
                continue
            ranked = tick.ranked(line.sort_by)
            if line.metric is Metric.PROTECTED_MEMORY_STALL:
                memory_protect(tick, line, gap, ranked)
            elif CAPABILITIES[line.metric].protected:
                protection.lever(line, gap, ranked)
            elif is_memory(line):
                memory_throttle(tick, line, gap, ranked)
            else:
                throttle(tick, line, gap, ranked)
    # Incompressible first: memory cannot wait for CPU to be released.
    for line in sorted(lines, key=lambda w: CAPABILITIES[w.metric].compressible):
        if line.action == "evict":
            evict(tick, line)
    throttle_lines = [line for line in lines if line.action == "throttle" and not is_memory(line)]
    if not restore(tick, throttle_lines):
        refill(tick, throttle_lines)
    memory_restore(tick, [line for line in lines if line.action == "throttle" and is_memory(line)])
    protection.end()
    protected = protection.state
    new_state = GuardState(
        streaks=tick.streaks,
        cooldowns=tick.cooldowns,
        throttles=tick.throttles,
        memory=tick.memory,
        evictions=tick.evictions,
        last_eviction=tick.last_eviction,
        held_back=tick.held_back,
        lowered=protected.lowered,
        last_harm=protected.last_harm,
        recent_stall=protected.recent_stall,
        quota_trial=protected.trial,
        quotas_futile_until=protected.futile_until,
    )
    return Plan(
        monotonic=tick.now,
        readings=tick.readings,
        waterlines=tick.lines,
        gaps=tick.gaps,
        actions=tuple(tick.actions),
        blocked=tuple(tick.blocked),
        rankings=tick.rankings,
        departed=tick.departed,
        expired=tick.expired,
        held_back=tuple(tick.held_back[wid] for wid in sorted(tick.holding)),
        stalls=tick.stalls,
        reweighs=tuple(protection.reweighs),
        workloads=len(tick.workloads),
        candidates=tick.candidate_count(),
        state=new_state,
    )
