"""Protection on the tick: the phase machine's steps (policy.protect) turned into weights and quotas.

Three points of planner.plan(), in its order: ``begin`` (remember the reading,
judge the quotas on trial, give futile ones back) before any line, ``act`` at
the stall objective's line among the throttle lines (weights to lower, a
wait, or quotas that make room), and ``end`` after restore and refill
(lowered weights back, and the phase the tick leaves protection in). Each
returns its decision. The order is the trace's: a futile trial's restores
come before this tick's throttles, a weight held for contention is the last
thing blocked.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

from nodeguard.model.levers import CPU_WEIGHT, WEIGHT_IDLE, LeverChange
from nodeguard.model.workloads import QosClass
from nodeguard.policy.context import PlanContext, fmt
from nodeguard.policy.decisions import NOTHING, Decision, Draft, Planned
from nodeguard.policy.holds import HeldThrottle, LoweredWeight
from nodeguard.policy.metrics import Metric
from nodeguard.policy.protect import StallSeen, judge, observe, on_trial, settled, step, weighed, weights_may_return
from nodeguard.policy.protect_state import ProtectPhase
from nodeguard.policy.ranking import Ranked
from nodeguard.policy.restore import raise_quotas
from nodeguard.policy.selection import Role
from nodeguard.policy.stall import competing_demand, competing_group, covers
from nodeguard.policy.state import Direction
from nodeguard.policy.throttle import emit_throttle, lower
from nodeguard.policy.tuning import ACTIVE_CANDIDATE_CORES, CLOSED_CORES, CONTENDED_CORES
from nodeguard.policy.waterlines import Waterline

STALL = Metric.PROTECTED_CPU_STALL


def begin(ctx: PlanContext, before: Planned) -> Decision:
    """Remember this tick's reading; one more tick of the quotas' trial, and give them back if futile."""
    line = ctx.stall_line
    state = before.protect
    if line is None and state.trial is None:
        return NOTHING  # no reading to remember, no trial to judge: most nodes' every tick
    draft = Draft(before)
    tuning = ctx.guard.protect
    if line is not None:
        state = observe(state, ctx.readings[STALL], line.threshold, ctx.now, tuning)
    if state != before.protect:
        draft.protect = state
    if state.trial is None:
        return draft.decision()
    # Quotas held for the stall alone: one a node waterline also holds is that line's to give back.
    held = {wid for wid, h in before.held(HeldThrottle).items() if h.reasons == {STALL}}
    stall = ctx.readings[STALL] if held else None
    draft.protect, futile = judge(state, bool(held), stall, ctx.now, tuning)
    if futile is not None:
        draft.block(STALL, Direction.THROTTLE, "futile", futile.detail())
        raise_quotas(ctx, draft, math.inf, [], only=held, why="the quotas did not cut the protected stall")
    return draft.decision()


def act(ctx: PlanContext, before: Planned, line: Waterline, gap: float, ranked: Ranked) -> Decision:
    """Act for a stall past its target: the phase machine says which lever, or why quotas wait."""
    draft = Draft(before)
    weights = ctx.guard.protect_lever == "weight"
    lowered = before.held(LoweredWeight)
    seen = StallSeen(
        now=ctx.now,
        stall=ctx.readings[STALL],
        streak=ctx.streaks.get((STALL, Direction.THROTTLE), 0),
        tick_seconds=ctx.snapshot.interval or 1.0,
        weights=weights,
        lowered=lowered,
        lowerable=_lowerable(ctx, lowered, ranked) if weights else {},
        dry_run=ctx.dry(line),
    )
    decided = step(before.protect, seen, ctx.guard.protect)
    draft.protect = decided.state
    if decided.lower:
        _lower_weights(ctx, draft, line, seen)
        if not seen.dry_run:
            for hold in decided.lower.values():
                draft.set_hold(hold)
    elif decided.wait is not None:
        cause, detail = decided.wait
        draft.block(STALL, Direction.THROTTLE, cause, detail)
    elif _make_room(ctx, draft, line, gap, ranked) and weights:
        draft.protect = on_trial(decided.state, ctx.now)
    return draft.decision()


def end(ctx: PlanContext, before: Planned, acted: bool) -> Decision:
    """Put a lowered weight back once no protected workload has been harmed for weightHoldSeconds and the
    work under it has not waited for CPU the node does not have for quietTicks in a row (while it does, the
    weight is what keeps the harm away); at once where no candidate is left under it, and when no
    protected_cpu_stall objective is left. Then the phase the tick leaves protection in (``acted``: the stall
    line stepped this tick)."""
    line = ctx.stall_line
    if line is None and before.protect.phase is ProtectPhase.CALM and not before.held(LoweredWeight):
        return NOTHING  # nothing to put back, and a calm phase stays calm without the line
    draft = Draft(before)
    value = ctx.readings[STALL] if line is not None else None
    below = line is not None and value is not None and line.restore_below is not None and value < line.restore_below
    if before.held(LoweredWeight):
        _weights_back(ctx, draft, line, below)
    holding = bool(draft.current(LoweredWeight)) or any(
        STALL in h.reasons for h in draft.current(HeldThrottle).values()
    )
    after = settled(before.protect, acted=acted, holding=holding, below_restore=below, now=ctx.now)
    if after != before.protect:
        draft.protect = after
    return draft.decision()


def _weights_back(ctx: PlanContext, draft: Draft, line: Waterline | None, below: bool) -> None:
    tuning = ctx.guard.protect
    calm = line is not None and weights_may_return(draft.before.protect, below, ctx.now, tuning)
    candidates = [u.workload.id for u in ctx.candidates()]
    idle = ctx.idle_cores()
    lowered = draft.before.held(LoweredWeight)
    under = {group: tuple(wid for wid in candidates if covers(group, wid)) for group in lowered}
    demands = {g: competing_demand([ctx.workloads[wid] for wid in ids], idle) for g, ids in under.items() if ids}
    weighed_now = weighed(lowered, demands)
    for hold in weighed_now.values():
        if hold != lowered[hold.group]:
            draft.set_hold(hold)
    for group in sorted(weighed_now):
        if line is not None and under[group] and not calm:
            continue
        quiet = weighed_now[group].quiet_ticks
        if line is not None and under[group] and quiet < tuning.quiet_ticks:
            # Back now, the harm would be back with it: the weight is why it is absent.
            wanted = demands[group]
            detail = (
                f"{group}: the demand of its work is not known yet"
                if wanted is None
                else f"{group}: its work still waits for {fmt(wanted)} cores past the idle CPU"
                if wanted >= CONTENDED_CORES
                else f"{group}: its work quiet {quiet}/{tuning.quiet_ticks} ticks"
            )
            draft.block(STALL, Direction.RESTORE, "contended", detail)
            continue
        why = (
            "no protected_cpu_stall objective"
            if line is None
            else "no candidate left under it"
            if not under[group]
            else f"no protected workload harmed for {tuning.weight_hold_seconds:g}s, its work quiet"
        )
        dry = ctx.guard.dry_run or (line is not None and line.dry_run)
        draft.act(
            LeverChange(
                lever=CPU_WEIGHT.name,
                group=group,
                target=None,
                give_back=None,
                release=True,
                holds_back=False,
                kind="reweigh",
                metric=STALL,
                reason=f"weight back: {why}",
                dry_run=dry,
                workloads=under[group],
            )
        )
        if not dry:
            draft.drop_hold(LoweredWeight, group)


def _lowerable(ctx: PlanContext, lowered: Mapping[str, LoweredWeight], ranked: Ranked) -> dict[str, tuple[str, ...]]:
    """Every group that competes with the most stalled protected workload and holds an active candidate
    (never a group holding a protected or exempt workload: a QoS tier's weight holds back every pod in it, a CNI
    agent or CoreDNS too), with those candidates."""
    protected = [s.usage.workload.id for s in ctx.stalls.all()]
    protected += [wid for wid, role in ctx.choices.roles().items() if role in (Role.PROTECTED, Role.EXEMPT)]
    target = _target(ctx)
    if target is None:
        return {}  # a what-if with nothing protected on the node: nobody to weigh against
    groups: dict[str, list[str]] = {}
    for usage in ranked:
        if (usage.cores or 0.0) < ACTIVE_CANDIDATE_CORES:
            continue
        group = competing_group(usage.workload.id, target)
        if group is None or group in lowered or group in ctx.holding:
            continue
        if any(covers(group, p) for p in protected):
            continue
        groups.setdefault(group, []).append(usage.workload.id)
    return {group: tuple(ids) for group, ids in groups.items()}


def _target(ctx: PlanContext) -> str | None:
    """The protected workload to weigh against: the most stalled one (any, for a what-if)."""
    harmed = ctx.stalls.worst()
    if harmed is not None:
        return harmed.usage.workload.id
    found = ctx.stalls.all()
    return found[0].usage.workload.id if found else None


def _idle_allowed(ctx: PlanContext, group: str) -> bool:
    """Whether the group may be made idle: a BestEffort pod, whose weight kubelet writes once, at its creation
    (cpu.idle makes every later weight write to a group fail). A QoS tier, a Burstable pod (rewritten on a
    resize) or a plain host's group gets the least weight instead."""
    usage = ctx.workloads.get(group)
    return usage is not None and usage.workload.kind == "pod" and usage.workload.qos_class is QosClass.BEST_EFFORT


def _lower_weights(ctx: PlanContext, draft: Draft, line: Waterline, seen: StallSeen) -> None:
    reason = (
        f"{line.metric} past {fmt(line.threshold)}% ({line.objective}): {_target(ctx)} stalled "
        f"{fmt(seen.stall or 0.0)}%; lower the weight it competes with"
    )
    for group, ids in seen.lowerable.items():
        draft.act(
            LeverChange(
                lever=CPU_WEIGHT.name,
                group=group,
                target=WEIGHT_IDLE if _idle_allowed(ctx, group) else None,
                give_back=None,
                release=False,
                holds_back=True,
                kind="reweigh",
                metric=line.metric,
                reason=reason,
                dry_run=seen.dry_run,
                workloads=ids,
            )
        )
    draft.cool(line.metric, Direction.THROTTLE, ctx.guard.cooldown_ticks)


def _make_room(ctx: PlanContext, draft: Draft, line: Waterline, gap: float, ranked: Ranked) -> bool:
    """Make room for the most stalled protected workload: leave about as much CPU idle as it waited for
    (at least minChange), past what the other waiting work will take of it; then measure again."""
    harmed = ctx.stalls.worst()
    value = ctx.readings[line.metric]
    share = harmed.share if harmed is not None else (value or 0.0) / 100.0  # a what-if names nobody
    who = f"{harmed.usage.workload.name} stalled {fmt(100.0 * share)}%" if harmed else "what-if"
    remaining = max(ctx.min_change, share) + ctx.absorbing() - draft.released_cores
    acted = False
    for usage in ranked:
        if remaining < CLOSED_CORES:
            break
        lowered = lower(ctx, draft, usage, want=remaining)
        if lowered is not None:
            emit_throttle(ctx, draft, line, usage, lowered, gap_before=gap, per_unit=None, how=f"to make room ({who})")
            remaining -= lowered[1]
            acted = True
    if acted:
        draft.cool(line.metric, Direction.THROTTLE, ctx.guard.cooldown_ticks)
    elif remaining >= CLOSED_CORES:
        detail = "no candidate can release more" + ctx.holding_note()
        draft.block(line.metric, Direction.THROTTLE, "exhausted", detail)
    return acted
