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

from nodeguard.actuators.ledger import HeldValue, Ledger, LedgerUnsaved, LeverRecord, Ownership
from nodeguard.actuators.levers.base import Lever, Write, WriteRefused, note_drift, refusal
from nodeguard.errors import ActuationRefused, CgroupGone, ParseError
from nodeguard.model.levers import LeverChange, LeverKey


@dataclass(frozen=True, slots=True)
class Done:
    """A change made: what the group had, and has now."""

    change: LeverChange
    before: str
    after: str
    children: int  # descendants changed with it
    holds_back: bool  # the new value holds the group back more than the one before (a throttle, a lowered weight)
    shown: tuple[str, str] = ("", "")  # before and after, as the lever shows values to people


@dataclass
class Results:
    """What became of a batch of changes."""

    done: list[Done] = field(default_factory=list)
    refused: dict[LeverKey, WriteRefused] = field(default_factory=dict)
    gone: set[LeverKey] = field(default_factory=set)
    withheld: list[LeverChange] = field(default_factory=list)  # not written: the ledger could not be saved first
    unsaved: str | None = None  # why the ledger could not be saved (errno name), when changes were withheld


def recorded(
    ledger: Ledger, lever: Lever, change: LeverChange, current: str, writes: Sequence[Write], *, pending: bool
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
            children[write.path] = HeldValue(first, old.applied if old is not None else write.after, write.after)
        elif write.after == first:
            children.pop(write.path, None)  # back to its original: nothing of ours left there
        else:
            children[write.path] = HeldValue(first, write.after)
    assert change.target is not None, "a change is resolved to its value before it is recorded"
    # The group's own value after the writes: the target, unless the lever holds it through its children alone.
    own = next((w.after for w in writes if w.path == change.group), current)
    return LeverRecord(
        lever=change.lever,
        group=change.group,
        original=current if change.give_back is None else change.give_back,
        applied=held.applied if held is not None and pending else own,
        pending=own if pending else None,
        cgroup_version=lever.version,
        reason=change.metric,
        changed_at=time.time(),
        children=children,
        effective=None if own == change.target else change.target,
    )


def child_originals(ledger: Ledger, key: LeverKey) -> dict[str, str]:
    """The recorded originals of the group's changed descendants, and of the group itself."""
    held = ledger.records.get(key)
    if held is None:
        return {}
    return {key[1]: held.original, **{path: child.original for path, child in held.children.items()}}


class Changer:
    """Applies batches of changes to any registered lever, the ledger first."""

    def __init__(self, ledger: Ledger, levers: Mapping[str, Lever]) -> None:
        self.ledger = ledger
        self.levers = levers

    def apply(self, changes: Sequence[LeverChange], **context: object) -> Results:
        results = Results()
        prepared: list[tuple[LeverChange, str, list[Write]]] = []
        for asked in changes:
            lever = self.levers[asked.lever]
            change = asked
            try:
                resolved = self._resolved(lever, asked)
                if resolved is None:
                    continue  # giving back what the ledger no longer holds: nothing to do
                change = self._settled(lever, resolved)
                assert change.target is not None
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

    def _resolved(self, lever: Lever, change: LeverChange) -> LeverChange | None:
        """A change with no value asks for the lever's strongest hold, or, as a release, for the recorded
        original (None: the ledger holds nothing of the group)."""
        if change.target is not None:
            target = lever.resolve(change.group, change.target)
            return change if target == change.target else change._replace(target=target)
        if not change.release:
            return change._replace(target=lever.strongest(change.group))
        held = self.ledger.get(change.lever, change.group)
        return None if held is None else change._replace(target=held.original, give_back=held.original)

    def _settled(self, lever: Lever, change: LeverChange) -> LeverChange:
        """A release keeps a value someone else set since nodeguard's (theirs now), and otherwise the original."""
        held = self.ledger.get(change.lever, change.group)
        if not change.release or held is None:
            return change
        current = lever.read(change.group)
        if held.ownership(current) is Ownership.MOVED:
            return change._replace(target=current, give_back=current)
        return change

    def _withhold(
        self,
        prepared: list[tuple[LeverChange, str, list[Write]]],
        previous: Mapping[LeverKey, LeverRecord | None],
        results: Results,
    ) -> list[tuple[LeverChange, str, list[Write]]]:
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
            assert change.target is not None
            if old is not None and lever.restricts(old.holds, change.target):
                release = change._replace(target=old.original, give_back=old.original, release=True)
                self.ledger.records[change.key] = old
                try:
                    now, back = lever.plan(release.group, old.original, child_originals(self.ledger, release.key))
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
        change: LeverChange,
        current: str,
        writes: list[Write],
        previous: LeverRecord | None,
        results: Results,
        **context: object,
    ) -> None:
        lever = self.levers[change.lever]
        note = {"action": change.kind, "metric": change.metric, **context}
        # A value found in place of the one nodeguard held is drift this write also fixes: noted as such.
        if previous is not None and change.previous is not None and previous.ownership(current) is Ownership.ORIGINAL:
            note = note_drift(lever, change.group, current, change.previous, note)
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
        assert change.target is not None
        before = current if previous is None or previous.effective is None else previous.effective
        restricts = lever.restricts(change.target, before)
        shown = (lever.shown(before), lever.shown(change.target))
        results.done.append(Done(change, before, change.target, below, restricts, shown))
