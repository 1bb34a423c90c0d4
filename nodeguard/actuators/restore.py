"""Putting limits back: on exit, at start-up, and from ``nodeguard restore --all``.

A limit is put back only where the kernel still holds nodeguard's value: one
that someone else changed since (an in-place resize, an operator) is theirs,
and kept. The workload's own limit is raised before its children's (cgroup
v1 refuses a child above its parent).
"""

from __future__ import annotations

from collections import defaultdict
from enum import StrEnum

from nodeguard.actuators.cpu_quota import LimitRefused, QuotaWriter
from nodeguard.actuators.cpu_weight import WeightWriter
from nodeguard.actuators.ledger import Ledger, LedgerEntry, LedgerUnsaved, Ownership, WeightRecord
from nodeguard.errors import ActuationRefused, CgroupGone, ParseError
from nodeguard.log import get_logger
from nodeguard.model.samples import CpuMax

log = get_logger("nodeguard.restore")


class Outcome(StrEnum):
    RESTORED = "restored"  # it had nodeguard's value; the original is back
    ALREADY = "already"  # it had the original already
    CHANGED = "changed"  # someone else set another value since: theirs is kept
    GONE = "gone"  # the workload left
    FAILED = "failed"  # the kernel refused; the entry stays


def restore_entry(quota: QuotaWriter, entry: LedgerEntry) -> Outcome:
    if entry.cgroup_version != quota.version:
        log.warning("ledger entry from another cgroup version; left alone", workload=entry.workload_id)
        return Outcome.FAILED
    try:
        current = quota.read(entry.workload_id)
        ownership = entry.ownership(current)
        target = entry.original_limit if ownership is Ownership.OURS else current
        originals: dict[str, CpuMax] = {}
        for path, record in entry.children.items():
            try:
                now = quota.read(path)
            except CgroupGone:
                continue
            originals[path] = now if record.ownership(now) is Ownership.MOVED else record.original_limit
        _, writes = quota.plan(entry.workload_id, target, originals)
        if ownership is Ownership.MOVED:
            log.warning(
                "quota changed by someone else since nodeguard set it; keeping theirs",
                workload=entry.workload_id, current=current.render_v2(), applied=entry.applied,
            )  # fmt: skip
        if not writes:
            return Outcome.CHANGED if ownership is Ownership.MOVED else Outcome.ALREADY
        quota.perform(writes, reason="restore")
    except CgroupGone:
        return Outcome.GONE
    except (OSError, ParseError, ActuationRefused, LimitRefused) as exc:
        log.error("restore refused", workload=entry.workload_id, error=str(exc))
        return Outcome.FAILED
    return Outcome.CHANGED if ownership is Ownership.MOVED else Outcome.RESTORED


def restore_weight(weights: WeightWriter, record: WeightRecord) -> Outcome:
    """Put a group's original weight back where the kernel still holds nodeguard's."""
    if record.cgroup_version != weights.version:
        log.warning("ledger weight from another cgroup version; left alone", group=record.group)
        return Outcome.FAILED
    try:
        current = weights.read(record.group)
        if current == record.original:
            return Outcome.ALREADY
        if not record.is_ours(current):
            log.warning("weight changed by someone else since nodeguard set it; keeping theirs",
                        group=record.group, current=current, applied=record.applied)  # fmt: skip
            return Outcome.CHANGED
        weights.write(record.group, record.original, reason="restore")
    except CgroupGone:
        return Outcome.GONE
    except (OSError, ParseError, ActuationRefused) as exc:
        log.error("weight restore refused", group=record.group, error=str(exc))
        return Outcome.FAILED
    return Outcome.RESTORED


def restore_all(ledger: Ledger, quota: QuotaWriter, weights: WeightWriter | None = None) -> dict[Outcome, list[str]]:
    """Restore every entry (and with ``weights``, every lowered weight); all but failed ones leave the ledger,
    which is saved if it can be.

    The kernel files are written first: a ledger that cannot be saved (a full
    disk) never blocks a restore, it only keeps entries a later start finds
    already restored.
    """
    outcomes: dict[Outcome, list[str]] = defaultdict(list)
    for entry in list(ledger.entries.values()):
        outcome = restore_entry(quota, entry)
        outcomes[outcome].append(entry.workload_id)
        if outcome is not Outcome.FAILED and not quota.writer.dry_run:
            ledger.forget(entry.workload_id)
    for record in list(ledger.weights.values()):
        if weights is None:
            break
        outcome = restore_weight(weights, record)
        outcomes[outcome].append(record.group)
        if outcome is not Outcome.FAILED and not quota.writer.dry_run:
            del ledger.weights[record.group]
    if not quota.writer.dry_run:
        try:
            ledger.save()
        except LedgerUnsaved as exc:
            log.error("restored, but cannot save the ledger", file=exc.path, error=exc.errno_name)
    return dict(outcomes)
