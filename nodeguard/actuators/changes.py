"""Changing a lever's value, the same way for every lever: the ledger first, then the kernel, then the record.

Order matters for crash safety: every value about to be written is saved in
the ledger (and fsynced) *before* the kernel file, so a daemon killed at any
moment leaves nothing changed that the ledger does not know. A batch of
changes is recorded with one save. When the ledger cannot be saved, nothing
that holds a group back is written; a change back to the original needs no
ledger and still happens.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace

from nodeguard.actuators.ledger import Held, Key, Ledger, LedgerUnsaved, LeverRecord, Ownership
from nodeguard.actuators.levers.base import Lever, Write, WriteRefused, note_drift, refusal
from nodeguard.errors import ActuationRefused, CgroupGone, ParseError
from nodeguard.policy.actions import MemoryRestore, MemoryThrottle, Restore, Reweigh, Throttle


@dataclass(frozen=True, slots=True)
class Change:
    """Set one group's value with one lever (the policy's request, in the lever's canonical text)."""

    lever: str
    group: str
    target: str  # for a release: the original the policy knows (a moved original is kept instead)
    original: str | None  # the value before nodeguard first changed it, as the policy knows it; None: the current
    release: bool  # back to the original: the record leaves the ledger after
    kind: str  # throttle, restore, lower, raise, reassert: for logs and counters
    reason: str  # the metric behind it
    # A value found in place of the one nodeguard holds is drift this write also fixes: noted as such.
    held: str | None = None
    # The plan's action behind it (for logs and Events).
    asked: Throttle | Restore | Reweigh | MemoryThrottle | MemoryRestore | None = None

    @property
    def key(self) -> Key:
        return (self.lever, self.group)


@dataclass(frozen=True, slots=True)
class Done:
    """A change made: what the group had, and has now."""

    change: Change
    before: str
    after: str
    children: int  # descendants changed with it
    holds_back: bool  # the new value holds the group back more than the one before (a throttle, a lowered weight)


@dataclass
class Results:
    """What became of a batch of changes."""

    done: list[Done] = field(default_factory=list)
    refused: dict[Key, WriteRefused] = field(default_factory=dict)
    gone: set[Key] = field(default_factory=set)
    withheld: list[Change] = field(default_factory=list)  # not written: the ledger could not be saved first
    unsaved: str | None = None  # why the ledger could not be saved (errno name), when changes were withheld


def recorded(
    ledger: Ledger, lever: Lever, change: Change, current: str, writes: Sequence[Write], *, pending: bool
) -> LeverRecord:
    """The ledger record for a change: before it (``pending``: the new values marked as ours) or after it."""
    held = ledger.get(change.lever, change.group)
    children = dict(held.children) if held is not None else {}
    for write in writes:
        if write.path == change.group:
            continue
        old = children.get(write.path)
        first = old.original if old is not None else write.before
        if pending:
            children[write.path] = Held(first, old.applied if old is not None else write.after, write.after)
        elif write.after == first:
            children.pop(write.path, None)  # back to its original: nothing of ours left there
        else:
            children[write.path] = Held(first, write.after)
    return LeverRecord(
        lever=change.lever,
        group=change.group,
        original=current if change.original is None else change.original,
        applied=held.applied if held is not None and pending else change.target,
        pending=change.target if pending else None,
        cgroup_version=lever.version,
        reason=change.reason,
        changed_at=time.time(),
        children=children,
    )


def child_originals(ledger: Ledger, key: Key) -> dict[str, str]:
    held = ledger.records.get(key)
    return {} if held is None else {path: child.original for path, child in held.children.items()}


class Changer:
    """Applies batches of changes to any registered lever, the ledger first."""

    def __init__(self, ledger: Ledger, levers: Mapping[str, Lever]) -> None:
        self.ledger = ledger
        self.levers = levers

    def apply(self, changes: Sequence[Change], **context: object) -> Results:
        results = Results()
        prepared: list[tuple[Change, str, list[Write]]] = []
        for asked in changes:
            lever = self.levers[asked.lever]
            change = asked
            try:
                change = self._settled(lever, asked)
                current, writes = lever.plan(change.group, change.target, child_originals(self.ledger, change.key))
            except CgroupGone:
                self.ledger.forget(change.key)
                results.gone.add(change.key)
                continue
            except (OSError, ActuationRefused) as exc:
                results.refused[change.key] = refusal(change.group, lever.main_file, exc)
                continue
            except (ParseError, ValueError) as exc:
                results.refused[change.key] = WriteRefused(change.group, lever.main_file, "unparsable", str(exc))
                continue
            prepared.append((change, current, writes))
        previous = {change.key: self.ledger.records.get(change.key) for change, _, _ in prepared}
        for change, current, writes in prepared:
            if writes:
                lever = self.levers[change.lever]
                self.ledger.record(recorded(self.ledger, lever, change, current, writes, pending=True))
        try:
            if any(writes for _, _, writes in prepared):
                self.ledger.save()
        except LedgerUnsaved as exc:
            results.unsaved = exc.errno_name
            prepared = self._withhold(prepared, previous, results)
        for change, current, writes in prepared:
            self._write(change, current, writes, previous[change.key], results, **context)
        return results

    def _settled(self, lever: Lever, change: Change) -> Change:
        """A release keeps a value someone else set since nodeguard's (theirs now), and otherwise the original."""
        held = self.ledger.get(change.lever, change.group)
        if not change.release or held is None:
            return change
        current = lever.read(change.group)
        if held.ownership(current) is Ownership.MOVED:
            return replace(change, target=current, original=current)
        return change

    def _withhold(
        self,
        prepared: list[tuple[Change, str, list[Write]]],
        previous: Mapping[Key, LeverRecord | None],
        results: Results,
    ) -> list[tuple[Change, str, list[Write]]]:
        """The ledger cannot record what is about to change: only releases (which need no ledger) go on.

        A step back up that the ledger cannot mark as ours would leave a value it cannot recognise after a
        crash: it becomes a release, all the way to the original.
        """
        kept = []
        for change, current, writes in prepared:
            old = previous[change.key]
            lever = self.levers[change.lever]
            if change.release:
                kept.append((change, current, writes))
                continue
            if old is not None and lever.restricts(current, change.target):
                release = replace(change, target=old.original, original=old.original, release=True)
                self.ledger.records[change.key] = old
                try:
                    now, back = lever.plan(release.group, release.target, child_originals(self.ledger, release.key))
                except (CgroupGone, OSError, ParseError, ActuationRefused, ValueError):
                    continue
                kept.append((release, now, back))
                continue
            if old is None:
                self.ledger.forget(change.key)
            else:
                self.ledger.records[change.key] = old
            results.withheld.append(change)
        return kept

    def _write(
        self,
        change: Change,
        current: str,
        writes: list[Write],
        previous: LeverRecord | None,
        results: Results,
        **context: object,
    ) -> None:
        lever = self.levers[change.lever]
        note = {"action": change.kind, "metric": change.reason, **context}
        if previous is not None and change.held is not None and previous.ownership(current) is Ownership.ORIGINAL:
            note = note_drift(lever, change.group, current, change.held, note)
        try:
            lever.perform(writes, **note)
        except CgroupGone:
            self.ledger.forget(change.key)
            results.gone.add(change.key)
            return
        except WriteRefused as refused:
            if previous is None:
                self.ledger.forget(change.key)
            else:
                children = {p: replace(c, pending=None) for p, c in previous.children.items()}
                self.ledger.records[change.key] = replace(previous, pending=None, children=children)
            results.refused[change.key] = refused
            return
        if change.release:
            self.ledger.forget(change.key)
        else:
            self.ledger.record(recorded(self.ledger, lever, change, current, writes, pending=False))
        below = sum(1 for w in writes if w.path != change.group)
        results.done.append(Done(change, current, change.target, below, lever.restricts(change.target, current)))
