"""Protection's levers on the tick: the phase machine's steps (policy.protect) turned into weights and quotas.

Three points of planner.plan(), in its order: ``begin`` (remember the reading,
judge the quotas on trial, give futile ones back) before any line, ``lever``
at the stall objective's line among the throttle lines (weights to lower, a
wait, or quotas that make room), and ``end`` after restore and refill
(lowered weights back). The order is the trace's: a futile trial's restores
come before this tick's throttles, a weight held for contention is the last
thing blocked.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

from nodeguard.policy.actions import Reweigh
from nodeguard.policy.metrics import Metric
from nodeguard.policy.protect import (
    CONTENDED_CORES,
    ProtectState,
    Seen,
    judge,
    observe,
    on_trial,
    step,
    weighed,
    weights_may_return,
    without_weights,
)
from nodeguard.policy.ranking import Ranked
from nodeguard.policy.restore import raise_quotas
from nodeguard.policy.stall import competing_demand, competing_group, covers
from nodeguard.policy.state import Direction
from nodeguard.policy.throttle import emit_throttle, lower
from nodeguard.policy.tick import CLOSED_CORES, Tick, fmt
from nodeguard.policy.waterlines import Waterline

STALL = Metric.PROTECTED_CPU_STALL
# A candidate using less CPU than this does no harm to make room from.
ACTIVE_CORES = 0.01


class Protection:
    """Protection's state through one tick, and the reweighs it plans."""

    def __init__(self, tick: Tick) -> None:
        self.tick = tick
        self.tuning = tick.guard.protect
        self.state = ProtectState.of(tick.state)
        self.reweighs: list[Reweigh] = []

    def begin(self) -> None:
        """Remember this tick's reading; one more tick of the quotas' trial, and give them back if futile."""
        tick = self.tick
        line = tick.stall_line
        if line is not None:
            self.state = observe(self.state, tick.readings[STALL], line.threshold, tick.now, self.tuning)
        if self.state.trial is None:
            return
        # Quotas held for the stall alone: one a node waterline also holds is that line's to give back.
        held = {wid for wid, h in tick.throttles.items() if h.reasons == {STALL}}
        stall = tick.readings[STALL] if held else None
        self.state, futile = judge(self.state, bool(held), stall, tick.now, self.tuning)
        if futile is None:
            return
        tick.block(STALL, Direction.THROTTLE, "futile", futile.detail())
        raise_quotas(tick, math.inf, [], only=held, why="the quotas did not cut the protected stall")

    def lever(self, line: Waterline, gap: float, ranked: Ranked) -> None:
        """Act for a stall past its target: the phase machine says which lever, or why quotas wait."""
        tick = self.tick
        weights = tick.guard.protect_lever == "weight"
        seen = Seen(
            now=tick.now,
            stall=tick.readings[STALL],
            streak=tick.streaks.get((STALL, Direction.THROTTLE), 0),
            tick_seconds=tick.snapshot.interval or 1.0,
            weights=weights,
            lowerable=self._lowerable(ranked) if weights else {},
            dry_run=tick.dry(line),
        )
        decided = step(self.state, seen, self.tuning)
        self.state = decided.state
        if decided.lower:
            self._lower_weights(line, decided.lower, seen)
        elif decided.wait is not None:
            cause, detail = decided.wait
            tick.block(STALL, Direction.THROTTLE, cause, detail)
        elif self._make_room(line, gap, ranked) and weights:
            self.state = on_trial(self.state, tick.now)

    def end(self) -> None:
        """Put a lowered weight back once no protected workload has been harmed for weightHoldSeconds and the
        work under it has not waited for CPU the node does not have for quietTicks in a row (while it does, the
        weight is what keeps the harm away); at once where no candidate is left under it, and when no
        protected_cpu_stall objective is left."""
        if not self.state.lowered:
            return
        tick = self.tick
        line = tick.stall_line
        value = tick.readings[STALL]
        below = line is not None and value is not None and line.restore_below is not None and value < line.restore_below
        calm = line is not None and weights_may_return(self.state, below, tick.now, self.tuning)
        candidates = [u.workload.id for u in tick.candidates()]
        idle = tick.idle_cores()
        under = {group: tuple(wid for wid in candidates if covers(group, wid)) for group in self.state.lowered}
        demands = {g: competing_demand([tick.workloads[wid] for wid in ids], idle) for g, ids in under.items() if ids}
        self.state = weighed(self.state, demands)
        back: set[str] = set()
        for group in sorted(self.state.lowered):
            if line is not None and under[group] and not calm:
                continue
            quiet = self.state.lowered[group].quiet_ticks
            if line is not None and under[group] and quiet < self.tuning.quiet_ticks:
                # Back now, the harm would be back with it: the weight is why it is absent.
                wanted = demands[group]
                detail = (
                    f"{group}: the demand of its work is not known yet"
                    if wanted is None
                    else f"{group}: its work still waits for {fmt(wanted)} cores past the idle CPU"
                    if wanted >= CONTENDED_CORES
                    else f"{group}: its work quiet {quiet}/{self.tuning.quiet_ticks} ticks"
                )
                tick.block(STALL, Direction.RESTORE, "contended", detail)
                continue
            why = (
                "no protected_cpu_stall objective"
                if line is None
                else "no candidate left under it"
                if not under[group]
                else f"no protected workload harmed for {self.tuning.weight_hold_seconds:g}s, its work quiet"
            )
            dry = tick.guard.dry_run or (line is not None and line.dry_run)
            self.reweighs.append(Reweigh(group, STALL, f"weight back: {why}", False, under[group], dry))
            if not dry:
                back.add(group)
        self.state = without_weights(self.state, back)

    def _lowerable(self, ranked: Ranked) -> dict[str, tuple[str, ...]]:
        """Every group that competes with the most stalled protected workload and holds an active candidate
        (never a group holding a protected workload), with those candidates."""
        tick = self.tick
        protected = [s.usage.workload.id for s in tick.stalls.all()]
        target = self._target()
        if target is None:
            return {}  # a what-if with nothing protected on the node: nobody to weigh against
        groups: dict[str, list[str]] = {}
        for usage in ranked:
            if (usage.cores or 0.0) < ACTIVE_CORES:
                continue
            group = competing_group(usage.workload.id, target)
            if group is None or group in self.state.lowered or group in tick.holding:
                continue
            if any(covers(group, p) for p in protected):
                continue
            groups.setdefault(group, []).append(usage.workload.id)
        return {group: tuple(ids) for group, ids in groups.items()}

    def _target(self) -> str | None:
        """The protected workload to weigh against: the most stalled one (any, for a what-if)."""
        harmed = self.tick.stalls.worst()
        if harmed is not None:
            return harmed.usage.workload.id
        found = self.tick.stalls.all()
        return found[0].usage.workload.id if found else None

    def _lower_weights(self, line: Waterline, groups: Mapping[str, tuple[str, ...]], seen: Seen) -> None:
        tick = self.tick
        reason = (
            f"{line.metric} past {fmt(line.threshold)}% ({line.objective}): {self._target()} stalled "
            f"{fmt(seen.stall or 0.0)}%; lower the weight it competes with"
        )
        for group, ids in groups.items():
            self.reweighs.append(Reweigh(group, line.metric, reason, lower=True, workloads=ids, dry_run=seen.dry_run))
        tick.cooldowns[(line.metric, Direction.THROTTLE)] = tick.guard.cooldown_ticks

    def _make_room(self, line: Waterline, gap: float, ranked: Ranked) -> bool:
        """Make room for the most stalled protected workload: leave about as much CPU idle as it waited for
        (at least minChange), past what the other waiting work will take of it; then measure again."""
        tick = self.tick
        harmed = tick.stalls.worst()
        value = tick.readings[line.metric]
        share = harmed.share if harmed is not None else (value or 0.0) / 100.0  # a what-if names nobody
        who = f"{harmed.usage.workload.name} stalled {fmt(100.0 * share)}%" if harmed else "what-if"
        remaining = max(tick.min_change, share) + tick.absorbing() - tick.released_cores
        acted = False
        for usage in ranked:
            if remaining < CLOSED_CORES:
                break
            lowered = lower(tick, usage, want=remaining)
            if lowered is not None:
                emit_throttle(tick, line, usage, lowered, gap_before=gap, per_unit=None, how=f"to make room ({who})")
                remaining -= lowered[1]
                acted = True
        if acted:
            tick.cooldowns[(line.metric, Direction.THROTTLE)] = tick.guard.cooldown_ticks
        elif remaining >= CLOSED_CORES:
            detail = "no candidate can release more" + tick.holding_note()
            tick.block(line.metric, Direction.THROTTLE, "exhausted", detail)
        return acted
