"""Throttle (decrease fast): lower candidates' cpu.max quotas while a throttle waterline is past.

Per throttle waterline past for triggerAfter ticks, walk the sorted
candidates and lower each one's quota just enough to close what is left of
the gap, never below its floor (its CPU request, and guard.minQuotaCores),
and by at least guard.minChangePercent of the node where it has that much
above its floor; stop when the gap is closed. A non-quantified metric lowers
one workload by guard.closedLoopStepPercent of its usage, then cools down.
Throttling for one CPU metric counts towards the gaps of the others in the
same tick.

On a busy node, CPU freed by a throttle is taken by whatever waited to run
(batch work wants every core it can get): the gap to close grows by what the
threads that never slept waited for (``starved_cores``) beyond the node's
idle CPU, within each workload's own limit, and each candidate's release is
measured from its demand (what it used plus that wait), so one tick's
throttles hold the node under the waterline once the others have expanded.

``lower`` and ``emit_throttle`` are shared with protection's quota lever.
"""

from __future__ import annotations

import math

from nodeguard.model.levers import CPU_QUOTA, LeverChange
from nodeguard.model.samples import CpuMax
from nodeguard.model.snapshot import WorkloadUsage
from nodeguard.policy.context import PlanContext, fmt
from nodeguard.policy.decisions import Decision, Draft, Planned
from nodeguard.policy.holds import HeldThrottle, QuotaDetails
from nodeguard.policy.ranking import Ranked
from nodeguard.policy.state import Direction
from nodeguard.policy.tuning import CLOSED_CORES, MIN_QUOTA_US
from nodeguard.policy.waterlines import Waterline

Lowered = tuple[CpuMax, float, CpuMax]  # the new quota, the cores it releases, the limit before


def throttle(ctx: PlanContext, before: Planned, line: Waterline, gap: float, ranked: Ranked) -> Decision:
    """Close a node metric's gap: precisely where the metric is quantified, else one step and a cool-down."""
    draft = Draft(before)
    if line.quantified:
        _throttle_precisely(ctx, draft, line, gap, ranked)
    else:
        _throttle_one(ctx, draft, line, gap, ranked)
    return draft.decision()


def _throttle_precisely(ctx: PlanContext, draft: Draft, line: Waterline, gap: float, ranked: Ranked) -> None:
    per_unit = ctx.per_unit(line.metric)
    # This tick's earlier throttles (another CPU metric) already count. Aim a
    # margin under the waterline, so measurement noise does not re-trigger;
    # and close what the waiting work will take of the CPU freed.
    remaining = gap / per_unit + ctx.margin - draft.released_cores + ctx.absorbing()
    for usage in ranked:
        if remaining < CLOSED_CORES:
            return
        lowered = lower(ctx, draft, usage, want=remaining)
        if lowered is not None:
            emit_throttle(ctx, draft, line, usage, lowered, gap_before=remaining * per_unit, per_unit=per_unit)
            remaining -= lowered[1]
    if remaining >= CLOSED_CORES:
        detail = f"{fmt(remaining * per_unit)} of the gap stays open: no candidate can release more"
        draft.block(line.metric, Direction.THROTTLE, "exhausted", detail + ctx.holding_note())


def _throttle_one(ctx: PlanContext, draft: Draft, line: Waterline, gap: float, ranked: Ranked) -> None:
    fraction = ctx.guard.closed_loop_step_percent / 100.0
    for usage in ranked:
        lowered = lower(ctx, draft, usage, fraction=fraction)
        if lowered is not None:
            emit_throttle(ctx, draft, line, usage, lowered, gap_before=gap, per_unit=None)
            draft.cool(line.metric, Direction.THROTTLE, ctx.guard.cooldown_ticks)
            return
    draft.block(line.metric, Direction.THROTTLE, "exhausted", "no candidate can release more" + ctx.holding_note())


def lower(
    ctx: PlanContext, draft: Draft, usage: WorkloadUsage, want: float = 0.0, fraction: float = 0.0
) -> Lowered | None:
    """Lower by ``want`` cores or ``fraction`` of the usage, at least minChange, down to the floor.

    Returns the new quota, the cores it releases and the limit before; None
    when the workload is at its floor already.
    """
    own, cores = usage.cpu_max, usage.cores
    if own is None or cores is None:
        return None  # no cpu controller: nothing to throttle with
    # Its demand: what it used and what it waited for (counted in absorbing()); a
    # workload starved by the others still takes what a throttle frees.
    used = cores + (ctx.unmet(usage, draft) if want and usage.starved_cores else 0.0)
    guard = ctx.guard
    request = usage.workload.cpu_request_cores or 0.0
    if used - guard.min_quota_cores < CLOSED_CORES or used - request < CLOSED_CORES:
        return None  # at its floor: the common case on a busy node, so decided before any lookup
    wid = usage.workload.id
    held = draft.throttle(wid)
    current = draft.quota(wid)
    if current is None:
        current = held.quota if held is not None else own
    if current.quota_us is not None:
        used = min(used, current.quota_us / current.period_us)
    # The period lever: a throttle on a short period spreads the throttled work's bursts.
    period = guard.throttle_period_us or current.period_us
    floor = max(guard.min_quota_cores, request, MIN_QUOTA_US / period)
    room = used - floor
    if room < CLOSED_CORES:
        return None
    # At least minChange, so a big workload is not nudged by a sliver; a small
    # one may give all it has above its floor.
    target = used - min(room, max(want, used * fraction, ctx.min_change))
    quota_us = max(round(target * period), math.ceil(floor * period))
    release = used - quota_us / period
    if release <= 0:
        return None
    return CpuMax(quota_us, period), release, current


def emit_throttle(
    ctx: PlanContext,
    draft: Draft,
    line: Waterline,
    usage: WorkloadUsage,
    lowered: Lowered,
    *,
    gap_before: float,
    per_unit: float | None,
    how: str | None = None,
) -> None:
    quota, release, previous = lowered
    workload = usage.workload
    held = draft.throttle(workload.id)
    original = held.original if held is not None else usage.cpu_max
    assert original is not None  # lower() checked
    dry = ctx.dry(line)
    how = how or ("precisely" if per_unit is not None else "one step (closed loop)")
    draft.act(
        LeverChange(
            lever=CPU_QUOTA.name,
            group=workload.id,
            target=quota.render_v2(),
            give_back=original.render_v2(),
            release=False,
            holds_back=True,
            kind="throttle",
            metric=line.metric,
            reason=f"{line.metric} past {fmt(line.threshold)} ({line.objective}): throttle {how}",
            dry_run=dry,
            workload=workload,
            gap_before=gap_before,
            predicted_release=None if per_unit is None else release * per_unit,
            previous=previous.render_v2(),
            releases=release,
            details=QuotaDetails(quota, previous, original, release_cores=release),
        )
    )
    # Its demand as it was before this throttle: the new limit caps the wait that counts.
    demand = held.demand_cores if held is not None else ctx.demand(usage, draft)
    draft.quotas[workload.id] = quota
    draft.released_cores += release
    if not dry:
        draft.set_hold(
            HeldThrottle(
                group=workload.id,
                original=original,
                quota=quota,
                reasons=(held.reasons if held is not None else frozenset()) | {line.metric},
                since=held.since if held is not None else ctx.now,
                demand_cores=demand,
            )
        )
