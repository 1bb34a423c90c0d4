"""Restore and refill: raise held quotas again, slowly.

Restore (increase slowly): only when no throttle waterline is past and every
throttle metric has been below its restore waterline for restoreAfter ticks;
the most important throttled workload first, quotas raised by at most
guard.restoreStepPercent of the node per tick in all and by no more than the
throttle-up gap, steps under guard.minChangePercent skipped. A workload is
released (its exact original limit written back, possibly unlimited) once the
step reaches its original limit, the node's cores, or the demand it had when
first throttled, whichever is lowest. With a non-quantified throttle metric
configured, restores go one workload per tick and cool down, like its
throttles.

Refill: between the restore waterline and the waterline nothing is restored
(the dead-band), but where the node has been more than
guard.minChangePercent under its aim (the waterline less the margin) for
triggerAfter ticks, throttled workloads that are starved (their threads never
slept: they would use it) get the room back towards the aim, half of what is
left a tick (within restoreStepPercent) and most important first, so a
throttle that overshot does not waste the node. The margin is what keeps
noise around the aim under the waterline.

``raise_quotas`` is shared with protection, which gives back quotas that did
not cut the stall.
"""

from __future__ import annotations

import math
from collections.abc import Sequence, Set
from dataclasses import replace

from nodeguard.model.samples import CpuMax
from nodeguard.model.snapshot import WorkloadUsage
from nodeguard.policy.actions import Restore
from nodeguard.policy.metrics import CAPABILITIES, Metric
from nodeguard.policy.ranking import GENERAL_SORTER
from nodeguard.policy.state import Direction, HeldThrottle
from nodeguard.policy.tick import CLOSED_CORES, Tick, first_reason, fmt
from nodeguard.policy.waterlines import Waterline


def restore(tick: Tick, lines: Sequence[Waterline]) -> bool:
    """Raise held quotas when the node is calm; False when it is not (nothing raised)."""
    if not tick.held_before:
        return False
    # Quotas wait for the CPU lines given here; memory lines hold memory.high (policy.memory), not quotas.
    past = [metric for metric in tick.gaps.throttle_down if metric in {line.metric for line in lines}]
    for metric in past:
        tick.block(metric, Direction.RESTORE, "throttling", f"{metric} is past its waterline")
    if past:
        return False
    reasons = frozenset().union(*(h.reasons for h in tick.throttles.values()))
    budget = tick.guard.restore_step_percent / 100.0 * tick.node.cpus
    closed_loop: list[Metric] = []
    paced: list[Metric] = []
    for line in lines:
        if not _calm(tick, line, reasons):
            return False
        up = tick.gaps.throttle_up.get(line.metric)
        if up is None:
            continue  # no sample, and nothing held for this metric
        if line.quantified:
            budget = min(budget, up / tick.per_unit(line.metric))
        elif CAPABILITIES[line.metric].protected:
            paced.append(line.metric)  # a step across the throttles, then measure the harm again
        else:
            closed_loop.append(line.metric)
    if raise_quotas(tick, budget, closed_loop):
        for metric in paced:
            tick.cooldowns[(metric, Direction.RESTORE)] = tick.guard.cooldown_ticks
    return True


def refill(tick: Tick, lines: Sequence[Waterline]) -> None:
    """In the dead-band: give starved throttled workloads the room left under the aim, a step at a time."""
    if not tick.throttles or tick.gaps.throttle_down or not lines:
        return
    room = math.inf
    for line in lines:
        value = tick.readings[line.metric]
        if not line.quantified or value is None:
            return  # a closed-loop metric (or no reading) cannot say how much room there is
        # Confirmed like a throttle (triggerAfter), not like a restore: this is a measured overshoot of
        # this guard's own throttles, and every tick of it wastes the node.
        if tick.streaks.get((line.metric, Direction.REFILL), 0) < line.trigger_after:
            return
        room = min(room, tick.room(line, value))
    if room < tick.min_change:
        return
    # Half the room a tick: it closes in on the aim from below, and a reading that noise pushed down
    # does not send the node over the waterline the next tick.
    budget = min(room / 2.0, tick.guard.restore_step_percent / 100.0 * tick.node.cpus)
    starved = {wid for wid, u in tick.workloads.items() if (u.starved_cores or 0.0) >= CLOSED_CORES}
    raise_quotas(tick, budget, [], only=starved, refill=True)


def _calm(tick: Tick, line: Waterline, reasons: frozenset[Metric]) -> bool:
    """May quotas rise as far as this throttle metric is concerned?"""
    metric = line.metric
    value = tick.readings[metric]
    if value is None:
        if metric in reasons:
            tick.missing_sample(metric, Direction.RESTORE)
            return False
        return True
    assert line.restore_below is not None  # config: a throttle objective has restoreBelow
    if metric not in tick.gaps.throttle_up:
        detail = f"{fmt(value)} is not below the restore waterline {fmt(line.restore_below)}"
        tick.block(metric, Direction.RESTORE, "dead-band", detail)
        return False
    key = (metric, Direction.RESTORE)
    streak = tick.streaks.get(key, 0)
    if streak < line.restore_after:
        tick.block(
            metric, Direction.RESTORE, "confirming", f"below the restore waterline {streak}/{line.restore_after} ticks"
        )
        return False
    if key in tick.cooling:
        tick.block(metric, Direction.RESTORE, "cooldown", "measuring the effect of the last restore")
        return False
    return True


def raise_quotas(
    tick: Tick,
    budget: float,
    closed_loop: Sequence[Metric],
    *,
    only: Set[str] | None = None,
    refill: bool = False,
    why: str | None = None,
) -> bool:
    """Raise held quotas within ``budget`` cores, most important first; whether any was raised."""
    held = [
        tick.workloads[wid] for wid in tick.throttles if wid not in tick.evictions and (only is None or wid in only)
    ]
    spent = 0.0
    emitted = False
    # Most important first: the reverse of the order in which they were picked.
    for usage in reversed(GENERAL_SORTER.sort(held)):
        throttle = tick.throttles[usage.workload.id]
        quota = throttle.quota
        current = quota.quota_us / quota.period_us if quota.quota_us is not None else math.inf
        ceiling = min(throttle.original.cores or math.inf, float(tick.node.cpus))
        # Above what it used before the throttle, a higher quota is not expected to add usage. Not so for a
        # refill: it raises starved work, whose demand is more than it showed, by exactly the room.
        if throttle.demand_cores is not None and not refill:
            ceiling = min(ceiling, throttle.demand_cores)
        left = budget - spent
        if ceiling - current <= left:
            step, new, full = max(0.0, ceiling - current), throttle.original, True
        elif left >= tick.min_change and left > 0:
            period = quota.period_us
            step, full = left, False
            new = CpuMax(round((current + left) * period), period)
        else:
            if spent == 0 and not refill:
                detail = f"a step of {fmt(left)} cores is under minChangePercent"
                tick.block(first_reason(throttle.reasons), Direction.RESTORE, "step-too-small", detail)
            return emitted
        spent += step
        emitted = True
        because = why or (
            "room left under the waterline, and it is starved" if refill else "node calm on every throttle metric"
        )
        _emit_restore(tick, usage, throttle, new, step=step, full=full, spent=spent, why=because)
        if closed_loop:
            for metric in closed_loop:
                tick.cooldowns[(metric, Direction.RESTORE)] = tick.guard.cooldown_ticks
            return True  # closed loop: one workload, then measure again
    return emitted


def _emit_restore(
    tick: Tick,
    usage: WorkloadUsage,
    throttle: HeldThrottle,
    new: CpuMax,
    *,
    step: float,
    full: bool,
    spent: float,
    why: str,
) -> None:
    metric = first_reason(throttle.reasons)
    up = tick.gaps.throttle_up.get(metric)
    quantified = CAPABILITIES[metric].throttle_quantified
    per_unit = tick.per_unit(metric) if quantified else None
    gap_before = up if up is None or per_unit is None else up - (spent - step) * per_unit
    dry = tick.guard.dry_run
    tick.actions.append(
        Restore(
            workload=usage.workload,
            metric=metric,
            reason=("released: back to the original limit" if full else "raised one step") + f" ({why})",
            gap_before=gap_before,
            predicted_release=None if per_unit is None else -step * per_unit,
            quota=new,
            previous=throttle.quota,
            original=throttle.original,
            full=full,
            dry_run=dry,
        )
    )
    if dry:
        return
    if full:
        del tick.throttles[usage.workload.id]
    else:
        tick.throttles[usage.workload.id] = replace(throttle, quota=new)
