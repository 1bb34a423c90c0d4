"""What the ledger says nodeguard holds: ``nodeguard held``, and the records as /status shows them.

``nodeguard held`` reads the ledger file without the daemon, the kernel or the
node's lock, so it answers while the daemon is down (after a SIGKILL, before a
``restore --all``) and while one runs. It reads the file as a start would
(``parse_ledger``, every record checked by its lever), without what a start
does besides: it neither sets an unreadable file aside nor copies rejected
records beside it, and leaves the daemon's directory as it found it.
"""

from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass
from typing import Any

from nodeguard.actuators import levers
from nodeguard.actuators.cgroup_writer import CgroupWriter
from nodeguard.actuators.ledger import MAX_LEDGER_BYTES, LeverRecord, parse_ledger
from nodeguard.actuators.levers.base import Lever
from nodeguard.atomic_file import UnsafeFile, read_state_file
from nodeguard.errors import NodeguardError


class LedgerUnreadable(NodeguardError):
    """The ledger file is there but cannot be read: a start would set it aside and restore nothing from it."""


@dataclass(frozen=True)
class Rejected:
    """A record a start would set aside, not restore: its group (if it names one) and what is wrong with it."""

    group: str | None
    problem: str


@dataclass(frozen=True)
class LedgerReading:
    """The ledger's records as a start would take them, and the ones it would reject."""

    path: str
    found: bool  # False: no file (nothing recorded)
    records: tuple[LeverRecord, ...]
    rejected: tuple[Rejected, ...]


def record_view(record: LeverRecord, lever: Lever) -> dict[str, Any]:
    """One held group as /status and ``nodeguard held --json`` show it: the values as the ledger keeps them
    (``applied`` is the value the group is held at), and for people."""
    return {
        "original": record.original,
        "applied": record.holds,
        "shown": {"original": lever.shown(record.original), "applied": lever.shown(record.holds)},
        "reason": record.reason,
        "since": record.changed_at,
        "children": {p: {"original": c.original, "applied": c.applied} for p, c in record.children.items()},
    }


def read_ledger(path: str) -> LedgerReading:
    """The ledger at ``path``, read without changing anything there; LedgerUnreadable when a start could not use it."""
    try:
        raw = read_state_file(path, MAX_LEDGER_BYTES)
    except FileNotFoundError:
        return LedgerReading(path, False, (), ())
    except UnsafeFile as exc:
        raise LedgerUnreadable(f"{path}: {exc.reason}") from None
    try:
        parsed = parse_ledger(raw)
    except ValueError as exc:
        raise LedgerUnreadable(
            f"{path}: not a ledger nodeguard can read ({exc}); a start or `restore --all` would set it aside and "
            "restore nothing from it"
        ) from None
    rejected = tuple(Rejected(r.group, r.problem) for r in parsed.rejected)
    return LedgerReading(path, True, tuple(parsed.records.values()), rejected)


def _levers(version: str) -> dict[str, Lever]:
    """The levers of a cgroup version, only to show their values: their writer is a dry run, and never used."""
    return levers.build(CgroupWriter(os.sep, dry_run=True), version)


def held_data(reading: LedgerReading) -> dict[str, Any]:
    """``nodeguard held --json``: every lever's held groups as /status's ``held`` shows them, and the rejected."""
    shown = {version: _levers(version) for version in ("v1", "v2")}
    held: dict[str, dict[str, Any]] = {name: {} for name in levers.NAMES}
    for record in reading.records:
        held[record.lever][record.group] = record_view(record, shown[record.cgroup_version][record.lever])
    return {
        "ledger": reading.path,
        "held": held,
        "rejected": [{"group": r.group, "problem": r.problem} for r in reading.rejected],
    }


def _when(seconds: float) -> str:
    return "an unknown time" if seconds <= 0 else time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(seconds))


def render_held(reading: LedgerReading) -> str:
    """For people: one line a held group (its lever, value held, original, since when, why), one a child."""
    if not reading.found:
        return f"{reading.path}: no ledger; nothing is recorded as held"
    shown = {version: _levers(version) for version in ("v1", "v2")}
    count = len(reading.records)
    lines = [f"{reading.path}: " + (f"{count} hold{'s' if count > 1 else ''}" if count else "nothing held")]
    for record in sorted(reading.records, key=lambda r: (r.lever, r.group)):
        lever = shown[record.cgroup_version][record.lever]
        lines.append(
            f"{record.lever:11} {record.group}: held at {lever.shown(record.holds)}, original "
            f"{lever.shown(record.original)}, since {_when(record.changed_at)}"
            + (f"; for {record.reason}" if record.reason else "")
        )
        for path, child in sorted(record.children.items()):
            lines.append(
                f"{'':11}   child {path}: {lever.shown(child.applied)}, original {lever.shown(child.original)}"
            )
    for rejected in reading.rejected:
        lines.append(f"rejected    {rejected.group or '(no group)'}: {rejected.problem}; a start would not restore it")
    return "\n".join(lines)


def show_held(path: str, as_json: bool) -> bool:
    """Print the ledger at ``path``; False when some of its records cannot be read (LedgerUnreadable: none)."""
    reading = read_ledger(path)
    print(json.dumps(held_data(reading)) if as_json else render_held(reading))
    return not reading.rejected
