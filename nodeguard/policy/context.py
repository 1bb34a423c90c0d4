"""The plan's context: what one plan() call reads, worked out once and shared by its features.

The readings and the waterlines, the gaps and streaks, the candidates and
their rankings (computed when a feature first asks, so a calm tick does no
work per workload), the groups held back after refused writes, and what the
node's waiting work would take of CPU freed now. Nothing here is decided:
what the features decide goes into their ``Decision`` (policy.decisions).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping

from nodeguard.model.samples import CpuMax
from nodeguard.model.snapshot import NodeUsage, Snapshot, WorkloadUsage
from nodeguard.policy.decisions import Draft
from nodeguard.policy.gaps import compute_gaps
from nodeguard.policy.holds import HOLD_KINDS, HeldMemory, HeldThrottle
from nodeguard.policy.metrics import CAPABILITIES, Metric, Resource
from nodeguard.policy.ranking import Ranked, ordering
from nodeguard.policy.selection import Choices, Role
from nodeguard.policy.settings import GuardSettings
from nodeguard.policy.stall import ProtectedStalls, covers, is_protected
from nodeguard.policy.state import Direction, GuardState, MetricDirection, PendingEviction
from nodeguard.policy.tuning import STREAK_CAP
from nodeguard.policy.waterlines import Waterline, waterlines_for

METRIC_ORDER = {metric: index for index, metric in enumerate(CAPABILITIES)}


def fmt(value: float) -> str:
    return f"{value:.4g}"


def first_reason(metrics: frozenset[Metric]) -> Metric:
    # A throttle adopted from an older run's ledger may not know its reason.
    return min(metrics, key=METRIC_ORDER.__getitem__) if metrics else Metric.CPU_TOTAL_USAGE


class Readings(Mapping[Metric, float | None]):
    """Every metric's node value, in its unit, read when first asked for (a calm tick asks for its objectives'
    metrics only); protected_cpu_stall and protected_memory_stall take every protected workload's stall (a
    what-if value is used as given)."""

    def __init__(self, node: NodeUsage, stalls: ProtectedStalls, memory: Callable[[], float | None]) -> None:
        self._node = node
        self._values: dict[Metric, float | None] = {}
        self._stalls = stalls
        self._memory = memory

    def __getitem__(self, metric: Metric) -> float | None:
        try:
            return self._values[metric]
        except KeyError:
            pass
        value = CAPABILITIES[metric].read(self._node)
        if value is None and metric is Metric.PROTECTED_CPU_STALL:
            value = self._stalls.reading()
        elif value is None and metric is Metric.PROTECTED_MEMORY_STALL:
            value = self._memory()
        self._values[metric] = value
        return value

    def __iter__(self) -> Iterator[Metric]:
        return iter(CAPABILITIES)

    def __len__(self) -> int:
        return len(CAPABILITIES)

    def __repr__(self) -> str:
        return repr(dict(self))


class PlanContext:
    """What one plan() call reads; its features share it and decide apart."""

    def __init__(self, snapshot: Snapshot, state: GuardState, guard: GuardSettings) -> None:
        self.snapshot = snapshot
        self.node = snapshot.node
        self.now = snapshot.monotonic
        self.state = state
        self.guard = guard
        self.workloads = snapshot.workloads
        self.lines = waterlines_for(guard.objectives, self.node)
        self.stall_line = self.lines.get((Metric.PROTECTED_CPU_STALL, "throttle"))
        self.protect = self.stall_line.protect if self.stall_line is not None else ()
        self.stalls = ProtectedStalls(self.workloads, self.protect)
        self.memory_line = self.lines.get((Metric.PROTECTED_MEMORY_STALL, "throttle"))
        self.memory_protect = self.memory_line.protect if self.memory_line is not None else ()
        self.readings = Readings(self.node, self.stalls, self._memory_stall)
        self.min_change = guard.min_change_percent / 100.0 * self.node.cpus
        self.margin = guard.target_margin_percent / 100.0 * self.node.cpus

        # Holds of workloads that left: given back (the executor), and no longer in the state.
        departed = {
            group: None
            for kind in HOLD_KINDS
            if kind.on_workload
            for group in state.holds.get(kind.lever, {})
            if group not in self.workloads
        }
        self.departed = tuple(departed)
        gone = set(self.departed)
        self.holds = {
            lever: {group: hold for group, hold in groups.items() if group not in gone}
            for lever, groups in state.holds.items()
        }
        self.throttles: Mapping[str, HeldThrottle] = self.holds.get(HeldThrottle.lever, {})  # type: ignore[assignment]
        self.memory_held: Mapping[str, HeldMemory] = self.holds.get(HeldMemory.lever, {})  # type: ignore[assignment]
        self.held_before = bool(self.throttles)
        self.memory_before = bool(self.memory_held)
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

        self.gaps = compute_gaps(self.readings, self.lines, self.held_before or self.memory_before)
        self.streaks = self._streaks()
        self.cooling = {key for key, ticks in state.cooldowns.items() if ticks > 0}
        self.cooldowns = {key: ticks - 1 for key, ticks in state.cooldowns.items() if ticks > 1}

        self.rankings: dict[tuple[str, ...], Ranked] = {}
        memory_protect = self.memory_protect if self.memory_line is not None else None
        self.choices = Choices(self.workloads, guard, self.protect, memory_protect)
        self._candidates: list[WorkloadUsage] | None = None
        self._unknown: dict[Resource, list[str]] = {}
        self._absorbing: tuple[float, float] | None = None  # (cores freed CPU goes to, share of waits that is demand)

    # --- readings and streaks ------------------------------------------------------

    def _memory_stall(self) -> float | None:
        """The worst protected workload's memory stall (memory.pressure "some", percent); 0 with nothing
        protected, None while every protected workload is too new to have one."""
        found = [u for u in self.workloads.values() if is_protected(u.workload, self.memory_protect)]
        known = [u.memory_stall_pct for u in found if u.memory_stall_pct is not None]
        if known:
            return max(known)
        return None if found else 0.0

    def per_unit(self, metric: Metric) -> float:
        scale = CAPABILITIES[metric].per_resource_unit
        assert scale is not None, f"{metric} is not quantified"
        return scale(self.node)

    def node_memory(self) -> float:
        """The node's memory in bytes (0 while /proc/meminfo is unreadable: memory metrics then read None)."""
        return float(self.node.memory.total) if self.node.memory is not None else 0.0

    def room(self, line: Waterline, value: float) -> float:
        """Cores between the node's reading and what a throttle aims at (the waterline less the margin)."""
        return (line.threshold - value) / self.per_unit(line.metric) - self.margin

    def _streaks(self) -> dict[MetricDirection, int]:
        old = self.state.streaks
        streaks: dict[MetricDirection, int] = {}
        for (metric, action), line in self.lines.items():
            value = self.readings[metric]
            key = (metric, Direction.THROTTLE if action == "throttle" else Direction.EVICT)
            past = value is not None and value > line.threshold
            streaks[key] = min(STREAK_CAP, old.get(key, 0) + 1) if past else 0
            if line.restore_below is not None:
                key = (metric, Direction.RESTORE)
                calm = value is not None and value < line.restore_below
                streaks[key] = min(STREAK_CAP, old.get(key, 0) + 1) if calm else 0
            if line.action == "throttle" and line.quantified and CAPABILITIES[metric].resource is Resource.CPU:
                key = (metric, Direction.REFILL)
                room = value is not None and self.room(line, value) >= self.min_change
                streaks[key] = min(STREAK_CAP, old.get(key, 0) + 1) if room else 0
        return streaks

    def dry(self, line: Waterline) -> bool:
        return self.guard.dry_run or line.dry_run

    def holding_note(self) -> str:
        if not self.holding:
            return ""
        shown = sorted(self.holding)
        names = ", ".join(f"{wid} ({self.held_back[wid].error})" for wid in shown[:3])
        return f"; {len(shown)} held back after refused writes: {names}" + (" …" if len(shown) > 3 else "")

    # --- candidates ----------------------------------------------------------------

    def candidates(self) -> list[WorkloadUsage]:
        """The workloads that may be held back: chosen as candidates (policy.selection), neither asked to leave
        (before this tick) nor held back after a refused write."""
        if self._candidates is None:
            roles = self.choices.roles()
            candidate = Role.CANDIDATE
            # roles() lists every workload in the snapshot's order: zipped, not looked up by id.
            found = [u for u, role in zip(self.workloads.values(), roles.values(), strict=True) if role is candidate]
            pending, holding = self.evictions, self.holding
            if pending or holding:
                found = [u for u in found if u.workload.id not in pending and u.workload.id not in holding]
            self._candidates = found
        return self._candidates

    def candidate_count(self) -> int | None:
        """How many candidates there were; None when no feature needed them."""
        return None if self._candidates is None else len(self._candidates)

    def ranked(self, names: tuple[str, ...]) -> Ranked:
        ranked = self.rankings.get(names)
        if ranked is None:
            ranked = self.rankings[names] = ordering(names).sort(self.candidates())
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

    def ready(self, line: Waterline, direction: Direction, draft: Draft) -> bool:
        """The circuit breaker, the trigger streak and the cool-down, for a line past its waterline (why not,
        into ``draft``)."""
        metric = line.metric
        key = (metric, direction)
        streak = self.streaks.get(key, 0)
        if streak < line.trigger_after:
            draft.block(metric, direction, "confirming", f"past the waterline {streak}/{line.trigger_after} ticks")
            return False
        if key in self.cooling:
            draft.block(metric, direction, "cooldown", "measuring the effect of the last action")
            return False
        missing = self.unknown(CAPABILITIES[metric].resource)
        if missing:
            shown = ", ".join(missing[:3]) + (" …" if len(missing) > 3 else "")
            draft.block(metric, direction, "missing-sample", f"{len(missing)} candidate(s) without usage yet: {shown}")
            return False
        return True

    def gap_to_close(self, line: Waterline, direction: Direction, draft: Draft) -> float | None:
        """The line's gap when it is to be acted on now (a sample, past its waterline, ready); else None."""
        metric = line.metric
        if self.readings[metric] is None:
            draft.missing_sample(metric, direction)
            return None
        gaps = self.gaps.throttle_down if direction is Direction.THROTTLE else self.gaps.evict
        gap = gaps.get(metric)
        if gap is None or not self.ready(line, direction, draft):
            return None
        return gap

    # --- demand: what freed CPU goes to --------------------------------------------

    def _waiting(self, usage: WorkloadUsage, draft: Draft | None, candidate: bool = True) -> float:
        """What it would take of freed CPU, in cores, as far as its own limit lets it (as ``draft`` has planned
        it; None: as the tick found it): for a candidate the wait of its never-sleeping threads; for a workload
        the throttles make room for (protected, more important), all its threads waited for, as it is the one
        to get the room."""
        waiting = usage.starved_cores if candidate else usage.waiting_cores
        if not waiting or usage.cores is None:
            return 0.0
        limit = self.limit_before(usage) if draft is None else draft.limit(usage)
        cores = None if limit is None else limit.cores
        return waiting if cores is None else min(waiting, max(0.0, cores - usage.cores))

    def limit_before(self, usage: WorkloadUsage) -> CpuMax | None:
        """Its limit as the tick found it: nodeguard's hold, else its own."""
        held = self.throttles.get(usage.workload.id)
        return held.quota if held is not None else usage.cpu_max

    def absorbing(self) -> float:
        """Cores that CPU freed now would go to: what runnable workloads waited for, past the node's idle CPU,
        within the limits the tick found.

        Waits on a node with idle CPU are wake-up latency, not unmet demand.
        """
        if self._absorbing is None:
            # Most workloads wait for nothing: only those that do are looked at further.
            waits = [(wid, u) for wid, u in self.workloads.items() if u.starved_cores or u.waiting_cores]
            waiting = 0.0
            if waits:
                candidates = {u.workload.id for u in self.candidates()}
                waiting = sum(
                    self._waiting(u, None, wid in candidates) for wid, u in waits if wid not in self.evictions
                )
            idle = self.idle_cores()
            absorbing = max(0.0, waiting - idle)
            self._absorbing = (absorbing, absorbing / waiting if waiting > 0 else 0.0)
        return self._absorbing[0]

    def unmet(self, usage: WorkloadUsage, draft: Draft) -> float:
        """The part of its wait (within its limit as ``draft`` has it now) that is demand the node did not meet."""
        self.absorbing()
        assert self._absorbing is not None
        return self._absorbing[1] * self._waiting(usage, draft)

    def demand(self, usage: WorkloadUsage, draft: Draft) -> float | None:
        return None if usage.cores is None else usage.cores + self.unmet(usage, draft)

    def idle_cores(self) -> float:
        return max(0.0, self.node.cpus - (self.node.cores_used or float(self.node.cpus)))
