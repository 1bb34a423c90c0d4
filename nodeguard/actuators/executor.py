"""Carrying out a plan: its actions as lever changes (ledger first, see ``changes``), and evictions.

A write the kernel refuses releases nothing: the workload is held back with
the refusal's cause and the daemon plans the same tick again without it, so
the next candidates close the gap. Evictions start only once a pass has no
refusals left. The executor reports what happened in the policy's terms
(``nodeguard.policy.outcome``); folding that into the guard state is the
policy's.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Coroutine, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from nodeguard.actuators import drift
from nodeguard.actuators.changes import Change, Changer, Done, Results
from nodeguard.actuators.evictors import Evictor
from nodeguard.actuators.ledger import Key, Ledger, LedgerUnsaved, LeverRecord
from nodeguard.actuators.levers.base import Lever, WriteRefused
from nodeguard.actuators.levers.cpu_quota import QuotaLever
from nodeguard.actuators.levers.cpu_weight import WeightLever
from nodeguard.actuators.levers.memory_high import MemoryHighLever, high_bytes, high_text
from nodeguard.actuators.restore import Outcome, restore_all, restore_record
from nodeguard.errors import ActuationRefused, CgroupGone, ParseError
from nodeguard.log import RateLimiter, get_logger
from nodeguard.model.samples import CpuMax
from nodeguard.model.snapshot import Snapshot
from nodeguard.policy.actions import Evict, MemoryAction, MemoryRestore, MemoryThrottle, Restore, Reweigh, Throttle
from nodeguard.policy.outcome import Held, Moves, QuotaOutcome, Refusal, Unchanged
from nodeguard.policy.planner import Plan
from nodeguard.policy.state import GuardState
from nodeguard.sources.cgroupfs import parse_cpu_max

log = get_logger("nodeguard.executor")

Spawn = Callable[[Coroutine[Any, Any, None], str], None]
QuotaAction = Throttle | Restore
QUOTA, WEIGHT, MEMORY = QuotaLever.name, WeightLever.name, MemoryHighLever.name


@dataclass
class ActionCounters:
    # (kind, metric, dry_run) -> count
    actions: dict[tuple[str, str, bool], int] = field(default_factory=dict)
    failed: int = 0
    failed_restores: int = 0  # of ``failed``: quotas raised or put back, weights put back, that the kernel refused
    withheld: int = 0  # changes not written because the ledger could not be saved first
    moved_originals: int = 0  # values changed behind nodeguard and taken as the new original

    def count(self, kind: str, metric: str, dry_run: bool) -> None:
        key = (kind, metric, dry_run)
        self.actions[key] = self.actions.get(key, 0) + 1


@dataclass(frozen=True, slots=True)
class Carried:
    """What one pass of carrying out a plan did: for the policy to fold, and every change made (for Events)."""

    outcome: QuotaOutcome
    done: list[Done] = field(default_factory=list)


@dataclass(frozen=True, slots=True)
class MemoryCarried:
    """What one pass made of a plan's memory.high changes."""

    unchanged: Unchanged = field(default_factory=Unchanged)
    written: dict[str, int | None] = field(default_factory=dict)
    released: frozenset[str] = frozenset()
    refused_throttles: bool = False
    done: list[Done] = field(default_factory=list)


@dataclass(frozen=True, slots=True)
class Reweighed:
    unchanged: Unchanged
    done: list[Done] = field(default_factory=list)


def _unchanged(results: Results) -> Unchanged:
    refused = {group: Refusal(r.error, r.file, r.detail) for (_, group), r in results.refused.items()}
    return Unchanged(refused, frozenset(c.group for c in results.withheld), frozenset(g for _, g in results.gone))


def _moves(moves: drift.Moves) -> Moves:
    originals = {group: parse_cpu_max(value) for (lever, group), value in moves.originals.items() if lever == QUOTA}
    memory = {group: high_bytes(value) for (lever, group), value in moves.originals.items() if lever == MEMORY}
    return Moves(originals, frozenset(moves.released), memory)


def _held(record: LeverRecord) -> Held:
    if record.lever == MEMORY:
        applied = high_bytes(record.applied)
        values = None if applied is None else (high_bytes(record.original), applied)
        return Held(MEMORY, record.group, record.reason, memory=values)
    if record.lever != QUOTA:
        return Held(record.lever, record.group, record.reason)
    return Held(QUOTA, record.group, record.reason, parse_cpu_max(record.original), parse_cpu_max(record.applied))


class Executor:
    def __init__(
        self,
        levers: Mapping[str, Lever],
        evictor: Evictor,
        ledger: Ledger,
        spawn: Spawn,
    ) -> None:
        self.levers = levers
        self.evictor = evictor
        self.ledger = ledger
        self.changer = Changer(ledger, levers)
        self.spawn = spawn
        self.counters = ActionCounters()
        self.evicting: set[str] = set()
        self._failed_evictions: set[str] = set()
        self._errors = RateLimiter(60.0)

    @property
    def quota(self) -> QuotaLever:
        lever = self.levers[QUOTA]
        assert isinstance(lever, QuotaLever)
        return lever

    @property
    def weights(self) -> WeightLever:
        lever = self.levers[WEIGHT]
        assert isinstance(lever, WeightLever)
        return lever

    # --- the tick ---------------------------------------------------------------

    def carry_out(
        self,
        plan: Plan,
        before: GuardState,
        snapshot: Snapshot,
        *,
        done: Mapping[str, CpuMax] | None = None,
        final: bool = True,
        done_memory: Mapping[str, int | None] | None = None,
    ) -> Carried:
        """Make the plan's quota changes (and, when ``final``, its evictions and the drift checks).

        ``before`` is the state the plan started from; ``done`` the limits (and
        ``done_memory`` the memory.high values) an earlier pass of this tick
        wrote already. Unless ``final``, a pass with refused throttles stops
        before evictions: the caller plans again.
        """
        done = done or {}
        memory = self._carry_memory(plan, before, done_memory or {})
        for workload_id in plan.departed:
            self._departed(workload_id)
        quota_actions = [a for a in plan.actions if isinstance(a, Throttle | Restore)]
        for action in quota_actions:
            if action.dry_run:
                self._log(action, "dry run: would")
        real = [a for a in quota_actions if not a.dry_run and done.get(a.workload_id) != a.quota]
        changes = [self._quota_change(a, before, done) for a in real]
        results = self.changer.apply(changes) if changes else Results()
        written = self._report_quotas(real, results)
        unchanged = _unchanged(results)
        released = frozenset(d.change.group for d in results.done if d.change.release)
        refused_throttles = any(isinstance(a, Throttle) and a.workload_id in unchanged.refused for a in real)
        refused_throttles |= memory.refused_throttles
        if refused_throttles and not final:
            outcome = QuotaOutcome(unchanged, written, released, memory=memory.unchanged,
                                   memory_written=memory.written, memory_released=memory.released)  # fmt: skip
            return Carried(outcome, [*results.done, *memory.done])
        for eviction in plan.actions:
            if isinstance(eviction, Evict):
                self._evict(eviction)
        skip = {(QUOTA, w) for w in written} | {(MEMORY, w) for w in memory.written}
        moves = self._reassert(snapshot, skip=skip)
        failed, self._failed_evictions = frozenset(self._failed_evictions), set()
        if real or plan.departed or memory.done:
            self._save("after writing")
        outcome = QuotaOutcome(unchanged, written, released, moves, failed, memory=memory.unchanged,
                               memory_written=memory.written, memory_released=memory.released)  # fmt: skip
        return Carried(outcome, [*results.done, *memory.done])

    def _departed(self, workload_id: str) -> None:
        """A held workload the snapshot no longer shows: forgotten where its group left, its originals put back
        where the group is still there (discovery no longer lists it, or its read failed this tick), so no quota
        or memory.high outlives nodeguard's record of it."""
        for name in (QUOTA, MEMORY):
            record = self.ledger.get(name, workload_id)
            lever = self.levers.get(name)
            if record is None or lever is None:
                continue
            outcome = restore_record(lever, record)
            if outcome is not Outcome.FAILED:
                self.ledger.forget(record.key)
            if outcome in (Outcome.RESTORED, Outcome.CHANGED):
                log.info(f"{lever.noun} of a workload no longer seen put back", workload=workload_id,
                         outcome=outcome.value)  # fmt: skip

    def _quota_change(self, action: QuotaAction, before: GuardState, done: Mapping[str, CpuMax]) -> Change:
        held = before.throttles.get(action.workload_id)
        drifted = None if held is None or action.workload_id in done else held.quota.render_v2()
        full = isinstance(action, Restore) and action.full
        return Change(QUOTA, action.workload_id, action.quota.render_v2(), action.original.render_v2(), full,
                      action.kind, str(action.metric), drifted, action)  # fmt: skip

    def _report_quotas(self, actions: list[QuotaAction], results: Results) -> dict[str, CpuMax]:
        """Log and count what the changes did; the limits written, per workload."""
        by_id = {a.workload_id: a for a in actions}
        for (_, group), refusal in results.refused.items():
            self._refused(by_id[group], refusal)
        self._withheld(results.withheld, results.unsaved)
        written: dict[str, CpuMax] = {}
        for made in results.done:
            action = by_id[made.change.group]
            written[made.change.group] = parse_cpu_max(made.after)
            self.counters.count(action.kind, str(action.metric), False)
            self._log(action, "", children=made.children)
        return written

    def _refused(self, action: QuotaAction | Reweigh | MemoryAction, refusal: WriteRefused) -> None:
        self.counters.failed += 1
        if isinstance(action, Restore | MemoryRestore) or (isinstance(action, Reweigh) and not action.lower):
            self.counters.failed_restores += 1
        group = action.group if isinstance(action, Reweigh) else action.workload_id
        if self._errors.allow(f"{group}:{refusal.error}"):
            memory = isinstance(action, MemoryThrottle | MemoryRestore)
            noun = "weight" if isinstance(action, Reweigh) else "memory.high" if memory else "quota"
            log.error(
                f"{noun} write refused", workload=group, action=action.kind, file=refusal.file,
                cgroup=refusal.path, error=refusal.error, detail=refusal.detail,
            )  # fmt: skip

    def _withheld(self, changes: list[Change], error: str | None) -> None:
        if not changes:
            return
        self.counters.withheld += len(changes)
        if self._errors.allow("ledger:withheld"):
            log.error(
                "ledger cannot be saved: changes withheld (restores still happen)", file=self.ledger.path, error=error,
                withheld=[f"{c.kind} {c.group} to {c.target}" for c in changes],
            )  # fmt: skip

    def _save(self, when: str) -> bool:
        try:
            self.ledger.save()
        except LedgerUnsaved as exc:
            if self._errors.allow(f"ledger:{exc.errno_name}"):
                log.error("cannot save the ledger", file=exc.path, error=exc.errno_name, when=when)
            return False
        return True

    def _log(self, action: QuotaAction | Evict, prefix: str, **extra: object) -> None:
        if prefix:
            self.counters.count(action.kind, str(action.metric), True)
        fields: dict[str, object] = {
            "workload": action.workload_id,
            "metric": str(action.metric),
            "reason": action.reason,
            "gap": action.gap_before,
            "predicted_release": action.predicted_release,
            **{k: v for k, v in extra.items() if v},
        }
        if isinstance(action, Throttle | Restore):
            fields.update(quota=action.quota.render_v2(), previous=action.previous.render_v2())
        log.info(f"{prefix} {action.kind}".strip(), **fields)

    # --- memory.high (throttle objectives on memory metrics) --------------------------

    def _carry_memory(self, plan: Plan, before: GuardState, done: Mapping[str, int | None]) -> MemoryCarried:
        """Make the plan's memory.high changes (ledger first) in one batch of their own; what became of them."""
        asked = [a for a in plan.actions if isinstance(a, MemoryThrottle | MemoryRestore)]
        for action in asked:
            if action.dry_run:
                self._log_memory(action, "dry run: would")
        real = [a for a in asked if not a.dry_run and not (a.workload_id in done and done[a.workload_id] == a.high)]
        if not real or MEMORY not in self.levers:
            return MemoryCarried()
        changes = [self._memory_change(a, before, done) for a in real]
        results = self.changer.apply(changes)
        by_id = {a.workload_id: a for a in real}
        for (_, group), refusal in results.refused.items():
            self._refused(by_id[group], refusal)
        self._withheld(results.withheld, results.unsaved)
        written: dict[str, int | None] = {}
        for made in results.done:
            action = by_id[made.change.group]
            written[made.change.group] = high_bytes(made.after)
            self.counters.count(action.kind, str(action.metric), False)
            self._log_memory(action, "")
        unchanged = _unchanged(results)
        return MemoryCarried(
            unchanged,
            written,
            frozenset(d.change.group for d in results.done if d.change.release),
            any(isinstance(a, MemoryThrottle) and a.workload_id in unchanged.refused for a in real),
            results.done,
        )

    def _memory_change(self, action: MemoryAction, before: GuardState, done: Mapping[str, int | None]) -> Change:
        held = before.memory.get(action.workload_id)
        drifted = None if held is None or action.workload_id in done else high_text(held.high)
        full = isinstance(action, MemoryRestore) and action.full
        return Change(MEMORY, action.workload_id, high_text(action.high), high_text(action.original), full,
                      action.kind, str(action.metric), drifted, action)  # fmt: skip

    def _log_memory(self, action: MemoryAction, prefix: str) -> None:
        if prefix:
            self.counters.count(action.kind, str(action.metric), True)
        log.info(
            f"{prefix} {action.kind}".strip(), workload=action.workload_id, metric=str(action.metric),
            reason=action.reason, gap=action.gap_before, predicted_release=action.predicted_release,
            memory_high=high_text(action.high), previous=high_text(action.previous),
        )  # fmt: skip

    # --- values changed behind nodeguard ---------------------------------------------

    def _seen(self, snapshot: Snapshot) -> drift.Seen:
        def seen(record: LeverRecord) -> str | None:
            if record.lever == MEMORY:
                found = snapshot.workloads.get(record.group)
                high = None if found is None else found.memory_high
                return None if high is None else ("max" if high == float("inf") else str(int(high)))
            if record.lever != QUOTA:
                return None
            usage = snapshot.workloads.get(record.group)
            return None if usage is None or usage.cpu_max is None else usage.cpu_max.render_v2()

        return seen

    def adopt_moves(self, snapshot: Snapshot, skip: Collection[Key] = ()) -> Moves:
        """Before planning: a held value someone set to a new one (an in-place resize) is the new original.

        Neither nodeguard's value nor the recorded original: the ledger and the
        state take it as the original, so the plan keeps the hold under it
        and a restore gives it back, not the stale one. A new value that holds
        the group back as much leaves nothing to hold.
        """
        moves = drift.adopt_moves(self.ledger, self.levers, self._seen(snapshot), skip)
        self.counters.moved_originals += len(moves.originals) + moves.children
        if moves.released:
            self._save("releasing a resized workload")
        return _moves(moves)

    def _reassert(self, snapshot: Snapshot, skip: Collection[Key]) -> Moves:
        """After acting: put back every held value kubelet (or anyone) reset: drift. ``skip``: written now."""
        moves = self.adopt_moves(snapshot, skip)
        for key, error in drift.reassert(self.ledger, self.levers, self._seen(snapshot), skip).items():
            self.counters.failed += 1
            if self._errors.allow(f"{key}:reassert"):
                log.error(f"cannot re-assert {self.levers[key[0]].noun}", group=key[1], error=error)
        return moves

    # --- CPU weights (protected_cpu_stall) ------------------------------------------

    def reweigh(self, plan: Plan) -> Reweighed:
        """Lower or put back the plan's weights (ledger first); what did not happen, for the policy to fold."""
        changes: list[Change] = []
        actions: dict[str, Reweigh] = {}
        for action in plan.reweighs:
            if action.dry_run:
                self.counters.count(action.kind, str(action.metric), True)
                log.info("dry run: would reweigh", group=action.group, lower=action.lower, reason=action.reason)
                continue
            change = self._weight_change(action)
            if change is not None:
                changes.append(change)
                actions[action.group] = action
        if not changes:
            return Reweighed(Unchanged())
        results = self.changer.apply(changes)
        self._withheld(results.withheld, results.unsaved)
        for (_, group), refusal in results.refused.items():
            self._refused(actions[group], refusal)
        for made in results.done:
            action = actions[made.change.group]
            self.counters.count(action.kind, str(action.metric), False)
            log.info("reweigh", group=action.group, weight=int(made.after), original=self._original(made),
                     file=self.weights.file_of_value(int(made.after)), restored=not action.lower,
                     workloads=list(action.workloads), reason=action.reason)  # fmt: skip
        self._save("after reweighing")
        return Reweighed(_unchanged(results), results.done)

    def _weight_change(self, action: Reweigh) -> Change | None:
        held = self.ledger.get(WEIGHT, action.group)
        if not action.lower:
            if held is None:
                return None
            return Change(WEIGHT, action.group, held.original, held.original, True, action.kind, str(action.metric),
                          asked=action)  # fmt: skip
        try:
            least = self.weights.least_for(action.group)
        except (CgroupGone, OSError, ActuationRefused, ParseError):
            least = self.weights.least
        return Change(WEIGHT, action.group, str(least), None, False, action.kind, str(action.metric), asked=action)

    def _original(self, made: Done) -> int:
        record = self.ledger.get(made.change.lever, made.change.group)
        return int(made.before if record is None else record.original)

    # --- evictions ---------------------------------------------------------------

    def _evict(self, action: Evict) -> None:
        if action.dry_run:
            self._log(action, "dry run: would")
            return
        if action.workload_id in self.evicting:
            return
        self.counters.count("evict", str(action.metric), False)
        self.evicting.add(action.workload_id)
        self.spawn(self._run_eviction(action), f"evict:{action.workload_id}")

    async def _run_eviction(self, action: Evict) -> None:
        try:
            gone = await self.evictor.evict(
                action.workload_id, metric=str(action.metric), gap=action.gap_before, reason=action.reason
            )
        except Exception as exc:  # an evictor bug must not end the daemon
            log.error("eviction failed", workload=action.workload_id, error=str(exc), exc_info=True)
            gone = False
        finally:
            self.evicting.discard(action.workload_id)
        if not gone:
            self.counters.failed += 1
            self._failed_evictions.add(action.workload_id)

    # --- start and stop ----------------------------------------------------------

    def adopt(self) -> Iterable[Held]:
        """Keep holding every lever's ledger records that are still in place; forget the rest."""
        kept = drift.adopt(self.ledger, self.levers)
        records = [_held(r) for r in kept]
        self._save("adopting")
        return records

    def restore_everything(self) -> dict[Outcome, list[str]]:
        return restore_all(self.ledger, self.levers)
