"""Evict (last resort): close an evict waterline's gap with the fewest candidates, within the eviction budget.

planner.plan() takes incompressible metrics first: memory cannot wait for CPU
to be released. The gap left after this tick's throttles and the evictions
still terminating is closed by the fewest candidates; a non-quantified metric
evicts one workload and measures again once it is gone.
"""

from __future__ import annotations

from nodeguard.model.snapshot import WorkloadUsage
from nodeguard.policy.actions import Evict
from nodeguard.policy.metrics import CAPABILITIES, Resource
from nodeguard.policy.ranking import Ranked
from nodeguard.policy.state import Direction, PendingEviction
from nodeguard.policy.tick import Tick, fmt
from nodeguard.policy.waterlines import Waterline


def evict(tick: Tick, line: Waterline) -> None:
    metric = line.metric
    gap = tick.gap_to_close(line, Direction.EVICT)
    if gap is None:
        return
    dry = tick.dry(line)
    budget = tick.guard.evictions
    last = tick.last_eviction.get(dry)
    if tick.evicted_count[dry] == 0 and last is not None and tick.now - last < budget.min_interval_seconds:
        wait = budget.min_interval_seconds - (tick.now - last)
        tick.block(metric, Direction.EVICT, "eviction-budget", f"next eviction round in {wait:.0f}s")
        return
    if tick.evicted_count[dry] >= budget.max_per_tick:
        tick.block(metric, Direction.EVICT, "eviction-budget", f"maxPerTick ({budget.max_per_tick}) reached")
        return
    ranked = tick.ranked(line.sort_by)
    if line.quantified:
        _evict_precisely(tick, line, gap, ranked, dry)
    else:
        _evict_one(tick, line, gap, ranked, dry)


def _expected_cores(tick: Tick, usage: WorkloadUsage) -> float:
    cores = usage.cores or 0.0
    planned = tick.planned.get(usage.workload.id)
    if planned is None or planned.quota_us is None:
        return cores
    return min(cores, planned.quota_us / planned.period_us)


def _evict_precisely(tick: Tick, line: Waterline, gap: float, ranked: Ranked, dry: bool) -> None:
    metric = line.metric
    per_unit = tick.per_unit(metric)
    memory = CAPABILITIES[metric].resource is Resource.MEMORY
    pending: float
    if memory:
        pending = sum(p.memory_bytes for p in tick.evictions.values()) + tick.released_memory
    else:
        pending = sum(p.cores for p in tick.evictions.values()) + tick.released_cores
    remaining = gap - pending * per_unit
    if remaining <= 0:
        if tick.evictions:
            ids = ", ".join(sorted(tick.evictions))
            tick.block(metric, Direction.EVICT, "eviction-pending", f"still terminating, releasing enough: {ids}")
        return
    limit = tick.guard.evictions.max_per_tick
    for usage in ranked:
        if remaining <= 0:
            return
        if tick.evicted_count[dry] >= limit:
            detail = f"{fmt(remaining)} of the gap stays open: maxPerTick ({limit}) reached"
            tick.block(metric, Direction.EVICT, "eviction-budget", detail)
            return
        if usage.workload.id in tick.evicted:
            continue
        amount = (usage.memory_bytes or 0) if memory else _expected_cores(tick, usage)
        release = amount * per_unit
        if release <= 0:
            continue
        _emit_evict(tick, line, usage, gap_before=remaining, release=release, dry=dry)
        remaining -= release
    if remaining > 0:
        detail = f"{fmt(remaining)} of the gap stays open: no candidate left"
        tick.block(metric, Direction.EVICT, "exhausted", detail)


def _evict_one(tick: Tick, line: Waterline, gap: float, ranked: Ranked, dry: bool) -> None:
    metric = line.metric
    if tick.evictions or tick.evicted:
        ids = ", ".join(sorted(tick.evictions.keys() | tick.evicted))
        tick.block(metric, Direction.EVICT, "eviction-pending", f"measuring again once gone: {ids}")
        return
    if not ranked:
        tick.block(metric, Direction.EVICT, "exhausted", "no candidate left")
        return
    _emit_evict(tick, line, ranked[0], gap_before=gap, release=None, dry=dry)
    tick.cooldowns[(metric, Direction.EVICT)] = tick.guard.cooldown_ticks


def _emit_evict(
    tick: Tick, line: Waterline, usage: WorkloadUsage, *, gap_before: float, release: float | None, dry: bool
) -> None:
    workload = usage.workload
    cores = _expected_cores(tick, usage)
    memory = usage.memory_bytes or 0
    how = "fewest workloads that close the gap" if release is not None else "one workload (closed loop)"
    tick.actions.append(
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
    tick.evicted.add(workload.id)
    if tick.evicted_count[dry] == 0:
        tick.last_eviction[dry] = tick.now
    tick.evicted_count[dry] += 1
    tick.released_cores += cores
    tick.released_memory += memory
    if not dry:
        tick.evictions[workload.id] = PendingEviction(workload.id, line.metric, cores, memory, tick.now)
