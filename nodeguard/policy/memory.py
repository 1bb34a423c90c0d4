"""Memory throttle and restore: lower candidates' memory.high while a memory waterline is past (cgroup v2).

Throttle (decrease fast): per throttle waterline on memory_total_utilization or
memory_total_usage past for triggerAfter ticks, walk the candidates in their
memory order (least important, largest first) and lower each one's
memory.high towards what it uses now less what is left of the gap, stopping
when the gap is closed. Never below its floor: its memory request, and
guard.memory.minHigh (above memory.high the kernel reclaims and slows the
workload's allocations; it never kills, so the floor is what keeps it
running, not what keeps it alive). Never more than guard.memory.stepPercent
of its usage below its usage in one tick: the kernel reclaims inside the
write, so a big cut would stall the writer and the workload at once.

What a lowered memory.high releases is what the kernel can reclaim: page
cache at once, anonymous memory only with swap. Without swap a workload
whose anonymous memory grows is held where it is (its allocations wait), so
the node stops growing even where nothing is released; the prediction is
the most it can give. A workload whose usage stays above its memory.high is
not lowered again: the kernel could not reclaim down to it, so a lower value
releases nothing and only adds reclaim work and waiting. When the candidates
are at their floors, or held like that, the gap stays open and is reported
(``exhausted``); evict objectives, whose waterline is higher, remain the last
resort.

Restore (increase slowly): once every memory throttle metric has been below
its restore waterline for restoreAfter ticks, held values rise by at most
guard.memory.restoreStepPercent of node memory per tick in all (and no more
than the throttle-up gap), most important first; a workload is released (its
exact original written back, "max" or kubelet's Memory QoS value) when the
step reaches its original, the node's memory, or what it used when first
throttled. Holds no memory objective asks for (adopted from the ledger of a
run whose config had one, or kept through a reload that removed it) are given
back the same way, a step a tick.

protected_memory_stall: the protected workloads' own memory stall
(memory.pressure "some") past its target lowers every candidate's memory.high
one step (``memory_protect``), then cools down; restored like the others,
a step and a cool-down at a time, but only once the candidate has not pressed
against its hold for PRESSED_SECONDS (pressing: at PRESSING_SHARE of its
memory.high or more, and stalled on memory itself): the protected stall is
calm *because* of the hold while a stream still fills the page cache, and
raising it then would expose them again (the weights' rule in
protection, for memory).

On cgroup v1 there is no memory.high: each memory throttle line is blocked
with cause ``needs-cgroup-v2`` and evict objectives are untouched.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import replace

from nodeguard.model.levers import MEMORY_HIGH, LeverChange
from nodeguard.model.snapshot import WorkloadUsage
from nodeguard.model.workloads import QOS_RANK
from nodeguard.policy.context import PlanContext, fmt
from nodeguard.policy.decisions import Decision, Draft, Planned
from nodeguard.policy.holds import HeldMemory, MemoryDetails, memory_text
from nodeguard.policy.metrics import CAPABILITIES, Metric, Resource
from nodeguard.policy.ranking import Ranked
from nodeguard.policy.state import Direction
from nodeguard.policy.tuning import GRANULE, OVER_SLACK, PRESSED_SECONDS, PRESSING_SHARE
from nodeguard.policy.waterlines import Waterline

# The metric a restore is counted under when its hold knows no reason and no memory objective is configured
# (as policy.context.first_reason does for quotas).
ADOPTED_REASON = Metric.MEMORY_TOTAL_UTILIZATION
NEEDS_V2 = (
    "memory throttling writes memory.high, which needs cgroup v2 (cgroup v1's memory limits invoke the OOM "
    "killer); on this node only evict objectives act on memory"
)


def is_memory(line: Waterline) -> bool:
    return CAPABILITIES[line.metric].resource is Resource.MEMORY


def as_bytes(high: float | None) -> int | None:
    """A snapshot's memory.high (math.inf for "max") as the state keeps it (None for "max")."""
    return None if high is None or math.isinf(high) else int(high)


def _down(value: float) -> int:
    return int(value) // GRANULE * GRANULE


def _up(value: float) -> int:
    return -(-math.ceil(value) // GRANULE) * GRANULE


def floor_of(ctx: PlanContext, usage: WorkloadUsage) -> int:
    """The least memory.high a workload is given: its request, and guard.memory.minHigh."""
    return _up(max(ctx.guard.memory.min_high, usage.workload.memory_request_bytes or 0))


def memory_throttle(ctx: PlanContext, before: Planned, line: Waterline, gap: float, ranked: Ranked) -> Decision:
    """Close a memory metric's gap by lowering the candidates' memory.high, fewest first."""
    draft = Draft(before)
    if ctx.snapshot.cgroup_version != "v2":
        draft.block(line.metric, Direction.THROTTLE, "needs-cgroup-v2", NEEDS_V2)
        return draft.decision()
    per_unit = ctx.per_unit(line.metric)
    margin = ctx.guard.target_margin_percent / 100.0 * ctx.node_memory()
    # What this tick's throttles on the other memory metric may release counts; not towards evictions (evict.py):
    # a lowered memory.high may release nothing (anonymous memory without swap), and eviction is what is left.
    remaining = gap / per_unit + margin - draft.throttled_memory
    for usage in ranked:
        if remaining < GRANULE:
            return draft.decision()
        lowered = lower_high(ctx, draft, usage, remaining)
        if lowered is None:
            continue
        high, release, previous = lowered
        _emit_throttle(ctx, draft, line, usage, high=high, release=release, previous=previous,
                       gap_before=remaining * per_unit, per_unit=per_unit)  # fmt: skip
        remaining -= release
    if remaining >= GRANULE:
        detail = f"{fmt(remaining * per_unit)} of the gap stays open: every candidate's memory.high is at its floor"
        draft.block(line.metric, Direction.THROTTLE, "exhausted", detail + ctx.holding_note())
    return draft.decision()


def memory_protect(ctx: PlanContext, before: Planned, line: Waterline, gap: float, ranked: Ranked) -> Decision:
    """protected_memory_stall past its target: every candidate's memory.high comes down one step, then measure.

    The stall is the protected workloads' own (memory.pressure "some": their refaults and reclaim waits), and
    what causes it is not one candidate but whoever fills the page cache; a step on each of them makes the
    kernel reclaim their cache first, and a cool-down lets the protected workloads' refaults say whether it was
    enough. Non-quantified: the release of a step cannot be predicted from the stall.
    """
    draft = Draft(before)
    if ctx.snapshot.cgroup_version != "v2":
        draft.block(line.metric, Direction.THROTTLE, "needs-cgroup-v2", NEEDS_V2)
        return draft.decision()
    acted = False
    for usage in ranked:
        lowered = lower_high(ctx, draft, usage, math.inf)  # a whole step: guard.memory.stepPercent of its usage
        if lowered is None:
            continue
        high, release, previous = lowered
        _emit_throttle(ctx, draft, line, usage, high=high, release=release, previous=previous, gap_before=gap,
                       per_unit=None, how="one step to reclaim its cache first (closed loop)")  # fmt: skip
        acted = True
    if acted:
        draft.cool(line.metric, Direction.THROTTLE, ctx.guard.cooldown_ticks)
    else:
        detail = "every candidate's memory.high is at its floor" + ctx.holding_note()
        draft.block(line.metric, Direction.THROTTLE, "exhausted", detail)
    return draft.decision()


def lower_high(ctx: PlanContext, draft: Draft, usage: WorkloadUsage, want: float) -> tuple[int, int, int | None] | None:
    """(the new memory.high, the bytes it may release, the value before); None at its floor or without the file."""
    if usage.memory_high is None or usage.memory_bytes is None:
        return None  # no memory controller here: nothing to lower
    held = draft.memory(usage.workload.id)
    previous = held.high if held is not None else as_bytes(usage.memory_high)
    used = usage.memory_bytes
    if previous is not None and used > previous + OVER_SLACK:
        # Above its memory.high the kernel reclaims all it can and makes the workload wait: what is left
        # (anonymous memory without swap) a lower value cannot release either, and more reclaim and waiting
        # inside the workload would only cost CPU (bench/memory.py: the protected pod's tail). It is held.
        return None
    base = used if previous is None else min(used, previous)
    floor = floor_of(ctx, usage)
    room = base - floor
    if room < GRANULE:
        return None
    step = used * ctx.guard.memory.step_percent / 100.0
    cut = min(room, max(want, GRANULE), max(step, GRANULE))
    high = max(floor, _down(base - cut))
    if previous is not None and high >= previous:
        return None
    return high, max(0, used - high), previous


def _emit_throttle(
    ctx: PlanContext,
    draft: Draft,
    line: Waterline,
    usage: WorkloadUsage,
    *,
    high: int,
    release: int,
    previous: int | None,
    gap_before: float,
    per_unit: float | None,
    how: str = "precisely",
) -> None:
    workload = usage.workload
    held = draft.memory(workload.id)
    original = held.original if held is not None else as_bytes(usage.memory_high)
    dry = ctx.dry(line)
    draft.act(
        LeverChange(
            lever=MEMORY_HIGH.name,
            group=workload.id,
            target=memory_text(high),
            give_back=memory_text(original),
            release=False,
            holds_back=True,
            kind="memory_throttle",
            metric=line.metric,
            reason=f"{line.metric} past {fmt(line.threshold)} ({line.objective}): lower memory.high {how}",
            dry_run=dry,
            workload=workload,
            gap_before=gap_before,
            predicted_release=None if per_unit is None else release * per_unit,
            previous=memory_text(previous),
            releases=release,
            details=MemoryDetails(high, previous, original, release_bytes=release),
        )
    )
    draft.throttled_memory += release
    if not dry:
        draft.set_hold(
            HeldMemory(
                group=workload.id,
                original=original,
                high=high,
                reasons=(held.reasons if held is not None else frozenset()) | {line.metric},
                since=held.since if held is not None else ctx.now,
                demand_bytes=held.demand_bytes if held is not None else usage.memory_bytes,
                pressed=held.pressed if held is not None else None,
            )
        )


def memory_restore(ctx: PlanContext, before: Planned, lines: Sequence[Waterline]) -> Decision:
    """Raise held memory.high values a step when every memory throttle metric is calm."""
    draft = Draft(before)
    if not ctx.memory_before:
        return draft.decision()
    _note_pressing(ctx, draft)
    for line in lines:
        if line.metric in ctx.gaps.throttle_down:
            draft.block(line.metric, Direction.RESTORE, "throttling", f"{line.metric} is past its waterline")
            return draft.decision()
    budget = ctx.guard.memory.restore_step_percent / 100.0 * ctx.node_memory()
    paced: list[Metric] = []
    for line in lines:
        if not _calm(ctx, draft, line):
            return draft.decision()
        up = ctx.gaps.throttle_up.get(line.metric)
        if not line.quantified:
            paced.append(line.metric)  # a step, then the protected workloads' stall is measured again
        elif up is not None:
            budget = min(budget, up / ctx.per_unit(line.metric))
    if _raise(ctx, draft, budget, lines):
        for metric in paced:
            draft.cool(metric, Direction.RESTORE, ctx.guard.cooldown_ticks)
    return draft.decision()


def _calm(ctx: PlanContext, draft: Draft, line: Waterline) -> bool:
    value = ctx.readings[line.metric]
    if value is None:
        draft.missing_sample(line.metric, Direction.RESTORE)
        return False
    assert line.restore_below is not None  # config: a throttle objective has restoreBelow
    if line.metric not in ctx.gaps.throttle_up:
        detail = f"{fmt(value)} is not below the restore waterline {fmt(line.restore_below)}"
        draft.block(line.metric, Direction.RESTORE, "dead-band", detail)
        return False
    key = (line.metric, Direction.RESTORE)
    streak = ctx.streaks.get(key, 0)
    if streak < line.restore_after:
        detail = f"below the restore waterline {streak}/{line.restore_after} ticks"
        draft.block(line.metric, Direction.RESTORE, "confirming", detail)
        return False
    if key in ctx.cooling:
        draft.block(line.metric, Direction.RESTORE, "cooldown", "measuring the effect of the last restore")
        return False
    return True


def _raise(ctx: PlanContext, draft: Draft, budget: float, lines: Sequence[Waterline]) -> bool:
    """Raise held values within ``budget`` bytes, most important first; whether any was raised."""
    why = "node calm on every memory throttle metric" if lines else "no memory objective holds it"
    unknown = lines[0].metric if lines else ADOPTED_REASON  # the metric of a hold that knows no reason
    holds = draft.current(HeldMemory)
    held = [ctx.workloads[wid] for wid in holds if not draft.pending(wid)]
    # Most important first.
    held.sort(key=lambda u: (QOS_RANK[u.workload.qos_class], -u.workload.priority, u.workload.id))
    spent = 0.0
    raised = False
    node = ctx.node_memory()
    guarding = any(line.metric is Metric.PROTECTED_MEMORY_STALL for line in lines)
    pressing = []
    for usage in held:
        hold = holds[usage.workload.id]
        if guarding and hold.pressed is not None and ctx.now - hold.pressed < PRESSED_SECONDS:
            pressing.append(usage.workload.id)
            continue
        ceiling = min(math.inf if hold.original is None else hold.original, node)
        if hold.demand_bytes is not None:
            ceiling = min(ceiling, hold.demand_bytes)
        left = budget - spent
        if left < GRANULE:
            return raised
        if ceiling - hold.high <= left:
            step, new, full = max(0.0, ceiling - hold.high), hold.original, True
        else:
            step, new, full = float(_down(left)), hold.high + _down(left), False
        spent += step
        metric = min(hold.reasons, key=str) if hold.reasons else unknown
        _emit_restore(ctx, draft, usage, hold, new=new, step=step, full=full, metric=metric, why=why)
        raised = True
    if pressing:
        names = ", ".join(pressing[:3]) + (" …" if len(pressing) > 3 else "")
        detail = f"{len(pressing)} held still press against their memory.high (reclaimed, stalled): {names}"
        draft.block(Metric.PROTECTED_MEMORY_STALL, Direction.RESTORE, "contended", detail)
    return raised


def _note_pressing(ctx: PlanContext, draft: Draft) -> None:
    """Stamp the holds the protected-memory objective made whose workload presses against them now."""
    for wid, hold in draft.current(HeldMemory).items():
        usage = ctx.workloads.get(wid)
        if usage is not None and Metric.PROTECTED_MEMORY_STALL in hold.reasons and presses(usage, hold.high):
            draft.set_hold(replace(hold, pressed=ctx.now))


def presses(usage: WorkloadUsage, high: int) -> bool:
    """Whether a held workload still wants more than its memory.high: it sits at it and stalls on reclaim."""
    used, stall = usage.memory_bytes, usage.memory_stall_pct
    return used is not None and used >= PRESSING_SHARE * high and stall is not None and stall > 0.0


def _emit_restore(
    ctx: PlanContext,
    draft: Draft,
    usage: WorkloadUsage,
    hold: HeldMemory,
    *,
    new: int | None,
    step: float,
    full: bool,
    metric: Metric,
    why: str,
) -> None:
    per_unit = ctx.per_unit(metric) if CAPABILITIES[metric].throttle_quantified else None
    dry = ctx.guard.dry_run
    draft.act(
        LeverChange(
            lever=MEMORY_HIGH.name,
            group=usage.workload.id,
            target=memory_text(new),
            give_back=memory_text(hold.original),
            release=full,
            holds_back=False,
            kind="memory_restore",
            metric=metric,
            reason=("released: memory.high back to its original" if full else "memory.high raised one step")
            + f" ({why})",
            dry_run=dry,
            workload=usage.workload,
            gap_before=ctx.gaps.throttle_up.get(metric),
            predicted_release=None if per_unit is None else -step * per_unit,
            previous=memory_text(hold.high),
            details=MemoryDetails(new, hold.high, hold.original, full=full),
        )
    )
    if dry:
        return
    if full:
        draft.drop_hold(HeldMemory, usage.workload.id)
    else:
        assert new is not None
        draft.set_hold(replace(hold, high=new))
