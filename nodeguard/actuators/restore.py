"""Putting quotas back: on exit, at start-up, and from ``nodeguard restore --all``."""

from __future__ import annotations

import time
from collections import defaultdict
from enum import StrEnum

from nodeguard.actuators.cpu_quota import QuotaWriter
from nodeguard.actuators.ledger import Ledger, LedgerEntry
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
    except CgroupGone:
        return Outcome.GONE
    except (OSError, ParseError, ActuationRefused) as exc:
        log.error("cannot read quota to restore", workload=entry.workload_id, error=str(exc))
        return Outcome.FAILED
    if current == entry.original_limit:
        return Outcome.ALREADY
    if not entry.is_ours(current):
        log.warning(
            "quota changed by someone else since nodeguard set it; keeping theirs",
            workload=entry.workload_id,
            current=current.render_v2(),
            applied=entry.applied,
        )
        return Outcome.CHANGED
    try:
        quota.apply(entry.workload_id, entry.original_limit, reason="restore")
    except CgroupGone:
        return Outcome.GONE
    except (OSError, ActuationRefused) as exc:
        log.error("restore refused by the kernel", workload=entry.workload_id, error=str(exc))
        return Outcome.FAILED
    return Outcome.RESTORED


def restore_all(ledger: Ledger, quota: QuotaWriter) -> dict[Outcome, list[str]]:
    """Restore every entry; all but failed ones leave the ledger, which is saved."""
    outcomes: dict[Outcome, list[str]] = defaultdict(list)
    for entry in list(ledger.entries.values()):
        outcome = restore_entry(quota, entry)
        outcomes[outcome].append(entry.workload_id)
        if outcome is not Outcome.FAILED and not quota.writer.dry_run:
            ledger.forget(entry.workload_id)
    if not quota.writer.dry_run:
        ledger.save()
    return dict(outcomes)


def entry_for(workload_id: str, version: str, original: CpuMax, applied: CpuMax, reason: str) -> LedgerEntry:
    return LedgerEntry(workload_id, version, original.render_v2(), applied.render_v2(), reason, time.time())
