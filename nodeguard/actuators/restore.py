"""Putting values back: on exit, at start-up, and from ``nodeguard restore --all``, for every lever alike.

A value is put back only where the kernel still holds nodeguard's: one that
someone else changed since (an in-place resize, kubelet's new tier weight, an
operator) is theirs, and kept. The lever orders the writes (a quota's
workload is raised before its children: cgroup v1 refuses a child above its
parent).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Mapping
from enum import StrEnum

from nodeguard.actuators.ledger import Ledger, LedgerUnsaved, LeverRecord, Ownership
from nodeguard.actuators.levers.base import Lever, WriteRefused
from nodeguard.errors import ActuationRefused, CgroupGone, ParseError
from nodeguard.log import get_logger

log = get_logger("nodeguard.restore")


class Outcome(StrEnum):
    RESTORED = "restored"  # it had nodeguard's value; the original is back
    ALREADY = "already"  # it had the original already
    CHANGED = "changed"  # someone else set another value since: theirs is kept
    GONE = "gone"  # the group left
    FAILED = "failed"  # the kernel refused; the record stays


def restore_record(lever: Lever, record: LeverRecord, **context: object) -> Outcome:
    """Put one record's originals back where the kernel still holds nodeguard's values."""
    if record.cgroup_version != lever.version:
        log.warning("ledger record from another cgroup version; left alone", lever=record.lever, group=record.group)
        return Outcome.FAILED
    try:
        current = lever.read(record.group)
        ownership = record.ownership(current)
        target = record.original if ownership is Ownership.OURS else current
        originals: dict[str, str] = {}
        for path, child in record.children.items():
            try:
                now = lever.read(path)
            except CgroupGone:
                continue
            originals[path] = now if child.ownership(now) is Ownership.MOVED else child.original
        _, writes = lever.plan(record.group, target, originals)
        if ownership is Ownership.MOVED:
            log.warning(
                f"{lever.noun} changed by someone else since nodeguard set it; keeping theirs",
                group=record.group, current=current, applied=record.applied,
            )  # fmt: skip
        if not writes:
            return Outcome.CHANGED if ownership is Ownership.MOVED else Outcome.ALREADY
        lever.perform(writes, reason="restore", **context)
    except CgroupGone:
        return Outcome.GONE
    except (OSError, ParseError, ActuationRefused, WriteRefused, ValueError) as exc:
        log.error(f"{lever.noun} restore refused", group=record.group, error=str(exc))
        return Outcome.FAILED
    return Outcome.CHANGED if ownership is Ownership.MOVED else Outcome.RESTORED


def restore_all(ledger: Ledger, levers: Mapping[str, Lever]) -> dict[Outcome, list[str]]:
    """Restore every record of every lever; all but failed ones leave the ledger, which is saved if it can be.

    The kernel files are written first: a ledger that cannot be saved (a full
    disk) never blocks a restore, it only keeps records a later start finds
    already restored. A record of a lever not given here fails and stays.
    """
    outcomes: dict[Outcome, list[str]] = defaultdict(list)
    dry_run = any(lever.writer.dry_run for lever in levers.values())
    for record in ledger:
        lever = levers.get(record.lever)
        outcome = Outcome.FAILED if lever is None else restore_record(lever, record)
        outcomes[outcome].append(record.group)
        if outcome is not Outcome.FAILED and not dry_run:
            ledger.forget(record.key)
    if not dry_run:
        try:
            ledger.save()
        except LedgerUnsaved as exc:
            log.error("restored, but cannot save the ledger", file=exc.path, error=exc.errno_name)
    return dict(outcomes)
