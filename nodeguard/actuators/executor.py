"""Carrying out a plan: quota writes and evictions, with the ledger kept first.

Order matters for crash safety: every limit about to be written is saved in
the ledger (and fsynced) *before* the kernel file, so a daemon killed at any
moment leaves no throttle that the ledger does not know.

A write the kernel refuses releases nothing: the workload is held back with
the refusal's cause and the daemon plans the same tick again without it
(``Carried.refused``), so the next candidates close the gap. Evictions start
only once a pass has no refusals left.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Collection, Coroutine, Mapping
from dataclasses import dataclass, field, replace
from typing import Any

from nodeguard.actuators.cpu_quota import LimitRefused, LimitWrite, QuotaWriter, rate_above, refusal
from nodeguard.actuators.cpu_weight import WeightWriter
from nodeguard.actuators.evictors import Evictor
from nodeguard.actuators.ledger import Ledger, LedgerEntry, LedgerUnsaved, LimitRecord, Ownership, WeightRecord
from nodeguard.actuators.restore import Outcome, restore_all, restore_weight
from nodeguard.errors import ActuationRefused, CgroupGone, ParseError
from nodeguard.log import RateLimiter, get_logger
from nodeguard.model.samples import CpuMax
from nodeguard.model.snapshot import Snapshot
from nodeguard.policy.actions import Evict, Restore, Reweigh, Throttle
from nodeguard.policy.metrics import Metric
from nodeguard.policy.planner import Plan
from nodeguard.policy.state import GuardState, HeldBack, HeldThrottle, LoweredWeight, held_back_after

log = get_logger("nodeguard.executor")

Spawn = Callable[[Coroutine[Any, Any, None], str], None]
QuotaAction = Throttle | Restore


@dataclass
class ActionCounters:
    # (kind, metric, dry_run) -> count
    actions: dict[tuple[str, str, bool], int] = field(default_factory=dict)
    failed: int = 0
    withheld: int = 0  # throttles not written because the ledger could not be saved first
    moved_originals: int = 0  # limits changed behind nodeguard and taken as the new original

    def count(self, kind: str, metric: str, dry_run: bool) -> None:
        key = (kind, metric, dry_run)
        self.actions[key] = self.actions.get(key, 0) + 1


@dataclass(frozen=True, slots=True)
class HoldTimes:
    """How long a workload whose write was refused is held back: doubling from ``first`` to ``longest`` seconds."""

    first: float = 30.0
    longest: float = 600.0


@dataclass
class Carried:
    """What one pass of carrying out a plan did."""

    state: GuardState  # the state as the kernel now is (meaningful when ``refused`` is empty or the pass was final)
    refused: dict[str, HeldBack]  # throttles refused in this pass: plan again without them
    written: dict[str, CpuMax]  # workload limits written in this pass


@dataclass
class _Pass:
    """Scratch for one carry_out call."""

    before: GuardState  # what the plan started from
    state: GuardState  # what the kernel is becoming
    done: Mapping[str, CpuMax]  # written by an earlier pass of this tick
    now: float  # monotonic
    refused: dict[str, HeldBack] = field(default_factory=dict)
    written: dict[str, CpuMax] = field(default_factory=dict)

    def hold(self, workload_id: str, held: HeldThrottle | None) -> None:
        self.state = _with_throttle(self.state, workload_id, held)


def _with_throttle(state: GuardState, workload_id: str, held: HeldThrottle | None) -> GuardState:
    throttles = dict(state.throttles)
    if held is None:
        throttles.pop(workload_id, None)
    else:
        throttles[workload_id] = held
    return replace(state, throttles=throttles)


class Executor:
    def __init__(
        self,
        quota: QuotaWriter,
        evictor: Evictor,
        ledger: Ledger,
        spawn: Spawn,
        holds: HoldTimes | None = None,
        *,
        weights: WeightWriter | None = None,
    ) -> None:
        self.quota = quota
        self.weights = weights or WeightWriter(quota.writer, quota.version)
        self.evictor = evictor
        self.ledger = ledger
        self.spawn = spawn
        self.holds = holds or HoldTimes()
        self.counters = ActionCounters()
        self.evicting: set[str] = set()
        self._failed_evictions: set[str] = set()
        self._errors = RateLimiter(60.0)

    # --- the tick ---------------------------------------------------------------

    def carry_out(
        self,
        plan: Plan,
        before: GuardState,
        snapshot: Snapshot,
        *,
        done: Mapping[str, CpuMax] | None = None,
        final: bool = True,
    ) -> Carried:
        """Make the plan's changes.

        ``before`` is the state the plan started from; ``done`` the limits an
        earlier pass of this tick wrote already. Unless ``final``, a pass
        with refused throttles stops before evictions: the caller plans again.
        """
        tick = _Pass(before, plan.state, done or {}, plan.monotonic)
        for workload_id in plan.departed:
            self.ledger.forget(workload_id)
        quota_actions = [a for a in plan.actions if isinstance(a, Throttle | Restore)]
        for action in quota_actions:
            if action.dry_run:
                self._log(action, "dry run: would")
        real = [a for a in quota_actions if not a.dry_run and tick.done.get(a.workload_id) != a.quota]
        if real:
            self._write_all(real, tick)
        if tick.refused and not final:
            return Carried(tick.state, tick.refused, tick.written)
        for eviction in plan.actions:
            if isinstance(eviction, Evict):
                self._evict(eviction)
        state = self._reassert(snapshot, tick.state, skip=tick.written)
        for workload_id in self._failed_evictions:
            state = state.without_eviction(workload_id)
        self._failed_evictions.clear()
        state = state.with_held_back(tick.refused).without_held_back(tick.written)
        if real or plan.departed:
            self._save("after writing")
        return Carried(state, tick.refused, tick.written)

    def _write_all(self, actions: list[QuotaAction], tick: _Pass) -> None:
        prepared: list[tuple[QuotaAction, CpuMax, list[LimitWrite]]] = []
        for action in actions:
            workload_id = action.workload_id
            try:
                current, writes = self.quota.plan(workload_id, action.quota, self._child_originals(workload_id))
            except CgroupGone:
                self.ledger.forget(workload_id)
                tick.hold(workload_id, None)
                continue
            except (OSError, ParseError, ActuationRefused) as exc:
                self._refused(action, LimitRefused(workload_id, "cpu limit", type(exc).__name__, str(exc)), tick)
                continue
            prepared.append((action, current, writes))
        # Ledger first: every value about to be written is marked as ours.
        previous = {a.workload_id: self.ledger.entries.get(a.workload_id) for a, _, _ in prepared}
        for action, _, writes in prepared:
            self.ledger.record(self._entry(action, writes, pending=True))
        full_restores_only = False
        try:
            self.ledger.save()
        except LedgerUnsaved as exc:
            self._withhold(prepared, previous, tick, exc)
            full_restores_only = True
        for action, current, writes in prepared:
            if not full_restores_only:
                self._write(action, current, writes, tick)
            elif isinstance(action, Restore):
                self._restore_fully(action, current, writes, tick)

    def _restore_fully(self, action: Restore, current: CpuMax, writes: list[LimitWrite], tick: _Pass) -> None:
        """A step up that the ledger cannot mark as ours would strand a throttle it cannot recognise after a
        crash: give the original back instead (that needs no ledger)."""
        if not action.full:
            action = replace(action, quota=action.original, full=True)
            try:
                current, writes = self.quota.plan(
                    action.workload_id, action.quota, self._child_originals(action.workload_id)
                )
            except (CgroupGone, OSError, ParseError, ActuationRefused):
                return
            tick.hold(action.workload_id, None)
        self._write(action, current, writes, tick)

    def _child_originals(self, workload_id: str) -> dict[str, CpuMax]:
        held = self.ledger.entries.get(workload_id)
        return {} if held is None else {path: rec.original_limit for path, rec in held.children.items()}

    def _entry(self, action: QuotaAction, writes: list[LimitWrite], pending: bool) -> LedgerEntry:
        return self._recorded(
            action.workload_id, action.original, action.quota, writes, str(action.metric), pending=pending
        )

    def _recorded(
        self, workload_id: str, original: CpuMax, target: CpuMax, writes: list[LimitWrite], reason: str, *,
        pending: bool,
    ) -> LedgerEntry:  # fmt: skip
        """The ledger entry for a change: before it (``pending``: the new values marked as ours) or after it."""
        held = self.ledger.entries.get(workload_id)
        children = dict(held.children) if held is not None else {}
        for write in writes:
            if write.path == workload_id:
                continue
            old = children.get(write.path)
            first = old.original if old is not None else write.before.render_v2()
            after = write.after.render_v2()
            if pending:
                applied = old.applied if old is not None else after
                children[write.path] = LimitRecord(original=first, applied=applied, pending=after)
            elif after == first:
                children.pop(write.path, None)  # back to its original: nothing of ours left there
            else:
                children[write.path] = LimitRecord(original=first, applied=after)
        return LedgerEntry(
            original=original.render_v2(),
            applied=held.applied if held is not None and pending else target.render_v2(),
            pending=target.render_v2() if pending else None,
            workload_id=workload_id,
            cgroup_version="v2" if self.quota.version == "v2" else "v1",
            reason=reason,
            changed_at=time.time(),
            children=children,
        )

    def _withhold(
        self,
        prepared: list[tuple[QuotaAction, CpuMax, list[LimitWrite]]],
        previous: Mapping[str, LedgerEntry | None],
        tick: _Pass,
        exc: LedgerUnsaved,
    ) -> None:
        """The ledger cannot record what is about to change: no throttle is written, restores go all the way."""
        withheld = []
        for action, _, _ in prepared:
            workload_id = action.workload_id
            old = previous[workload_id]
            if isinstance(action, Restore):
                continue  # the original needs no ledger: written now, forgotten after
            if old is None:
                self.ledger.forget(workload_id)
            else:
                self.ledger.entries[workload_id] = old
            tick.hold(workload_id, tick.before.throttles.get(workload_id))
            withheld.append(f"{action.kind} {workload_id} to {action.quota.render_v2()}")
        self.counters.withheld += len(withheld)
        if withheld and self._errors.allow(f"ledger:{exc.errno_name}"):
            log.error(
                "ledger cannot be saved: throttles withheld (restores still happen)",
                file=exc.path, error=exc.errno_name, withheld=withheld,
            )  # fmt: skip

    def _write(self, action: QuotaAction, current: CpuMax, writes: list[LimitWrite], tick: _Pass) -> None:
        workload_id = action.workload_id
        held = tick.before.throttles.get(workload_id)
        context: dict[str, object] = {"action": action.kind, "metric": str(action.metric)}
        entry = self.ledger.entries.get(workload_id)
        # Put back to its original behind nodeguard's back (kubelet resyncing): drift this write also fixes.
        if (
            held is not None
            and workload_id not in tick.done
            and entry is not None
            and entry.ownership(current) is Ownership.ORIGINAL
        ):
            context = self.quota.note_drift(workload_id, current, held.quota, context)
        try:
            self.quota.perform(writes, reason=action.reason, **context)
        except CgroupGone:
            self.ledger.forget(workload_id)
            tick.hold(workload_id, None)
            return
        except LimitRefused as refusal:
            self._refused(action, refusal, tick)
            return
        tick.written[workload_id] = action.quota
        self.counters.count(action.kind, str(action.metric), False)
        self._log(action, "", children=len([w for w in writes if w.path != workload_id]))
        entry = self._entry(action, writes, pending=False)
        if isinstance(action, Restore) and action.full:
            self.ledger.forget(workload_id)
        else:
            self.ledger.record(entry)

    def _refused(self, action: QuotaAction, refusal: LimitRefused, tick: _Pass) -> None:
        workload_id = action.workload_id
        held = tick.before.throttles.get(workload_id)
        self.counters.failed += 1
        if self._errors.allow(f"{workload_id}:{refusal.error}"):
            log.error(
                "quota write refused", workload=workload_id, action=action.kind, file=refusal.file,
                cgroup=refusal.path, error=refusal.error, detail=refusal.detail,
            )  # fmt: skip
        old = self.ledger.entries.get(workload_id)
        if held is None:
            self.ledger.forget(workload_id)
        elif old is not None:
            children = {p: replace(c, pending=None) for p, c in old.children.items()}
            self.ledger.record(replace(old, pending=None, children=children))
        if isinstance(action, Throttle):
            tick.refused[workload_id] = held_back_after(
                tick.before.held_back.get(workload_id), workload_id, error=refusal.error, file=refusal.file,
                detail=refusal.detail, now=tick.now, first=self.holds.first, longest=self.holds.longest,
            )  # fmt: skip
        tick.hold(workload_id, held)

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

    # --- limits changed behind nodeguard -------------------------------------------

    def adopt_moves(self, snapshot: Snapshot, state: GuardState, skip: Collection[str] = ()) -> GuardState:
        """Before planning: a held limit someone set to a new value (an in-place resize) is the new original.

        Neither nodeguard's value nor the recorded original: the ledger and the
        throttle take it as the original, so the plan keeps the throttle under
        it and a restore gives it back, not the stale one. A new limit at or
        under the throttle leaves nothing to hold.
        """
        for workload_id, held in list(state.throttles.items()):
            usage = snapshot.workloads.get(workload_id)
            entry = self.ledger.entries.get(workload_id)
            if usage is None or usage.cpu_max is None or entry is None or workload_id in skip:
                continue
            if usage.cpu_max == held.quota and not entry.children:
                continue  # the common case: nothing to read, nothing to do
            try:
                state = self._adopt_moves(workload_id, held, entry, usage.cpu_max, state)
            except (CgroupGone, OSError, ParseError, ActuationRefused):
                continue  # read again next tick
        return state

    def _adopt_moves(
        self, workload_id: str, held: HeldThrottle, entry: LedgerEntry, current: CpuMax, state: GuardState
    ) -> GuardState:
        if entry.ownership(current) is Ownership.MOVED:
            self.counters.moved_originals += 1
            self.ledger.move_original(workload_id, current)
            log.warning(
                "limit changed behind nodeguard: taken as the new original",
                workload=workload_id, original=current.render_v2(), was=entry.original,
            )  # fmt: skip
            if not rate_above(current, held.quota):
                self.ledger.forget(workload_id)
                self._save("releasing a resized workload")
                return _with_throttle(state, workload_id, None)
            state = _with_throttle(state, workload_id, replace(held, original=current))
        for path, record in entry.children.items():
            try:
                found = self.quota.read(path)
            except CgroupGone:
                continue
            if record.ownership(found) is Ownership.MOVED:
                self.counters.moved_originals += 1
                self.ledger.move_original(workload_id, found, child=path)
        return state

    def _reassert(self, snapshot: Snapshot, state: GuardState, skip: Collection[str]) -> GuardState:
        """After acting: put back every held limit kubelet (or anyone) reset to its original: drift.

        ``skip``: written this tick, so the snapshot's reading of them is stale.
        """
        state = self.adopt_moves(snapshot, state, skip)
        for workload_id, held in list(state.throttles.items()):
            if workload_id in skip:
                continue
            usage = snapshot.workloads.get(workload_id)
            entry = self.ledger.entries.get(workload_id)
            if usage is None or usage.cpu_max is None or entry is None:
                continue
            if usage.cpu_max == held.quota and not entry.children:
                continue
            try:
                self._put_back(workload_id, held, entry)
            except CgroupGone:
                continue
            except (OSError, ParseError, ActuationRefused, LimitRefused) as exc:
                self.counters.failed += 1
                if self._errors.allow(f"{workload_id}:reassert"):
                    log.error("cannot re-assert quota", workload=workload_id, error=str(exc))
        return state

    def _put_back(self, workload_id: str, held: HeldThrottle, entry: LedgerEntry) -> None:
        current, writes = self.quota.plan(workload_id, held.quota, self._child_originals(workload_id))
        if not writes:
            return
        self.ledger.record(self._recorded(workload_id, held.original, held.quota, writes, entry.reason, pending=True))
        if not self._save("before re-asserting"):
            self.ledger.entries[workload_id] = entry
            return
        context = self.quota.note_drift(workload_id, current, held.quota, {"action": "reassert"})
        if current == held.quota:  # the workload's own limit is right: a child's was changed
            self.quota.note_drift(writes[0].path, writes[0].before, writes[0].after, {"action": "reassert"})
        self.quota.perform(writes, **context)
        self.ledger.record(self._recorded(workload_id, held.original, held.quota, writes, entry.reason, pending=False))

    # --- CPU weights (protected_cpu_stall) ------------------------------------------

    def reweigh(self, plan: Plan, state: GuardState) -> GuardState:
        """Lower or put back the plan's weights (ledger first), and re-assert the others that drifted.

        A group whose weight the kernel refused is held back like a workload whose quota was (the planner
        then goes on to the quota lever).
        """
        lowered = dict(state.lowered)
        refused: dict[str, HeldBack] = {}
        touched: set[str] = set()
        for action in plan.reweighs:
            if action.dry_run:
                self.counters.count(action.kind, str(action.metric), True)
                log.info("dry run: would reweigh", group=action.group, lower=action.lower, reason=action.reason)
                continue
            touched.add(action.group)
            if action.lower:
                try:
                    if not self._lower_weight(action):
                        lowered.pop(action.group, None)
                except LimitRefused as exc:
                    lowered.pop(action.group, None)
                    self._weight_failed(action.group, "lower", exc)
                    refused[action.group] = held_back_after(
                        state.held_back.get(action.group), action.group, error=exc.error, file=exc.file,
                        detail=exc.detail, now=plan.monotonic, first=self.holds.first, longest=self.holds.longest,
                    )  # fmt: skip
            else:
                self._weight_back(action)
        for group in lowered.keys() - touched:
            if not self._reassert_weight(group):
                lowered.pop(group, None)
        return replace(state, lowered=lowered).with_held_back(refused)

    def _lower_weight(self, action: Reweigh) -> bool:
        group = action.group
        held = self.ledger.weights.get(group)
        try:
            current = self.weights.read(group)
        except CgroupGone:
            self.ledger.weights.pop(group, None)
            return False
        except ParseError as exc:
            raise LimitRefused(group, self.weights.file.name, "unparsable", str(exc)) from None
        except (OSError, ActuationRefused) as exc:
            raise refusal(group, self.weights.file.name, exc) from None
        original = held.original if held is not None else current
        least = self.weights.least  # known once a group was read: cpu.idle or not
        self.ledger.weights[group] = WeightRecord(
            group=group, cgroup_version="v2" if self.weights.version == "v2" else "v1", original=original,
            applied=held.applied if held is not None else current, pending=least, reason=action.reason,
            changed_at=time.time(),
        )  # fmt: skip
        if not self._save("before lowering a weight"):
            self._forget_weight(group, held)
            self.counters.withheld += 1
            return False
        try:
            self.weights.write(group, least, action=action.kind, reason=action.reason)
        except CgroupGone:
            self.ledger.weights.pop(group, None)
            self._save("a group left")
            return False
        except (OSError, ActuationRefused) as exc:
            self._forget_weight(group, held)
            self._save("a weight refused")
            raise refusal(group, self.weights.file_of(least), exc) from None
        self.ledger.weights[group] = replace(self.ledger.weights[group], applied=least, pending=None)
        self._save("after lowering a weight")
        self.counters.count(action.kind, str(action.metric), False)
        log.info("reweigh", group=group, weight=least, original=original, file=self.weights.file_of(least),
                 workloads=list(action.workloads), reason=action.reason)  # fmt: skip
        return True

    def _forget_weight(self, group: str, held: WeightRecord | None) -> None:
        if held is None:
            self.ledger.weights.pop(group, None)
        else:
            self.ledger.weights[group] = held

    def _weight_back(self, action: Reweigh) -> None:
        record = self.ledger.weights.get(action.group)
        if record is None:
            return
        outcome = restore_weight(self.weights, record)
        if outcome is Outcome.FAILED:
            self.counters.failed += 1
            return
        del self.ledger.weights[action.group]
        self._save("after putting a weight back")
        self.counters.count(action.kind, str(action.metric), False)
        log.info("reweigh", group=action.group, weight=record.original, restored=True, reason=action.reason)

    def _reassert_weight(self, group: str) -> bool:
        """A lowered weight someone rewrote (kubelet, as pods come and go) is theirs to keep as the original;
        nodeguard's goes back. False when the group is gone or nothing of it is recorded."""
        record = self.ledger.weights.get(group)
        if record is None:
            return False
        try:
            current = self.weights.read(group)
            if record.is_ours(current):
                return True
            self.ledger.weights[group] = replace(record, original=current, pending=record.applied)
            if not self._save("before re-asserting a weight"):
                self.ledger.weights[group] = record
                return True
            self.quota.writer.counters.drift += 1
            log.warning("weight drift re-asserted", group=group, found=current, weight=record.applied)
            self.weights.write(group, record.applied, action="reassert")
        except CgroupGone:
            self.ledger.weights.pop(group, None)
            self._save("a group left")
            return False
        except (OSError, ParseError, ActuationRefused) as exc:
            self._weight_failed(group, "reassert", exc)
            return True
        self.ledger.weights[group] = replace(self.ledger.weights[group], pending=None)
        self._save("after re-asserting a weight")
        return True

    def _weight_failed(self, group: str, what: str, exc: Exception) -> bool:
        self.counters.failed += 1
        if self._errors.allow(f"{group}:weight:{what}"):
            log.error("weight change refused", group=group, step=what, file=self.weights.file.name, error=str(exc))
        return False

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

    def adopt(self, now: float) -> GuardState:
        """Keep holding the ledger's throttles that are still in place; forget the rest."""
        throttles: dict[str, HeldThrottle] = {}
        for entry in list(self.ledger.entries.values()):
            try:
                current = self.quota.read(entry.workload_id)
            except CgroupGone:
                self.ledger.forget(entry.workload_id)
                continue
            except (OSError, ActuationRefused, ParseError) as exc:
                log.error("cannot read a ledger entry's quota; leaving it", workload=entry.workload_id, error=str(exc))
                continue
            if entry.cgroup_version != self.quota.version or not entry.is_ours(current):
                log.warning("ledger entry no longer ours; forgotten", workload=entry.workload_id)
                self.ledger.forget(entry.workload_id)
                continue
            reasons = frozenset({Metric(entry.reason)}) if entry.reason in Metric._value2member_map_ else frozenset()
            throttles[entry.workload_id] = HeldThrottle(entry.workload_id, entry.original_limit, current, reasons, now)
            self.ledger.record(replace(entry, applied=current.render_v2(), pending=None))
        lowered: dict[str, LoweredWeight] = {}
        for record in list(self.ledger.weights.values()):
            try:
                weight: int | None = self.weights.read(record.group)
            except (CgroupGone, OSError, ActuationRefused, ParseError):
                weight = None
            if weight is None or record.cgroup_version != self.weights.version or not record.is_ours(weight):
                log.warning("ledger weight no longer ours; forgotten", group=record.group)
                del self.ledger.weights[record.group]
                continue
            lowered[record.group] = LoweredWeight(record.group, now)
            self.ledger.weights[record.group] = replace(record, applied=weight, pending=None)
        self._save("adopting")
        return GuardState(throttles=throttles, lowered=lowered)

    def restore_everything(self) -> dict[Outcome, list[str]]:
        return restore_all(self.ledger, self.quota, self.weights)
