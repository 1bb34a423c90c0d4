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
triggerAfter ticks, throttled workloads that would use more (starved: their
threads never slept; or held back by their own quota this tick) get the room
back towards the aim, half of what is left a tick but at least minChangePercent
(within restoreStepPercent) and most important first, so a throttle that
overshot does not waste the node. The margin is what keeps noise around the
aim under the waterline.

``raise_quotas`` is shared with protection, which gives back quotas that did
not cut the stall.
"""

from __future__ import annotations

import math
from collections.abc import Sequence, Set
from dataclasses import replace

from nodeguard.model.levers import CPU_QUOTA, LeverChange
from nodeguard.model.samples import CpuMax
from nodeguard.model.snapshot import WorkloadUsage
from nodeguard.policy.context import PlanContext, first_reason, fmt
from nodeguard.policy.decisions import Decision, Draft, Planned
from nodeguard.policy.holds import HeldThrottle, QuotaDetails
from nodeguard.policy.metrics import CAPABILITIES, Metric
from nodeguard.policy.ranking import GENERAL_SORTER
from nodeguard.policy.state import Direction
from nodeguard.policy.tuning import CLOSED_CORES
from nodeguard.policy.waterlines import Waterline


def restore(ctx: PlanContext, before: Planned, lines: Sequence[Waterline]) -> tuple[Decision, bool]:
    """Raise held quotas when the node is calm; the decision, and whether it was calm (else refill may)."""
    draft = Draft(before)
    calm = _restore(ctx, draft, lines)
    return draft.decision(), calm


def _restore(ctx: PlanContext, draft: Draft, lines: Sequence[Waterline]) -> bool:
    if not ctx.held_before:
        return False
    # Quotas wait for the CPU lines given here; memory lines hold memory.high (policy.memory), not quotas.
    past = [metric for metric in ctx.gaps.throttle_down if metric in {line.metric for line in lines}]
    for metric in past:
        draft.block(metric, Direction.RESTORE, "throttling", f"{metric} is past its waterline")
    if past:
        return False
    reasons = frozenset().union(*(h.reasons for h in draft.current(HeldThrottle).values()))
    budget = ctx.guard.restore_step_percent / 100.0 * ctx.node.cpus
    closed_loop: list[Metric] = []
    paced: list[Metric] = []
    for line in lines:
        if not _calm(ctx, draft, line, reasons):
            return False
        up = ctx.gaps.throttle_up.get(line.metric)
        if up is None:
            continue  # no sample, and nothing held for this metric
        if line.quantified:
            budget = min(budget, up / ctx.per_unit(line.metric))
        elif CAPABILITIES[line.metric].protected:
            paced.append(line.metric)  # a step across the throttles, then measure the harm again
        else:
            closed_loop.append(line.metric)
    if raise_quotas(ctx, draft, budget, closed_loop):
        for metric in paced:
            draft.cool(metric, Direction.RESTORE, ctx.guard.cooldown_ticks)
    return True


def refill(ctx: PlanContext, before: Planned, lines: Sequence[Waterline]) -> Decision:
    """In the dead-band: give starved throttled workloads the room left under the aim, a step at a time."""
    draft = Draft(before)
    if not draft.current(HeldThrottle) or ctx.gaps.throttle_down or not lines:
        return draft.decision()
    room = math.inf
    for line in lines:
        value = ctx.readings[line.metric]
        if not line.quantified or value is None:
            return draft.decision()  # a closed-loop metric (or no reading) cannot say how much room there is
        # Confirmed like a throttle (triggerAfter), not like a restore: this is a measured overshoot of
        # this guard's own throttles, and every tick of it wastes the node.
        if ctx.streaks.get((line.metric, Direction.REFILL), 0) < line.trigger_after:
            return draft.decision()
        room = min(room, ctx.room(line, value))
    if room < ctx.min_change:
        return draft.decision()
    # Half the room a tick: it closes in on the aim from below, and a reading that noise pushed down
    # does not send the node over the waterline the next tick. Where half is under minChange, a step of
    # minChange (within the room): else the node would stay up to twice minChange under its aim.
    step = max(room / 2.0, ctx.min_change)
    budget = min(step, ctx.guard.restore_step_percent / 100.0 * ctx.node.cpus)
    raise_quotas(ctx, draft, budget, [], only=_would_use_more(ctx), refill=True)
    return draft.decision()


def _would_use_more(ctx: PlanContext) -> set[str]:
    """Workloads that would use a higher quota: starved (threads runnable the whole tick), or held back by their own
    cpu.max (a duty-cycled workload sleeps between its bursts, so never starved, yet its quota cuts every burst)."""
    return {wid for wid, u in ctx.workloads.items() if _wants(u)}


def _wants(usage: WorkloadUsage) -> str:
    """Why a higher quota would be used ('' if nothing says so)."""
    if (usage.starved_cores or 0.0) >= CLOSED_CORES:
        return "it is starved"
    # Its own cpu.max only: a container's own limit binding below the hold would leave a higher hold unused.
    if (usage.own_throttled_cores or 0.0) >= CLOSED_CORES:
        return "its quota holds it back"
    return ""


def _calm(ctx: PlanContext, draft: Draft, line: Waterline, reasons: frozenset[Metric]) -> bool:
    """May quotas rise as far as this throttle metric is concerned?"""
    metric = line.metric
    value = ctx.readings[metric]
    if value is None:
        if metric in reasons:
            draft.missing_sample(metric, Direction.RESTORE)
            return False
        return True
    assert line.restore_below is not None  # config: a throttle objective has restoreBelow
    if metric not in ctx.gaps.throttle_up:
        detail = f"{fmt(value)} is not below the restore waterline {fmt(line.restore_below)}"
        draft.block(metric, Direction.RESTORE, "dead-band", detail)
        return False
    key = (metric, Direction.RESTORE)
    streak = ctx.streaks.get(key, 0)
    if streak < line.restore_after:
        draft.block(
            metric, Direction.RESTORE, "confirming", f"below the restore waterline {streak}/{line.restore_after} ticks"
        )
        return False
    if key in ctx.cooling:
        draft.block(metric, Direction.RESTORE, "cooldown", "measuring the effect of the last restore")
        return False
    return True


def raise_quotas(
    ctx: PlanContext,
    draft: Draft,
    budget: float,
    closed_loop: Sequence[Metric],
    *,
    only: Set[str] | None = None,
    refill: bool = False,
    why: str | None = None,
) -> bool:
    """Raise held quotas within ``budget`` cores, most important first; whether any was raised."""
    throttles = draft.current(HeldThrottle)
    held = [ctx.workloads[wid] for wid in throttles if not draft.pending(wid) and (only is None or wid in only)]
    spent = 0.0
    emitted = False
    # Most important first: the reverse of the order in which they were picked.
    for usage in reversed(GENERAL_SORTER.sort(held)):
        throttle = throttles[usage.workload.id]
        quota = throttle.quota
        current = quota.quota_us / quota.period_us if quota.quota_us is not None else math.inf
        ceiling = min(throttle.original.cores or math.inf, float(ctx.node.cpus))
        # Above what it used before the throttle, a higher quota is not expected to add usage. Not so for a
        # refill: it raises starved work, whose demand is more than it showed, by exactly the room.
        if throttle.demand_cores is not None and not refill:
            ceiling = min(ceiling, throttle.demand_cores)
        left = budget - spent
        if ceiling - current <= left:
            step, new, full = max(0.0, ceiling - current), throttle.original, True
        elif left >= ctx.min_change and left > 0:
            period = quota.period_us
            step, full = left, False
            new = CpuMax(round((current + left) * period), period)
        else:
            if spent == 0 and not refill:
                detail = f"a step of {fmt(left)} cores is under minChangePercent"
                draft.block(first_reason(throttle.reasons), Direction.RESTORE, "step-too-small", detail)
            return emitted
        spent += step
        emitted = True
        because = why or (
            f"room left under the waterline, and {_wants(usage)}" if refill else "node calm on every throttle metric"
        )
        _emit_restore(ctx, draft, usage, throttle, new, step=step, full=full, spent=spent, why=because)
        if closed_loop:
            for metric in closed_loop:
                draft.cool(metric, Direction.RESTORE, ctx.guard.cooldown_ticks)
            return True  # closed loop: one workload, then measure again
    return emitted


def _emit_restore(
    ctx: PlanContext,
    draft: Draft,
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
    up = ctx.gaps.throttle_up.get(metric)
    quantified = CAPABILITIES[metric].throttle_quantified
    per_unit = ctx.per_unit(metric) if quantified else None
    gap_before = up if up is None or per_unit is None else up - (spent - step) * per_unit
    dry = ctx.guard.dry_run
    draft.act(
        LeverChange(
            lever=CPU_QUOTA.name,
            group=usage.workload.id,
            target=new.render_v2(),
            give_back=throttle.original.render_v2(),
            release=full,
            holds_back=False,
            kind="restore",
            metric=metric,
            reason=("released: back to the original limit" if full else "raised one step") + f" ({why})",
            dry_run=dry,
            workload=usage.workload,
            gap_before=gap_before,
            predicted_release=None if per_unit is None else -step * per_unit,
            previous=throttle.quota.render_v2(),
            details=QuotaDetails(new, throttle.quota, throttle.original, full=full),
        )
    )
    if dry:
        return
    if full:
        draft.drop_hold(HeldThrottle, usage.workload.id)
    else:
        draft.set_hold(replace(throttle, quota=new))
