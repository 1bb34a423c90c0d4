"""Values changed behind nodeguard, and the ledger at start, the same way for every lever.

Someone may change a value nodeguard holds: kubelet puts a pod's limit or a
tier's weight back (the recorded original: drift, re-asserted) or sets a new
one (an in-place resize, a new tier weight: the new original, kept under the
hold, given back by a restore). A new original that holds the group back as
much as nodeguard's value leaves nothing to hold.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass, field, replace

from nodeguard.actuators.changes import Done, child_originals, recorded
from nodeguard.actuators.ledger import Ledger, LedgerUnsaved, LeverRecord, Ownership
from nodeguard.actuators.levers.base import Lever, WriteRefused, note_drift
from nodeguard.errors import ActuationRefused, CgroupGone, ParseError
from nodeguard.log import get_logger
from nodeguard.model.levers import LeverChange, LeverKey

log = get_logger("nodeguard.drift")

# What a lever's group holds now, where the tick's snapshot already says so (None: read it).
Seen = Callable[[LeverRecord], str | None]
_UNREADABLE = (CgroupGone, OSError, ParseError, ActuationRefused, ValueError)


@dataclass
class Moves:
    """Originals that moved, and records released because a new original holds the group back enough."""

    originals: dict[LeverKey, str] = field(default_factory=dict)
    released: set[LeverKey] = field(default_factory=set)
    children: int = 0
    ended: list[Done] = field(default_factory=list)  # the released holds, as the decision history tells them


def ended(lever: Lever, record: LeverRecord, why: str, *, after: str = "", shown: str = "", children: int = 0) -> Done:
    """The end of a hold (kind ``give_back``, a release): ``after`` the value written back ("" when nothing was
    written: ``shown`` says what is there instead), ``why`` its reason."""
    change = LeverChange(record.lever, record.group, after or None, None, release=True, holds_back=False,
                         kind="give_back", metric=record.reason, reason=why)  # fmt: skip
    return Done(change, record.holds, after, children, False, (lever.shown(record.holds), shown or lever.shown(after)))


def adopt_moves(ledger: Ledger, levers: Mapping[str, Lever], seen: Seen, skip: Collection[LeverKey] = ()) -> Moves:
    """A value someone set that is neither nodeguard's nor the recorded original is the new original."""
    moves = Moves()
    for record in ledger:
        if record.key in skip or record.lever not in levers:
            continue
        lever = levers[record.lever]
        current = seen(record)
        if current is not None and record.is_ours(current) and not record.children:
            continue  # the common case: nothing to read, nothing to do
        try:
            _adopt(ledger, lever, record, lever.read(record.group) if current is None else current, moves)
        except CgroupGone:  # the group left (a tier's last pod went): nothing of it to hold or restore
            ledger.forget(record.key)
            moves.released.add(record.key)
            moves.ended.append(ended(lever, record, "its cgroup is gone", shown="its cgroup is gone"))
        except _UNREADABLE:
            continue  # read again next tick
    return moves


def _adopt(ledger: Ledger, lever: Lever, record: LeverRecord, current: str, moves: Moves) -> None:
    if record.ownership(current) is Ownership.MOVED:
        ledger.move_original(record.key, current)
        moves.originals[record.key] = current
        lever.writer.counters.overwritten[lever.name] += 1
        log.warning(
            f"{lever.noun} changed behind nodeguard: taken as the new original",
            group=record.group, original=current, was=record.original,
        )  # fmt: skip
        if not lever.restricts(record.holds, current):
            ledger.forget(record.key)
            moves.released.add(record.key)
            why = "someone set a value that holds it back as much"
            moves.ended.append(ended(lever, record, why, shown=f"{lever.shown(current)}, someone else's"))
            return
    for path, child in record.children.items():
        try:
            found = lever.read(path)
        except CgroupGone:
            continue
        if child.ownership(found) is Ownership.MOVED:
            moves.children += 1
            ledger.move_original(record.key, found, child=path)
            lever.writer.counters.overwritten[lever.name] += 1


@dataclass
class Reasserted:
    """What putting back drifted values did: the values put back, and the records that could not be (why)."""

    done: list[Done] = field(default_factory=list)
    failed: dict[LeverKey, str] = field(default_factory=dict)


def reassert(ledger: Ledger, levers: Mapping[str, Lever], seen: Seen, skip: Collection[LeverKey] = ()) -> Reasserted:
    """Put nodeguard's value back wherever someone changed it (the ledger first)."""
    result = Reasserted()
    for record in ledger:
        if record.key in skip or record.lever not in levers:
            continue
        current = seen(record)
        if current is not None and record.is_ours(current) and not record.children:
            continue
        try:
            made = _put_back(ledger, levers[record.lever], record)
        except CgroupGone:
            continue
        except (*_UNREADABLE, WriteRefused) as exc:
            result.failed[record.key] = str(exc)
            continue
        if made is not None:
            result.done.append(made)
    return result


def _put_back(ledger: Ledger, lever: Lever, record: LeverRecord) -> Done | None:
    """The held value written again where someone changed it; None when nothing needed writing (or the ledger could
    not be saved first)."""
    change = LeverChange(record.lever, record.group, record.holds, record.original, release=False, holds_back=True,
                         kind="reassert", metric=record.reason, reason="put back after someone changed it")  # fmt: skip
    current, writes = lever.plan(record.group, record.holds, child_originals(ledger, record.key))
    if not writes:
        return None
    ledger.record(recorded(ledger, lever, change, current, writes, pending=True))
    try:
        ledger.save()
    except LedgerUnsaved:
        ledger.records[record.key] = record
        return None
    context = note_drift(lever, record.group, current, record.applied, {"action": "reassert"})
    if current == record.applied:  # the group's own value is right: a child's was changed
        note_drift(lever, writes[0].path, writes[0].before, writes[0].after, {"action": "reassert"})
    lever.perform(writes, **context)
    ledger.record(recorded(ledger, lever, change, current, writes, pending=False))
    below = sum(1 for w in writes if w.path != record.group)
    restricts = lever.restricts(record.holds, current)
    return Done(change, current, record.holds, below, restricts, (lever.shown(current), lever.shown(record.holds)))


def adopt(ledger: Ledger, levers: Mapping[str, Lever]) -> list[LeverRecord]:
    """At start: keep holding the records whose values are still nodeguard's; forget the rest."""
    kept: list[LeverRecord] = []
    for record in ledger:
        lever = levers.get(record.lever)
        if lever is None:
            continue
        try:
            current = lever.read(record.group)
        except CgroupGone:
            ledger.forget(record.key)
            continue
        except _UNREADABLE as exc:
            log.error(f"cannot read a ledger record's {lever.noun}; leaving it", group=record.group, error=str(exc))
            continue
        if record.cgroup_version != lever.version or not record.is_ours(current):
            log.warning(f"ledger {lever.noun} no longer ours; forgotten", group=record.group)
            ledger.forget(record.key)
            continue
        adopted = replace(record, applied=current, pending=None)
        ledger.records[record.key] = adopted
        kept.append(adopted)
    return kept
