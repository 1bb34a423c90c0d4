"""Evict (last resort): close an evict waterline's gap with the fewest candidates, within the eviction budget.

planner.plan() takes incompressible metrics first: memory cannot wait for CPU
to be released. The gap left after this tick's throttles and the evictions
still terminating is closed by the fewest candidates; a non-quantified metric
evicts one workload and measures again once it is gone.
"""

from __future__ import annotations

from nodeguard.model.snapshot import WorkloadUsage
from nodeguard.policy.actions import Evict
from nodeguard.policy.context import PlanContext, fmt
from nodeguard.policy.decisions import Decision, Draft, Planned
from nodeguard.policy.metrics import CAPABILITIES, Resource
from nodeguard.policy.ranking import Ranked
from nodeguard.policy.state import Direction, PendingEviction
from nodeguard.policy.waterlines import Waterline


def evict(ctx: PlanContext, before: Planned, line: Waterline) -> Decision:
    draft = Draft(before)
    metric = line.metric
    gap = ctx.gap_to_close(line, Direction.EVICT, draft)
    if gap is None:
        return draft.decision()
    dry = ctx.dry(line)
    budget = ctx.guard.evictions
    last = draft.last_eviction_at(dry)
    if draft.evicted_count(dry) == 0 and last is not None and ctx.now - last < budget.min_interval_seconds:
        wait = budget.min_interval_seconds - (ctx.now - last)
        draft.block(metric, Direction.EVICT, "eviction-budget", f"next eviction round in {wait:.0f}s")
        return draft.decision()
    if draft.evicted_count(dry) >= budget.max_per_tick:
        draft.block(metric, Direction.EVICT, "eviction-budget", f"maxPerTick ({budget.max_per_tick}) reached")
        return draft.decision()
    ranked = ctx.ranked(line.sort_by)
    if line.quantified:
        _evict_precisely(ctx, draft, line, gap, ranked, dry=dry)
    else:
        _evict_one(ctx, draft, line, gap, ranked, dry=dry)
    return draft.decision()


def _expected_cores(draft: Draft, usage: WorkloadUsage) -> float:
    cores = usage.cores or 0.0
    planned = draft.quota(usage.workload.id)
    if planned is None or planned.quota_us is None:
        return cores
    return min(cores, planned.quota_us / planned.period_us)


def _evict_precisely(ctx: PlanContext, draft: Draft, line: Waterline, gap: float, ranked: Ranked, *, dry: bool) -> None:
    metric = line.metric
    per_unit = ctx.per_unit(metric)
    memory = CAPABILITIES[metric].resource is Resource.MEMORY
    pending_evictions = draft.pending_evictions()
    pending: float
    if memory:
        pending = sum(p.memory_bytes for p in pending_evictions.values()) + draft.released_memory
    else:
        pending = sum(p.cores for p in pending_evictions.values()) + draft.released_cores
    remaining = gap - pending * per_unit
    if remaining <= 0:
        if pending_evictions:
            ids = ", ".join(sorted(pending_evictions))
            draft.block(metric, Direction.EVICT, "eviction-pending", f"still terminating, releasing enough: {ids}")
        return
    limit = ctx.guard.evictions.max_per_tick
    for usage in ranked:
        if remaining <= 0:
            return
        if draft.evicted_count(dry) >= limit:
            detail = f"{fmt(remaining)} of the gap stays open: maxPerTick ({limit}) reached"
            draft.block(metric, Direction.EVICT, "eviction-budget", detail)
            return
        if draft.was_evicted(usage.workload.id):
            continue
        amount = (usage.memory_bytes or 0) if memory else _expected_cores(draft, usage)
        release = amount * per_unit
        if release <= 0:
            continue
        _emit_evict(ctx, draft, line, usage, gap_before=remaining, release=release, dry=dry)
        remaining -= release
    if remaining > 0:
        detail = f"{fmt(remaining)} of the gap stays open: no candidate left"
        draft.block(metric, Direction.EVICT, "exhausted", detail)


def _evict_one(ctx: PlanContext, draft: Draft, line: Waterline, gap: float, ranked: Ranked, *, dry: bool) -> None:
    metric = line.metric
    pending = draft.pending_evictions()
    asked = {wid for wid, _ in draft.evicted} | draft.before.evicted
    if pending or asked:
        ids = ", ".join(sorted(pending.keys() | asked))
        draft.block(metric, Direction.EVICT, "eviction-pending", f"measuring again once gone: {ids}")
        return
    if not ranked:
        draft.block(metric, Direction.EVICT, "exhausted", "no candidate left")
        return
    _emit_evict(ctx, draft, line, ranked[0], gap_before=gap, release=None, dry=dry)
    draft.cool(metric, Direction.EVICT, ctx.guard.cooldown_ticks)


def _emit_evict(
    ctx: PlanContext,
    draft: Draft,
    line: Waterline,
    usage: WorkloadUsage,
    *,
    gap_before: float,
    release: float | None,
    dry: bool,
) -> None:
    workload = usage.workload
    cores = _expected_cores(draft, usage)
    memory = usage.memory_bytes or 0
    how = "fewest workloads that close the gap" if release is not None else "one workload (closed loop)"
    draft.act(
        Evict(
            workload=workload,
            metric=line.metric,
            reason=f"{line.metric} past {fmt(line.threshold)} ({line.objective}): evict {how}",
            gap_before=gap_before,
            predicted_release=release,
            cores=cores,
            memory_bytes=memory,
            dry_run=dry,
        )
    )
    if draft.evicted_count(dry) == 0:
        draft.last_eviction[dry] = ctx.now
    draft.evicted.append((workload.id, dry))
    draft.released_cores += cores
    draft.released_memory += memory
    if not dry:
        draft.evictions[workload.id] = PendingEviction(workload.id, line.metric, cores, memory, ctx.now)
