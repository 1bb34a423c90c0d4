"""Carrying out a plan: every lever's changes in one batch (ledger first, see ``changes``), and evictions.

The executor knows no lever by name: a change names its lever, and the lever
does the rest. A write the kernel refuses releases nothing: the executor
says so in the policy's terms (``policy.outcome.Applied``) and the tick
(``nodeguard.guard_tick``) plans again without the group, so the next
candidates close the gap. Folding what happened into the guard state is the
policy's.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Coroutine, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from nodeguard.actuators import drift
from nodeguard.actuators.changes import Changer, Done, Results
from nodeguard.actuators.evictors import Evictor
from nodeguard.actuators.ledger import Ledger, LedgerUnsaved, LeverRecord
from nodeguard.actuators.levers.base import Lever, WriteRefused
from nodeguard.actuators.restore import Outcome, restore_all, restore_record
from nodeguard.log import RateLimiter, get_logger
from nodeguard.model.levers import LeverChange, LeverKey
from nodeguard.model.snapshot import Snapshot
from nodeguard.policy.actions import Evict
from nodeguard.policy.outcome import Applied, Kept, MovedOriginals, Refusal

log = get_logger("nodeguard.executor")

Spawn = Callable[[Coroutine[Any, Any, None], str], None]


@dataclass
class ActionCounters:
    # (kind, metric, dry_run) -> count
    actions: dict[tuple[str, str, bool], int] = field(default_factory=dict)
    failed: int = 0
    failed_restores: int = 0  # of ``failed``: give-backs (a value raised or put back) that the kernel refused
    withheld: int = 0  # changes not written because the ledger could not be saved first
    moved_originals: int = 0  # values changed behind nodeguard and taken as the new original

    def count(self, kind: str, metric: str, dry_run: bool) -> None:
        key = (kind, metric, dry_run)
        self.actions[key] = self.actions.get(key, 0) + 1


@dataclass(frozen=True, slots=True)
class Pass:
    """What one pass made of its changes: for the policy to fold, and every change made (for Events)."""

    applied: Applied
    done: list[Done] = field(default_factory=list)


def _applied(results: Results) -> Applied:
    return Applied(
        written={d.change.key: d.after for d in results.done},
        refused={key: Refusal(r.error, r.file, r.detail) for key, r in results.refused.items()},
        withheld=frozenset(c.key for c in results.withheld),
        gone=frozenset(results.gone),
        released=frozenset(d.change.key for d in results.done if d.change.release),
    )


def _who(change: LeverChange) -> dict[str, str]:
    """How a log line names the change's group: a workload, or a group that is not one (a QoS tier)."""
    return {"workload" if change.workload is not None else "group": change.group}


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
        self._ended: list[Done] = []  # holds released without a write, for the tick's upkeep (ended_holds)
        self._errors = RateLimiter(60.0)

    # --- lever changes ------------------------------------------------------------

    def apply(self, changes: Sequence[LeverChange], written: Mapping[LeverKey, str] | None = None) -> Pass:
        """Make a pass's changes, of any lever, in one batch: the ledger saved once before the kernel is written.

        Dry runs are not made (``dry_run`` logs them); a change to the value an earlier pass of the tick wrote
        (``written``) is not made twice.
        """
        written = written or {}
        real = [c for c in changes if not c.dry_run and (c.target is None or written.get(c.key) != c.target)]
        if not real:
            return Pass(Applied())
        results = self.changer.apply(real)
        by_key = {c.key: c for c in real}
        for key, refusal in results.refused.items():
            self._refused(by_key[key], refusal)
        self._withheld(results.withheld, results.unsaved)
        for made in results.done:
            self.counters.count(made.change.kind, made.change.metric, False)
            self._log(made.change, "", value=made.after, before=made.before, children=made.children)
        return Pass(_applied(results), results.done)

    def dry_run(self, changes: Iterable[LeverChange | Evict]) -> None:
        """Log and count what a dry run would do."""
        for change in changes:
            if change.dry_run:
                self.counters.count(change.kind, str(change.metric), True)
                if isinstance(change, Evict):
                    log.info(
                        "dry run: would evict", workload=change.workload_id, metric=str(change.metric),
                        reason=change.reason, gap=change.gap_before, predicted_release=change.predicted_release,
                    )  # fmt: skip
                else:
                    self._log(change, "dry run: would", value=change.target)

    def give_back(self, groups: Iterable[str]) -> list[Done]:
        """Workloads the snapshot no longer shows: every lever's hold forgotten where its group left, its original
        put back where the group is still there (discovery no longer lists it, or its read failed this tick), so
        no value outlives nodeguard's record of it. Returns the values put back."""
        given: list[Done] = []
        for group in groups:
            for lever in self.levers.values():
                record = self.ledger.get(lever.name, group)
                if record is None:
                    continue
                outcome = restore_record(lever, record)
                if outcome is not Outcome.FAILED:
                    self.ledger.forget(record.key)
                if outcome in (Outcome.RESTORED, Outcome.CHANGED):
                    log.info(f"{lever.noun} of a workload no longer seen put back", workload=group,
                             outcome=outcome.value)  # fmt: skip
                if outcome is not Outcome.FAILED:
                    given.append(_given_back(lever, record, outcome))
        return given

    def _refused(self, change: LeverChange, refusal: WriteRefused) -> None:
        self.counters.failed += 1
        if not change.holds_back:
            self.counters.failed_restores += 1
        if self._errors.allow(f"{change.group}:{refusal.error}"):
            log.error(
                f"{self.levers[change.lever].noun} write refused", **_who(change), action=change.kind,
                file=refusal.file, cgroup=refusal.path, error=refusal.error, detail=refusal.detail,
            )  # fmt: skip

    def _withheld(self, changes: list[LeverChange], error: str | None) -> None:
        if not changes:
            return
        self.counters.withheld += len(changes)
        if self._errors.allow("ledger:withheld"):
            log.error(
                "ledger cannot be saved: changes withheld (restores still happen)", file=self.ledger.path, error=error,
                withheld=[f"{c.kind} {c.group} to {c.target}" for c in changes],
            )  # fmt: skip

    def save(self, when: str) -> bool:
        try:
            self.ledger.save()
        except LedgerUnsaved as exc:
            if self._errors.allow(f"ledger:{exc.errno_name}"):
                log.error("cannot save the ledger", file=exc.path, error=exc.errno_name, when=when)
            return False
        return True

    def _log(self, change: LeverChange, prefix: str, *, value: str | None, **extra: object) -> None:
        lever = self.levers.get(change.lever)
        shown = (lambda text: text) if lever is None else lever.shown
        fields: dict[str, object] = {
            **_who(change),
            "lever": change.lever,
            "metric": change.metric,
            "reason": change.reason,
            "gap": change.gap_before,
            "predicted_release": change.predicted_release,
            "value": None if value is None else shown(value),
            "previous": None if change.previous is None else shown(change.previous),
            "workloads": list(change.workloads),
            **extra,
        }
        log.info(f"{prefix} {change.kind}".strip(), **{k: v for k, v in fields.items() if v not in (None, [], 0)})

    # --- values changed behind nodeguard ---------------------------------------------

    def _seen(self, snapshot: Snapshot) -> drift.Seen:
        def seen(record: LeverRecord) -> str | None:
            usage = snapshot.workloads.get(record.group)
            lever = self.levers.get(record.lever)
            return None if usage is None or lever is None else lever.seen(usage)

        return seen

    def moved_originals(self, snapshot: Snapshot) -> MovedOriginals:
        """Before planning: a held value someone set to a new one (an in-place resize) is the new original.

        Neither nodeguard's value nor the recorded original: the ledger and the
        state take it as the original, so the plan keeps the hold under it
        and a restore gives it back, not the stale one. A new value that holds
        the group back as much leaves nothing to hold.
        """
        moves = drift.adopt_moves(self.ledger, self.levers, self._seen(snapshot))
        self._ended.extend(moves.ended)
        self.counters.moved_originals += len(moves.originals) + moves.children
        if moves.released:
            self.save("releasing a resized workload")
        return MovedOriginals(dict(moves.originals), frozenset(moves.released))

    def ended_holds(self) -> list[Done]:
        """The holds released without a write since the last call: a group gone, a new original that holds it back
        as much (``moved_originals``)."""
        ended, self._ended = self._ended, []
        return ended

    def reassert(self, snapshot: Snapshot, skip: Collection[LeverKey]) -> list[Done]:
        """After acting: put back every held value kubelet (or anyone) reset: drift. ``skip``: written now. Returns
        the values put back."""
        reasserted = drift.reassert(self.ledger, self.levers, self._seen(snapshot), skip)
        for key, error in reasserted.failed.items():
            self.counters.failed += 1
            if self._errors.allow(f"{key}:reassert"):
                log.error(f"cannot re-assert {self.levers[key[0]].noun}", group=key[1], error=error)
        done = []
        for made in reasserted.done:
            usage = snapshot.workloads.get(made.change.group)
            done.append(made if usage is None else replace(made, change=made.change._replace(workload=usage.workload)))
        return done

    # --- evictions ---------------------------------------------------------------

    def evict(self, actions: Iterable[Evict]) -> None:
        for action in actions:
            if action.dry_run or action.workload_id in self.evicting:
                continue
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

    def failed_evictions(self) -> frozenset[str]:
        """The evictions that did not go through since the last call."""
        failed, self._failed_evictions = frozenset(self._failed_evictions), set()
        return failed

    # --- start and stop ----------------------------------------------------------

    def adopt(self) -> list[Kept]:
        """Keep holding every lever's ledger records that are still in place; forget the rest."""
        kept = [Kept(r.lever, r.group, r.reason, r.original, r.holds) for r in drift.adopt(self.ledger, self.levers)]
        self.save("adopting")
        return kept

    def restore_everything(self) -> dict[Outcome, list[str]]:
        return restore_all(self.ledger, self.levers)


def _given_back(lever: Lever, record: LeverRecord, outcome: Outcome) -> Done:
    """A hold of a workload no longer seen, ended: its original written back, or (nothing written) found there
    already, someone else's value kept, or its cgroup gone."""
    why = {
        Outcome.RESTORED: "put back",
        Outcome.ALREADY: "already back",
        Outcome.CHANGED: "someone else set it since",
        Outcome.GONE: "its cgroup is gone",
    }[outcome]
    reason = f"its workload is no longer seen: {why}"
    if outcome in (Outcome.RESTORED, Outcome.ALREADY):
        children = len(record.children) if outcome is Outcome.RESTORED else 0
        return drift.ended(lever, record, reason, after=record.original, children=children)
    return drift.ended(lever, record, reason, shown="someone else's value, kept" if outcome is Outcome.CHANGED else why)
