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

from nodeguard.model.samples import CpuMax
from nodeguard.model.snapshot import WorkloadUsage
from nodeguard.policy.actions import Throttle
from nodeguard.policy.ranking import Ranked
from nodeguard.policy.state import Direction, HeldThrottle
from nodeguard.policy.tick import CLOSED_CORES, Tick, fmt
from nodeguard.policy.waterlines import Waterline

MIN_QUOTA_US = 1000  # the kernel refuses a smaller cfs quota

Lowered = tuple[CpuMax, float, CpuMax]  # the new quota, the cores it releases, the limit before


def throttle(tick: Tick, line: Waterline, gap: float, ranked: Ranked) -> None:
    """Close a node metric's gap: precisely where the metric is quantified, else one step and a cool-down."""
    if line.quantified:
        _throttle_precisely(tick, line, gap, ranked)
    else:
        _throttle_one(tick, line, gap, ranked)


def _throttle_precisely(tick: Tick, line: Waterline, gap: float, ranked: Ranked) -> None:
    per_unit = tick.per_unit(line.metric)
    # This tick's earlier throttles (another CPU metric) already count. Aim a
    # margin under the waterline, so measurement noise does not re-trigger;
    # and close what the waiting work will take of the CPU freed.
    remaining = gap / per_unit + tick.margin - tick.released_cores + tick.absorbing()
    for usage in ranked:
        if remaining < CLOSED_CORES:
            return
        lowered = lower(tick, usage, want=remaining)
        if lowered is not None:
            emit_throttle(tick, line, usage, lowered, gap_before=remaining * per_unit, per_unit=per_unit)
            remaining -= lowered[1]
    if remaining >= CLOSED_CORES:
        detail = f"{fmt(remaining * per_unit)} of the gap stays open: no candidate can release more"
        tick.block(line.metric, Direction.THROTTLE, "exhausted", detail + tick.holding_note())


def _throttle_one(tick: Tick, line: Waterline, gap: float, ranked: Ranked) -> None:
    fraction = tick.guard.closed_loop_step_percent / 100.0
    for usage in ranked:
        lowered = lower(tick, usage, fraction=fraction)
        if lowered is not None:
            emit_throttle(tick, line, usage, lowered, gap_before=gap, per_unit=None)
            tick.cooldowns[(line.metric, Direction.THROTTLE)] = tick.guard.cooldown_ticks
            return
    tick.block(line.metric, Direction.THROTTLE, "exhausted", "no candidate can release more" + tick.holding_note())


def lower(tick: Tick, usage: WorkloadUsage, want: float = 0.0, fraction: float = 0.0) -> Lowered | None:
    """Lower by ``want`` cores or ``fraction`` of the usage, at least minChange, down to the floor.

    Returns the new quota, the cores it releases and the limit before; None
    when the workload is at its floor already.
    """
    own, cores = usage.cpu_max, usage.cores
    if own is None or cores is None:
        return None  # no cpu controller: nothing to throttle with
    # Its demand: what it used and what it waited for (counted in absorbing()); a
    # workload starved by the others still takes what a throttle frees.
    used = cores + (tick.unmet(usage) if want and usage.starved_cores else 0.0)
    guard = tick.guard
    request = usage.workload.cpu_request_cores or 0.0
    if used - guard.min_quota_cores < CLOSED_CORES or used - request < CLOSED_CORES:
        return None  # at its floor: the common case on a busy node, so decided before any lookup
    wid = usage.workload.id
    held = tick.throttles.get(wid)
    current = tick.planned.get(wid)
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
    target = used - min(room, max(want, used * fraction, tick.min_change))
    quota_us = max(round(target * period), math.ceil(floor * period))
    release = used - quota_us / period
    if release <= 0:
        return None
    return CpuMax(quota_us, period), release, current


def emit_throttle(
    tick: Tick,
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
    held = tick.throttles.get(workload.id)
    original = held.original if held is not None else usage.cpu_max
    assert original is not None  # lower() checked
    dry = tick.dry(line)
    how = how or ("precisely" if per_unit is not None else "one step (closed loop)")
    tick.actions.append(
        Throttle(
            workload=workload,
            metric=line.metric,
            reason=f"{line.metric} past {fmt(line.threshold)} ({line.objective}): throttle {how}",
            gap_before=gap_before,
            predicted_release=None if per_unit is None else release * per_unit,
            release_cores=release,
            quota=quota,
            previous=previous,
            original=original,
            dry_run=dry,
        )
    )
    # Its demand as it was before this throttle: the new limit caps the wait that counts.
    demand = held.demand_cores if held is not None else tick.demand(usage)
    tick.planned[workload.id] = quota
    tick.released_cores += release
    if not dry:
        tick.throttles[workload.id] = HeldThrottle(
            workload_id=workload.id,
            original=original,
            quota=quota,
            reasons=(held.reasons if held is not None else frozenset()) | {line.metric},
            since=held.since if held is not None else tick.now,
            demand_cores=demand,
        )
