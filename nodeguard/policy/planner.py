"""The precise planner: (snapshot, state, settings) -> Plan, with no side effects.

One tick, in order:

1. Throttle (decrease fast): per throttle waterline past for triggerAfter
   ticks, walk the sorted candidates and lower each one's quota just enough to
   close what is left of the gap, never below its floor (its CPU request, and
   guard.minQuotaCores), and by at least guard.minChangePercent of the node
   where it has that much above its floor; stop when the gap is closed. A
   non-quantified metric lowers one workload by guard.closedLoopStepPercent
   of its usage, then cools down. Throttling for one CPU metric counts
   towards the gaps of the others in the same tick.
   On a busy node, CPU freed by a throttle is taken by whatever waited to
   run (batch work wants every core it can get): the gap to close grows by
   what the threads that never slept waited for (``starved_cores``) beyond
   the node's idle CPU, within each workload's own limit, and each
   candidate's release is measured from its demand (what it used plus that
   wait), so one tick's throttles hold the node under the waterline once
   the others have expanded.
2. Evict (last resort): incompressible metrics first. The gap left after this
   tick's throttles and the evictions still terminating is closed by the
   fewest candidates, within the eviction budget.
3. Restore (increase slowly): only when no throttle waterline is past and
   every throttle metric has been below its restore waterline for
   restoreAfter ticks; the most important throttled workload first, quotas
   raised by at most guard.restoreStepPercent of the node per tick in all and
   by no more than the throttle-up gap, steps under guard.minChangePercent
   skipped. A workload is released (its exact original limit written back,
   possibly unlimited) once the step reaches its original limit, the node's
   cores, or the demand it had when first throttled, whichever is lowest.
4. Refill: between the restore waterline and the waterline nothing is
   restored (the dead-band), but where the node has been more than
   guard.minChangePercent under its aim (the waterline less the margin) for
   triggerAfter ticks, throttled workloads that are starved (their threads
   never slept: they would use it) get the room back towards the aim, half
   of what is left a tick (within restoreStepPercent) and most important
   first, so a throttle that overshot does not waste the node. The margin is
   what keeps noise around the aim under the waterline.

5. Protect (protected_cpu_stall, policy.stall): while the most stalled
   protected workload is over its target, lower the CPU weight of every group
   that competes with it (guard.protectLever "weight"), then, while the stall
   stays up (QUOTA_STREAK_TICKS in a row) and the weights did not cut it to
   half, lower quotas to leave about its wait idle past what the waiting work
   absorbs, a step and a cool-down at a time. Those quotas are on trial: if
   after QUOTA_TRIAL_TICKS the stall is still above QUOTA_FUTILE of what
   brought them, they buy nothing and all go back at once, the quota lever
   off for guard.weightHoldSeconds. Quotas come back like the others, a step
   and a cool-down at a time; weights after guard.weightHoldSeconds without
   harm, and only once the work under them stops waiting for CPU the node
   does not have (CONTENDED_CORES): before, the harm is absent because the
   weight is down, and putting it back would bring the harm back.

A workload whose last write the kernel refused is held back (no candidate)
for its back-off; the daemon plans the tick again without it, so the next
candidates close the gap. A missing sample never widens an action: the metric
is blocked and the plan says so. With a non-quantified throttle metric configured, restores go one
workload per tick and cool down, like its throttles. Dry-run actions are planned like real ones but leave the throttles
held and the evictions pending as they were: nothing changed on the node.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass, replace

from nodeguard.model.samples import CpuMax
from nodeguard.model.snapshot import Snapshot, WorkloadUsage
from nodeguard.policy.actions import Action, Blocked, Cause, Evict, Restore, Reweigh, Throttle
from nodeguard.policy.gaps import Gaps, compute_gaps
from nodeguard.policy.metrics import CAPABILITIES, Metric, Resource
from nodeguard.policy.ranking import GENERAL_SORTER, Ranked, ordering
from nodeguard.policy.settings import GuardSettings
from nodeguard.policy.stall import competing_demand, competing_group, covers, is_protected, stalls, worst
from nodeguard.policy.state import (
    STREAK_CAP,
    Direction,
    GuardState,
    HeldBack,
    HeldThrottle,
    Key,
    LoweredWeight,
    PendingEviction,
    QuotaTrial,
)
from nodeguard.policy.waterlines import ActionKind, Waterline, resolve_waterlines

MIN_QUOTA_US = 1000  # the kernel refuses a smaller cfs quota
# A gap under one millicore (Kubernetes' smallest CPU unit) is closed: quotas
# are whole microseconds, and rounding must not touch one more workload.
CLOSED_CORES = 1e-3
# A candidate using less CPU than this does no harm to make room from.
ACTIVE_CORES = 0.01
# After weights come down, the quota lever waits while the stall is at most this share of what it was (the
# weights work; what is left drains, e.g. work queued while harmed), for at most this many ticks.
WEIGHT_WORKING = 0.5
WEIGHT_PATIENCE_TICKS = 20
# With the weights down, quotas (which leave cores idle) wait for the stall to stay over target this many ticks in a
# row: a residual stall around the target (the v2 VM's, with every tier idle) must not cost the node its batch work.
QUOTA_STREAK_TICKS = 4
# Those quotas are judged after this many ticks: a mean stall above this share of what brought them means they buy
# nothing (the stall is not the batch work's doing: emulation, work outside the candidates) and they go back.
QUOTA_TRIAL_TICKS = 10
QUOTA_FUTILE = 0.7
# A lowered weight stays while the work under it waits for this many cores more than the node has idle.
CONTENDED_CORES = 0.1
_METRIC_ORDER = {metric: index for index, metric in enumerate(CAPABILITIES)}


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
    protected: tuple[ProtectedStall, ...]  # each protected workload's CPU stall (protected_cpu_stall)
    reweighs: tuple[Reweigh, ...]  # CPU weights to lower or put back (protected_cpu_stall)
    workloads: int
    candidates: int | None  # None when no action needed them
    state: GuardState  # for the next tick


@dataclass(frozen=True, slots=True)
class ProtectedStall:
    workload_id: str
    name: str
    stall_pct: float | None  # None before it has a usage rate
    waiting_cores: float | None  # all its threads' run-queue wait (v1), for the record


def plan(snapshot: Snapshot, state: GuardState, guard: GuardSettings) -> Plan:
    """Decide this tick's actions; the returned plan carries the state for the next tick."""
    return _Tick(snapshot, state, guard).run()


def _fmt(value: float) -> str:
    return f"{value:.4g}"


def _first(metrics: frozenset[Metric]) -> Metric:
    # A throttle adopted from an older run's ledger may not know its reason.
    return min(metrics, key=_METRIC_ORDER.__getitem__) if metrics else Metric.CPU_TOTAL_USAGE


class _Tick:
    """Scratch for one plan() call; never outlives it."""

    def __init__(self, snapshot: Snapshot, state: GuardState, guard: GuardSettings) -> None:
        self.snapshot = snapshot
        self.node = snapshot.node
        self.now = snapshot.monotonic
        self.state = state
        self.guard = guard
        self.workloads = snapshot.workloads
        self.readings: dict[Metric, float | None] = {m: cap.read(self.node) for m, cap in CAPABILITIES.items()}
        self.lines = resolve_waterlines(guard.objectives, self.node)
        self.stall_line = self.lines.get((Metric.PROTECTED_CPU_STALL, "throttle"))
        self.protect = self.stall_line.protect if self.stall_line is not None else ()
        self.stalls = stalls(self.workloads, self.protect)
        self.worst_stall = worst(self.stalls)
        if self.readings[Metric.PROTECTED_CPU_STALL] is None:  # no what-if value
            self.readings[Metric.PROTECTED_CPU_STALL] = self._protected_reading()
        self.lowered = dict(state.lowered)
        self.reweighs: list[Reweigh] = []
        self.last_harm = state.last_harm
        stall = self.readings[Metric.PROTECTED_CPU_STALL]
        if self.stall_line is not None and stall is not None and stall > self.stall_line.threshold:
            self.last_harm = self.now
        self.recent_stall = state.recent_stall
        if self.stall_line is not None and stall is not None:
            self.recent_stall = (*state.recent_stall, stall)[-QUOTA_STREAK_TICKS:]
        self.quota_trial = state.quota_trial
        self.quotas_futile_until = state.quotas_futile_until
        self.min_change = guard.min_change_percent / 100.0 * self.node.cpus
        self.margin = guard.target_margin_percent / 100.0 * self.node.cpus

        self.departed = tuple(wid for wid in state.throttles if wid not in self.workloads)
        self.throttles = {wid: h for wid, h in state.throttles.items() if wid in self.workloads}
        self.held_before = bool(self.throttles)
        timeout = guard.evictions.termination_timeout_seconds
        self.evictions: dict[str, PendingEviction] = {}
        expired = []
        for wid, pending in state.evictions.items():
            if wid not in self.workloads:
                continue  # gone: released
            if self.now - pending.since > timeout:
                expired.append(pending)
            else:
                self.evictions[wid] = pending
        self.expired = tuple(expired)
        # Kept for workloads still here, and for groups (a refused weight) that still hold one.
        self.held_back = {
            wid: h
            for wid, h in state.held_back.items()
            if wid in self.workloads or any(covers(wid, other) for other in self.workloads)
        }
        self.holding = {wid for wid, h in self.held_back.items() if h.until > self.now}

        self.gaps = compute_gaps(self.readings, self.lines, bool(self.throttles))
        self.streaks = self._streaks()
        self.cooling = {key for key, ticks in state.cooldowns.items() if ticks > 0}
        self.cooldowns = {key: ticks - 1 for key, ticks in state.cooldowns.items() if ticks > 1}

        self.actions: list[Action] = []
        self.blocked: list[Blocked] = []
        self.rankings: dict[tuple[str, ...], Ranked] = {}
        self._candidates: list[WorkloadUsage] | None = None
        self._unknown: dict[Resource, list[str]] = {}
        self.planned: dict[str, CpuMax] = {}  # quotas lowered this tick
        self._absorbing: tuple[float, float] | None = None  # (cores freed CPU goes to, share of waits that is demand)
        self.released_cores = 0.0  # by this tick's throttles and evictions
        self.released_memory = 0
        self.evicted: set[str] = set()
        self.evicted_count = {False: 0, True: 0}  # by dry_run
        self.last_eviction = dict(state.last_eviction)

    # --- bookkeeping -------------------------------------------------------------

    def _protected_reading(self) -> float | None:
        """The worst protected stall in percent; 0 with nothing protected (nobody harmed); None while every
        protected workload is too new to have one."""
        if self.worst_stall is not None:
            return 100.0 * self.worst_stall.share
        return None if self.stalls else 0.0

    def _streaks(self) -> dict[Key, int]:
        old = self.state.streaks
        streaks: dict[Key, int] = {}
        for (metric, action), line in self.lines.items():
            value = self.readings[metric]
            key = (metric, Direction.THROTTLE if action == "throttle" else Direction.EVICT)
            past = value is not None and value > line.threshold
            streaks[key] = min(STREAK_CAP, old.get(key, 0) + 1) if past else 0
            if line.restore_below is not None:
                key = (metric, Direction.RESTORE)
                calm = value is not None and value < line.restore_below
                streaks[key] = min(STREAK_CAP, old.get(key, 0) + 1) if calm else 0
            if line.action == "throttle" and line.quantified:
                key = (metric, Direction.REFILL)
                room = value is not None and self._room(line, value) >= self.min_change
                streaks[key] = min(STREAK_CAP, old.get(key, 0) + 1) if room else 0
        return streaks

    def block(self, metric: Metric, direction: Direction, cause: Cause, detail: str) -> None:
        self.blocked.append(Blocked(metric, direction, cause, detail))

    def candidates(self) -> list[WorkloadUsage]:
        if self._candidates is None:
            spec = self.guard.candidates
            classes = frozenset(spec.classes)
            below = spec.below_priority
            pending = self.evictions
            self._candidates = [
                u
                for wid, u in self.workloads.items()
                if not u.workload.protected
                and u.workload.metadata_known
                and not (self.protect and is_protected(u.workload, self.protect))
                and u.workload.qos_class in classes
                and (below is None or u.workload.priority < below)
                and wid not in pending
                and wid not in self.holding
            ]
        return self._candidates

    def ranked(self, names: tuple[str, ...]) -> Ranked:
        ranked = self.rankings.get(names)
        if ranked is None:
            ranked = self.rankings[names] = ordering(names).rank(self.candidates())
        return ranked

    def unknown(self, resource: Resource) -> list[str]:
        """Candidates without a usage sample for ``resource``: they block the metric."""
        ids = self._unknown.get(resource)
        if ids is None:
            if resource is Resource.CPU:
                ids = [u.workload.id for u in self.candidates() if u.cores is None]
            else:
                ids = [u.workload.id for u in self.candidates() if u.memory_bytes is None]
            self._unknown[resource] = ids
        return ids

    def ready(self, line: Waterline, direction: Direction) -> bool:
        """The circuit breaker, the trigger streak and the cool-down, for a line past its waterline."""
        metric = line.metric
        key = (metric, direction)
        streak = self.streaks.get(key, 0)
        if streak < line.trigger_after:
            self.block(metric, direction, "confirming", f"past the waterline {streak}/{line.trigger_after} ticks")
            return False
        if key in self.cooling:
            self.block(metric, direction, "cooldown", "measuring the effect of the last action")
            return False
        missing = self.unknown(CAPABILITIES[metric].resource)
        if missing:
            shown = ", ".join(missing[:3]) + (" …" if len(missing) > 3 else "")
            self.block(metric, direction, "missing-sample", f"{len(missing)} candidate(s) without usage yet: {shown}")
            return False
        return True

    def missing_sample(self, metric: Metric, direction: Direction) -> None:
        self.block(metric, direction, "missing-sample", f"no {metric} sample (first tick, or not available here)")

    def dry(self, line: Waterline) -> bool:
        return self.guard.dry_run or line.dry_run

    # --- run -----------------------------------------------------------------------

    def run(self) -> Plan:
        self._judge_quota_trial()
        lines = sorted(self.lines.values(), key=lambda w: (not w.quantified, _METRIC_ORDER[w.metric]))
        for line in lines:
            if line.action == "throttle":
                self.throttle(line)
        # Incompressible first: memory cannot wait for CPU to be released.
        for line in sorted(lines, key=lambda w: CAPABILITIES[w.metric].compressible):
            if line.action == "evict":
                self.evict(line)
        throttle_lines = [line for line in lines if line.action == "throttle"]
        if not self.restore(throttle_lines):
            self.refill(throttle_lines)
        self._restore_weights()
        new_state = GuardState(
            streaks=self.streaks,
            cooldowns=self.cooldowns,
            throttles=self.throttles,
            evictions=self.evictions,
            last_eviction=self.last_eviction,
            held_back=self.held_back,
            lowered=self.lowered,
            last_harm=self.last_harm,
            recent_stall=self.recent_stall,
            quota_trial=self.quota_trial,
            quotas_futile_until=self.quotas_futile_until,
        )
        return Plan(
            monotonic=self.now,
            readings=self.readings,
            waterlines=self.lines,
            gaps=self.gaps,
            actions=tuple(self.actions),
            blocked=tuple(self.blocked),
            rankings=self.rankings,
            departed=self.departed,
            expired=self.expired,
            held_back=tuple(self.held_back[wid] for wid in sorted(self.holding)),
            protected=tuple(
                ProtectedStall(
                    s.usage.workload.id,
                    s.usage.workload.name,
                    None if s.share is None else 100.0 * s.share,
                    s.usage.waiting_cores,
                )
                for s in self.stalls
            ),
            reweighs=tuple(self.reweighs),
            workloads=len(self.workloads),
            candidates=None if self._candidates is None else len(self._candidates),
            state=new_state,
        )

    # --- throttle ------------------------------------------------------------------

    def throttle(self, line: Waterline) -> None:
        metric = line.metric
        if self.readings[metric] is None:
            self.missing_sample(metric, Direction.THROTTLE)
            return
        gap = self.gaps.throttle_down.get(metric)
        if gap is None or not self.ready(line, Direction.THROTTLE):
            return
        ranked = self.ranked(line.sort_by)
        if CAPABILITIES[metric].protected:
            weights = self.guard.protect_lever == "weight"
            if weights and (
                self._lower_weights(line, ranked)
                or self._weights_working()
                or not self._stall_sustained()
                or self._quotas_futile()
            ):
                return
            if self._throttle_for_stall(line, gap, ranked) and weights and self.quota_trial is None:
                before = sum(self.recent_stall) / len(self.recent_stall)
                self.quota_trial = QuotaTrial(self.now, before)
        elif line.quantified:
            self._throttle_precisely(line, gap, ranked)
        else:
            self._throttle_one(line, gap, ranked)

    def _throttle_precisely(self, line: Waterline, gap: float, ranked: Ranked) -> None:
        per_unit = self._per_unit(line.metric)
        # This tick's earlier throttles (another CPU metric) already count. Aim a
        # margin under the waterline, so measurement noise does not re-trigger;
        # and close what the waiting work will take of the CPU freed.
        remaining = gap / per_unit + self.margin - self.released_cores + self.absorbing()
        for _, usage in ranked:
            if remaining < CLOSED_CORES:
                return
            lowered = self._lower(usage, want=remaining)
            if lowered is not None:
                self._emit_throttle(line, usage, lowered, remaining * per_unit, per_unit)
                remaining -= lowered[1]
        if remaining >= CLOSED_CORES:
            detail = f"{_fmt(remaining * per_unit)} of the gap stays open: no candidate can release more"
            self.block(line.metric, Direction.THROTTLE, "exhausted", detail + self._holding_note())

    def _lower_weights(self, line: Waterline, ranked: Ranked) -> bool:
        """The first lever: lower the weight of every group that competes with the most stalled protected
        workload and holds an active candidate (never a group holding a protected workload); False when none
        is left to lower."""
        protected = [s.usage.workload.id for s in self.stalls]
        harmed = self.worst_stall
        target = harmed.usage.workload.id if harmed is not None else (protected[0] if protected else None)
        if target is None:
            return False  # a what-if with nothing protected on the node: nobody to weigh against
        groups: dict[str, list[str]] = {}
        for _, usage in ranked:
            if (usage.cores or 0.0) < ACTIVE_CORES:
                continue
            group = competing_group(usage.workload.id, target)
            if group is None or group in self.lowered or group in self.holding:
                continue
            if any(covers(group, p) for p in protected):
                continue
            groups.setdefault(group, []).append(usage.workload.id)
        if not groups:
            return False
        dry = self.dry(line)
        value = self.readings[line.metric]
        reason = (
            f"{line.metric} past {_fmt(line.threshold)}% ({line.objective}): {target} stalled {_fmt(value or 0.0)}%;"
            " lower the weight it competes with"
        )
        for group, ids in groups.items():
            self.reweighs.append(Reweigh(group, line.metric, reason, lower=True, workloads=tuple(ids), dry_run=dry))
            if not dry:
                self.lowered[group] = LoweredWeight(group, self.now, value)
        self.cooldowns[(line.metric, Direction.THROTTLE)] = self.guard.cooldown_ticks
        return True

    def _weights_working(self) -> bool:
        """Whether the weights lowered last cut the stall enough to wait for the rest to drain, not quota."""
        if not self.lowered:
            return False
        last = max(self.lowered.values(), key=lambda w: w.since)
        value = self.readings[Metric.PROTECTED_CPU_STALL]
        tick = self.snapshot.interval or 1.0
        if last.stall_pct is None or value is None or self.now - last.since > WEIGHT_PATIENCE_TICKS * tick:
            return False
        if value > WEIGHT_WORKING * last.stall_pct:
            return False
        detail = f"{_fmt(value)}% after {_fmt(last.stall_pct)}% when weights came down: draining, quota waits"
        self.block(Metric.PROTECTED_CPU_STALL, Direction.THROTTLE, "cooldown", detail)
        return True

    def _stall_sustained(self) -> bool:
        """Whether the stall has stayed over target long enough, with the weights down, to pay for quotas."""
        streak = self.streaks.get((Metric.PROTECTED_CPU_STALL, Direction.THROTTLE), 0)
        if streak >= QUOTA_STREAK_TICKS:
            return True
        detail = f"over target {streak}/{QUOTA_STREAK_TICKS} ticks in a row with the weights down: quotas wait"
        self.block(Metric.PROTECTED_CPU_STALL, Direction.THROTTLE, "confirming", detail)
        return False

    def _quotas_futile(self) -> bool:
        """Whether the quota lever is off after quotas that did not cut the stall (the weights stay down)."""
        until = self.quotas_futile_until
        if until is None or self.now >= until:
            return False
        detail = f"quotas did not cut the stall: the quota lever waits {_fmt(until - self.now)}s more"
        self.block(Metric.PROTECTED_CPU_STALL, Direction.THROTTLE, "futile", detail)
        return True

    def _judge_quota_trial(self) -> None:
        """After QUOTA_TRIAL_TICKS, quotas set for the stall after the weights stay if they cut it; else every one
        goes back and the quota lever is off for weightHoldSeconds."""
        trial = self.quota_trial
        if trial is None:
            return
        # Quotas held for the stall alone: one a node waterline also holds is that line's to give back.
        held = {wid for wid, h in self.throttles.items() if h.reasons == {Metric.PROTECTED_CPU_STALL}}
        stall = self.readings[Metric.PROTECTED_CPU_STALL]
        if not held:
            self.quota_trial = None  # released (calm) or gone
            return
        if stall is None or self.now <= trial.since:
            return
        trial = replace(trial, total=trial.total + stall, ticks=trial.ticks + 1)
        self.quota_trial = trial if trial.ticks < QUOTA_TRIAL_TICKS else None
        mean = trial.total / trial.ticks
        if trial.ticks < QUOTA_TRIAL_TICKS or mean <= QUOTA_FUTILE * trial.before:
            return
        self.quotas_futile_until = self.now + self.guard.weight_hold_seconds
        detail = (
            f"quotas left the stall at {_fmt(mean)}% over {trial.ticks} ticks, after {_fmt(trial.before)}%: given back"
        )
        self.block(Metric.PROTECTED_CPU_STALL, Direction.THROTTLE, "futile", detail)
        self._raise(math.inf, [], only=held, why="the quotas did not cut the protected stall")

    def _restore_weights(self) -> None:
        """Put a lowered weight back once no protected workload has been harmed for weightHoldSeconds and the
        work under it no longer waits for CPU the node does not have (while it does, the weight is what keeps the
        harm away); at once where no candidate is left under it, and when no protected_cpu_stall objective is
        left."""
        if not self.lowered:
            return
        line = self.stall_line
        value = self.readings[Metric.PROTECTED_CPU_STALL]
        calm = (
            line is not None
            and value is not None
            and line.restore_below is not None
            and value < line.restore_below
            and (self.last_harm is None or self.now - self.last_harm >= self.guard.weight_hold_seconds)
        )
        candidates = [u.workload.id for u in self.candidates()]
        idle = max(0.0, self.node.cpus - (self.node.cores_used or float(self.node.cpus)))
        for group in sorted(self.lowered):
            under = tuple(wid for wid in candidates if covers(group, wid))
            if line is not None and under and not calm:
                continue
            if line is not None and under:
                wanted = competing_demand([self.workloads[wid] for wid in under], idle)
                if wanted >= CONTENDED_CORES:
                    # Back now, the harm would be back with it: the weight is why it is absent.
                    detail = f"{group}: its work still waits for {_fmt(wanted)} cores past the idle CPU"
                    self.block(Metric.PROTECTED_CPU_STALL, Direction.RESTORE, "contended", detail)
                    continue
            why = (
                "no protected_cpu_stall objective"
                if line is None
                else "no candidate left under it"
                if not under
                else f"no protected workload harmed for {self.guard.weight_hold_seconds:g}s"
            )
            dry = self.guard.dry_run or (line is not None and line.dry_run)
            back = Reweigh(group, Metric.PROTECTED_CPU_STALL, f"weight back: {why}", False, under, dry)
            self.reweighs.append(back)
            if not dry:
                del self.lowered[group]

    def _throttle_for_stall(self, line: Waterline, gap: float, ranked: Ranked) -> bool:
        """Make room for the most stalled protected workload: leave about as much CPU idle as it waited for
        (at least minChange), past what the other waiting work will take of it; then measure again."""
        harmed = self.worst_stall
        value = self.readings[line.metric]
        share = harmed.share if harmed is not None else (value or 0.0) / 100.0  # a what-if names nobody
        who = f"{harmed.usage.workload.name} stalled {_fmt(100.0 * share)}%" if harmed else "what-if"
        remaining = max(self.min_change, share) + self.absorbing() - self.released_cores
        acted = False
        for _, usage in ranked:
            if remaining < CLOSED_CORES:
                break
            lowered = self._lower(usage, want=remaining)
            if lowered is not None:
                self._emit_throttle(line, usage, lowered, gap, None, how=f"to make room ({who})")
                remaining -= lowered[1]
                acted = True
        if acted:
            self.cooldowns[(line.metric, Direction.THROTTLE)] = self.guard.cooldown_ticks
        elif remaining >= CLOSED_CORES:
            detail = "no candidate can release more" + self._holding_note()
            self.block(line.metric, Direction.THROTTLE, "exhausted", detail)
        return acted

    def _throttle_one(self, line: Waterline, gap: float, ranked: Ranked) -> None:
        fraction = self.guard.closed_loop_step_percent / 100.0
        for _, usage in ranked:
            lowered = self._lower(usage, fraction=fraction)
            if lowered is not None:
                self._emit_throttle(line, usage, lowered, gap, None)
                self.cooldowns[(line.metric, Direction.THROTTLE)] = self.guard.cooldown_ticks
                return
        self.block(line.metric, Direction.THROTTLE, "exhausted", "no candidate can release more" + self._holding_note())

    def _holding_note(self) -> str:
        if not self.holding:
            return ""
        shown = sorted(self.holding)
        names = ", ".join(f"{wid} ({self.held_back[wid].error})" for wid in shown[:3])
        return f"; {len(shown)} held back after refused writes: {names}" + (" …" if len(shown) > 3 else "")

    def _current_limit(self, usage: WorkloadUsage) -> CpuMax | None:
        wid = usage.workload.id
        planned = self.planned.get(wid)
        if planned is not None:
            return planned
        held = self.throttles.get(wid)
        return held.quota if held is not None else usage.cpu_max

    def _waiting(self, usage: WorkloadUsage, candidate: bool = True) -> float:
        """What it would take of freed CPU, in cores, as far as its own limit lets it: for a candidate the wait of
        its never-sleeping threads; for a workload the throttles make room for (protected, more important), all
        its threads waited for, as it is the one to get the room."""
        waiting = usage.starved_cores if candidate else usage.waiting_cores
        if not waiting or usage.cores is None:
            return 0.0
        limit = self._current_limit(usage)
        cores = None if limit is None else limit.cores
        return waiting if cores is None else min(waiting, max(0.0, cores - usage.cores))

    def absorbing(self) -> float:
        """Cores that CPU freed now would go to: what runnable workloads waited for, past the node's idle CPU.

        Waits on a node with idle CPU are wake-up latency, not unmet demand.
        """
        if self._absorbing is None:
            candidates = {u.workload.id for u in self.candidates()}
            waiting = sum(
                self._waiting(u, wid in candidates) for wid, u in self.workloads.items() if wid not in self.evictions
            )
            idle = max(0.0, self.node.cpus - (self.node.cores_used or float(self.node.cpus)))
            absorbing = max(0.0, waiting - idle)
            self._absorbing = (absorbing, absorbing / waiting if waiting > 0 else 0.0)
        return self._absorbing[0]

    def _unmet(self, usage: WorkloadUsage) -> float:
        """The part of its wait that is demand the node did not meet."""
        self.absorbing()
        assert self._absorbing is not None
        return self._absorbing[1] * self._waiting(usage)

    def _lower(
        self, usage: WorkloadUsage, want: float = 0.0, fraction: float = 0.0
    ) -> tuple[CpuMax, float, CpuMax] | None:
        """Lower by ``want`` cores or ``fraction`` of the usage, at least minChange, down to the floor.

        Returns the new quota, the cores it releases and the limit before; None
        when the workload is at its floor already.
        """
        own, cores = usage.cpu_max, usage.cores
        if own is None or cores is None:
            return None  # no cpu controller: nothing to throttle with
        # Its demand: what it used and what it waited for (counted in absorbing()); a
        # workload starved by the others still takes what a throttle frees.
        used = cores + (self._unmet(usage) if want and usage.starved_cores else 0.0)
        request = usage.workload.cpu_request_cores or 0.0
        if used - self.guard.min_quota_cores < CLOSED_CORES or used - request < CLOSED_CORES:
            return None  # at its floor: the common case on a busy node, so decided before any lookup
        wid = usage.workload.id
        held = self.throttles.get(wid)
        current = self.planned.get(wid)
        if current is None:
            current = held.quota if held is not None else own
        if current.quota_us is not None:
            used = min(used, current.quota_us / current.period_us)
        # The period lever: a throttle on a short period spreads the throttled work's bursts.
        period = self.guard.throttle_period_us or current.period_us
        floor = max(self.guard.min_quota_cores, request, MIN_QUOTA_US / period)
        room = used - floor
        if room < CLOSED_CORES:
            return None
        # At least minChange, so a big workload is not nudged by a sliver; a small
        # one may give all it has above its floor.
        target = used - min(room, max(want, used * fraction, self.min_change))
        quota_us = max(round(target * period), math.ceil(floor * period))
        release = used - quota_us / period
        if release <= 0:
            return None
        return CpuMax(quota_us, period), release, current

    def _emit_throttle(
        self,
        line: Waterline,
        usage: WorkloadUsage,
        lowered: tuple[CpuMax, float, CpuMax],
        gap_before: float,
        per_unit: float | None,
        *,
        how: str | None = None,
    ) -> None:
        quota, release, previous = lowered
        workload = usage.workload
        held = self.throttles.get(workload.id)
        original = held.original if held is not None else usage.cpu_max
        assert original is not None  # _lower() checked
        dry = self.dry(line)
        how = how or ("precisely" if per_unit is not None else "one step (closed loop)")
        self.actions.append(
            Throttle(
                workload=workload,
                metric=line.metric,
                reason=f"{line.metric} past {_fmt(line.threshold)} ({line.objective}): throttle {how}",
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
        demand = held.demand_cores if held is not None else self._demand(usage)
        self.planned[workload.id] = quota
        self.released_cores += release
        if not dry:
            self.throttles[workload.id] = HeldThrottle(
                workload_id=workload.id,
                original=original,
                quota=quota,
                reasons=(held.reasons if held is not None else frozenset()) | {line.metric},
                since=held.since if held is not None else self.now,
                demand_cores=demand,
            )

    def _demand(self, usage: WorkloadUsage) -> float | None:
        return None if usage.cores is None else usage.cores + self._unmet(usage)

    def _per_unit(self, metric: Metric) -> float:
        scale = CAPABILITIES[metric].per_resource_unit
        assert scale is not None, f"{metric} is not quantified"
        return scale(self.node)

    # --- evict ---------------------------------------------------------------------

    def evict(self, line: Waterline) -> None:
        metric = line.metric
        if self.readings[metric] is None:
            self.missing_sample(metric, Direction.EVICT)
            return
        gap = self.gaps.evict.get(metric)
        if gap is None or not self.ready(line, Direction.EVICT):
            return
        dry = self.dry(line)
        budget = self.guard.evictions
        last = self.last_eviction.get(dry)
        if self.evicted_count[dry] == 0 and last is not None and self.now - last < budget.min_interval_seconds:
            wait = budget.min_interval_seconds - (self.now - last)
            self.block(metric, Direction.EVICT, "eviction-budget", f"next eviction round in {wait:.0f}s")
            return
        if self.evicted_count[dry] >= budget.max_per_tick:
            self.block(metric, Direction.EVICT, "eviction-budget", f"maxPerTick ({budget.max_per_tick}) reached")
            return
        ranked = self.ranked(line.sort_by)
        if line.quantified:
            self._evict_precisely(line, gap, ranked, dry)
        else:
            self._evict_one(line, gap, ranked, dry)

    def _expected_cores(self, usage: WorkloadUsage) -> float:
        cores = usage.cores or 0.0
        planned = self.planned.get(usage.workload.id)
        if planned is None or planned.quota_us is None:
            return cores
        return min(cores, planned.quota_us / planned.period_us)

    def _evict_precisely(self, line: Waterline, gap: float, ranked: Ranked, dry: bool) -> None:
        metric = line.metric
        per_unit = self._per_unit(metric)
        memory = CAPABILITIES[metric].resource is Resource.MEMORY
        pending: float
        if memory:
            pending = sum(p.memory_bytes for p in self.evictions.values()) + self.released_memory
        else:
            pending = sum(p.cores for p in self.evictions.values()) + self.released_cores
        remaining = gap - pending * per_unit
        if remaining <= 0:
            if self.evictions:
                ids = ", ".join(sorted(self.evictions))
                self.block(metric, Direction.EVICT, "eviction-pending", f"still terminating, releasing enough: {ids}")
            return
        limit = self.guard.evictions.max_per_tick
        for _, usage in ranked:
            if remaining <= 0:
                return
            if self.evicted_count[dry] >= limit:
                detail = f"{_fmt(remaining)} of the gap stays open: maxPerTick ({limit}) reached"
                self.block(metric, Direction.EVICT, "eviction-budget", detail)
                return
            if usage.workload.id in self.evicted:
                continue
            amount = (usage.memory_bytes or 0) if memory else self._expected_cores(usage)
            release = amount * per_unit
            if release <= 0:
                continue
            self._emit_evict(line, usage, remaining, release, dry)
            remaining -= release
        if remaining > 0:
            detail = f"{_fmt(remaining)} of the gap stays open: no candidate left"
            self.block(metric, Direction.EVICT, "exhausted", detail)

    def _evict_one(self, line: Waterline, gap: float, ranked: Ranked, dry: bool) -> None:
        metric = line.metric
        if self.evictions or self.evicted:
            ids = ", ".join(sorted(self.evictions.keys() | self.evicted))
            self.block(metric, Direction.EVICT, "eviction-pending", f"measuring again once gone: {ids}")
            return
        if not ranked:
            self.block(metric, Direction.EVICT, "exhausted", "no candidate left")
            return
        self._emit_evict(line, ranked[0][1], gap, None, dry)
        self.cooldowns[(metric, Direction.EVICT)] = self.guard.cooldown_ticks

    def _emit_evict(
        self, line: Waterline, usage: WorkloadUsage, gap_before: float, release: float | None, dry: bool
    ) -> None:
        workload = usage.workload
        cores = self._expected_cores(usage)
        memory = usage.memory_bytes or 0
        how = "fewest workloads that close the gap" if release is not None else "one workload (closed loop)"
        self.actions.append(
            Evict(
                workload=workload,
                metric=line.metric,
                reason=f"{line.metric} past {_fmt(line.threshold)} ({line.objective}): evict {how}",
                gap_before=gap_before,
                predicted_release=release,
                cores=cores,
                memory_bytes=memory,
                dry_run=dry,
            )
        )
        self.evicted.add(workload.id)
        if self.evicted_count[dry] == 0:
            self.last_eviction[dry] = self.now
        self.evicted_count[dry] += 1
        self.released_cores += cores
        self.released_memory += memory
        if not dry:
            self.evictions[workload.id] = PendingEviction(workload.id, line.metric, cores, memory, self.now)

    # --- restore -------------------------------------------------------------------

    def restore(self, lines: list[Waterline]) -> bool:
        """Raise held quotas when the node is calm; False when it is not (nothing raised)."""
        if not self.held_before:
            return False
        for metric in self.gaps.throttle_down:
            self.block(metric, Direction.RESTORE, "throttling", f"{metric} is past its waterline")
        if self.gaps.throttle_down:
            return False
        reasons = frozenset().union(*(h.reasons for h in self.throttles.values()))
        budget = self.guard.restore_step_percent / 100.0 * self.node.cpus
        closed_loop: list[Metric] = []
        paced: list[Metric] = []
        for line in lines:
            if not self._calm(line, reasons):
                return False
            up = self.gaps.throttle_up.get(line.metric)
            if up is None:
                continue  # no sample, and nothing held for this metric
            if line.quantified:
                budget = min(budget, up / self._per_unit(line.metric))
            elif CAPABILITIES[line.metric].protected:
                paced.append(line.metric)  # a step across the throttles, then measure the harm again
            else:
                closed_loop.append(line.metric)
        if self._raise(budget, closed_loop):
            for metric in paced:
                self.cooldowns[(metric, Direction.RESTORE)] = self.guard.cooldown_ticks
        return True

    def _room(self, line: Waterline, value: float) -> float:
        """Cores between the node's reading and what a throttle aims at (the waterline less the margin)."""
        return (line.threshold - value) / self._per_unit(line.metric) - self.margin

    def refill(self, lines: list[Waterline]) -> None:
        """In the dead-band: give starved throttled workloads the room left under the aim, a step at a time."""
        if not self.throttles or self.gaps.throttle_down or not lines:
            return
        room = math.inf
        for line in lines:
            value = self.readings[line.metric]
            if not line.quantified or value is None:
                return  # a closed-loop metric (or no reading) cannot say how much room there is
            # Confirmed like a throttle (triggerAfter), not like a restore: this is a measured overshoot of
            # this guard's own throttles, and every tick of it wastes the node.
            if self.streaks.get((line.metric, Direction.REFILL), 0) < line.trigger_after:
                return
            room = min(room, self._room(line, value))
        if room < self.min_change:
            return
        # Half the room a tick: it closes in on the aim from below, and a reading that noise pushed down
        # does not send the node over the waterline the next tick.
        budget = min(room / 2.0, self.guard.restore_step_percent / 100.0 * self.node.cpus)
        starved = {wid for wid, u in self.workloads.items() if (u.starved_cores or 0.0) >= CLOSED_CORES}
        self._raise(budget, [], only=starved, refill=True)

    def _calm(self, line: Waterline, reasons: frozenset[Metric]) -> bool:
        """May quotas rise as far as this throttle metric is concerned?"""
        metric = line.metric
        value = self.readings[metric]
        if value is None:
            if metric in reasons:
                self.missing_sample(metric, Direction.RESTORE)
                return False
            return True
        assert line.restore_below is not None  # config: a throttle objective has restoreBelow
        if metric not in self.gaps.throttle_up:
            detail = f"{_fmt(value)} is not below the restore waterline {_fmt(line.restore_below)}"
            self.block(metric, Direction.RESTORE, "dead-band", detail)
            return False
        key = (metric, Direction.RESTORE)
        streak = self.streaks.get(key, 0)
        if streak < line.restore_after:
            self.block(
                metric,
                Direction.RESTORE,
                "confirming",
                f"below the restore waterline {streak}/{line.restore_after} ticks",
            )
            return False
        if key in self.cooling:
            self.block(metric, Direction.RESTORE, "cooldown", "measuring the effect of the last restore")
            return False
        return True

    def _raise(
        self,
        budget: float,
        closed_loop: list[Metric],
        only: set[str] | None = None,
        refill: bool = False,
        why: str | None = None,
    ) -> bool:
        """Raise held quotas within ``budget`` cores, most important first; whether any was raised."""
        held = [
            self.workloads[wid] for wid in self.throttles if wid not in self.evictions and (only is None or wid in only)
        ]
        spent = 0.0
        emitted = False
        # Most important first: the reverse of the order in which they were picked.
        for usage in reversed(GENERAL_SORTER.sort(held)):
            throttle = self.throttles[usage.workload.id]
            quota = throttle.quota
            current = quota.quota_us / quota.period_us if quota.quota_us is not None else math.inf
            ceiling = min(throttle.original.cores or math.inf, float(self.node.cpus))
            # Above what it used before the throttle, a higher quota is not expected to add usage. Not so for a
            # refill: it raises starved work, whose demand is more than it showed, by exactly the room.
            if throttle.demand_cores is not None and not refill:
                ceiling = min(ceiling, throttle.demand_cores)
            left = budget - spent
            if ceiling - current <= left:
                step, new, full = max(0.0, ceiling - current), throttle.original, True
            elif left >= self.min_change and left > 0:
                period = quota.period_us
                step, full = left, False
                new = CpuMax(round((current + left) * period), period)
            else:
                if spent == 0 and not refill:
                    detail = f"a step of {_fmt(left)} cores is under minChangePercent"
                    self.block(_first(throttle.reasons), Direction.RESTORE, "step-too-small", detail)
                return emitted
            spent += step
            emitted = True
            because = why or (
                "room left under the waterline, and it is starved" if refill else "node calm on every throttle metric"
            )
            self._emit_restore(usage, throttle, new, step=step, full=full, spent=spent, why=because)
            if closed_loop:
                for metric in closed_loop:
                    self.cooldowns[(metric, Direction.RESTORE)] = self.guard.cooldown_ticks
                return True  # closed loop: one workload, then measure again
        return emitted

    def _emit_restore(
        self,
        usage: WorkloadUsage,
        throttle: HeldThrottle,
        new: CpuMax,
        *,
        step: float,
        full: bool,
        spent: float,
        why: str,
    ) -> None:
        metric = _first(throttle.reasons)
        up = self.gaps.throttle_up.get(metric)
        quantified = CAPABILITIES[metric].throttle_quantified
        per_unit = self._per_unit(metric) if quantified else None
        gap_before = up if up is None or per_unit is None else up - (spent - step) * per_unit
        dry = self.guard.dry_run
        self.actions.append(
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
            del self.throttles[usage.workload.id]
        else:
            self.throttles[usage.workload.id] = replace(throttle, quota=new)
