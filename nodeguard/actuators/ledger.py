"""The ledger of originals: every quota nodeguard changed, and what it was before.

A JSON file (default /run/nodeguard/ledger.json) written atomically: a
temporary file in the same directory, fsync, rename, fsync of the directory.
It outlives the daemon, so ``nodeguard restore --all`` works while it is down,
and a restarted daemon can tell its own throttles from anybody else's.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
from collections.abc import Iterator, Mapping
from dataclasses import asdict, dataclass, replace
from typing import Any

from nodeguard.atomic_file import set_aside, write_atomic
from nodeguard.errors import NodeguardError
from nodeguard.log import get_logger
from nodeguard.model.samples import CpuMax
from nodeguard.sources.cgroupfs import parse_cpu_max

log = get_logger("nodeguard.ledger")

LEDGER_VERSION = 1


@dataclass(frozen=True, slots=True)
class LedgerEntry:
    workload_id: str
    cgroup_version: str
    original: str  # cpu.max format, "max 100000" for unlimited (v1 values converted)
    applied: str
    reason: str
    changed_at: float  # wall-clock seconds
    # A value about to be written: saved before the write so that a crash
    # between the two still leaves the kernel's value recognisable as ours.
    pending: str | None = None

    def is_ours(self, current: CpuMax) -> bool:
        return current == self.applied_limit or (self.pending is not None and current == parse_cpu_max(self.pending))

    @property
    def original_limit(self) -> CpuMax:
        return parse_cpu_max(self.original)

    @property
    def applied_limit(self) -> CpuMax:
        return parse_cpu_max(self.applied)


class LedgerBusy(NodeguardError):
    """Another nodeguard process holds the ledger."""


class Ledger:
    def __init__(self, path: str) -> None:
        self.path = path
        self.entries: dict[str, LedgerEntry] = {}
        self.set_aside: str | None = None  # where a corrupt file was moved

    @classmethod
    def load(cls, path: str) -> Ledger:
        """Read the ledger; a corrupt or foreign file is renamed aside and reported, never deleted."""
        ledger = cls(path)
        try:
            with open(path, encoding="utf-8") as handle:
                text = handle.read()
        except FileNotFoundError:
            return ledger
        try:
            ledger.entries = _decode(json.loads(text))
        except (ValueError, TypeError, KeyError) as exc:
            aside = set_aside(path)
            ledger.set_aside = aside
            log.error("ledger unreadable; kept aside, starting without it", path=path, kept_as=aside, error=str(exc))
        return ledger

    def record(self, entry: LedgerEntry) -> None:
        """Add or update an entry; the first original of a workload is never overwritten."""
        held = self.entries.get(entry.workload_id)
        if held is not None:
            entry = replace(entry, cgroup_version=held.cgroup_version, original=held.original)
        self.entries[entry.workload_id] = entry

    def forget(self, workload_id: str) -> None:
        self.entries.pop(workload_id, None)

    def save(self) -> None:
        os.makedirs(os.path.dirname(self.path) or ".", mode=0o750, exist_ok=True)
        payload = {"version": LEDGER_VERSION, "entries": [asdict(e) for e in self.entries.values()]}
        write_atomic(self.path, json.dumps(payload, indent=1, sort_keys=True).encode())


def _decode(data: Any) -> dict[str, LedgerEntry]:
    if not isinstance(data, Mapping) or data.get("version") != LEDGER_VERSION:
        raise ValueError(f"not a version {LEDGER_VERSION} ledger")
    entries = {}
    for raw in data["entries"]:
        entry = LedgerEntry(
            workload_id=str(raw["workload_id"]),
            cgroup_version=str(raw["cgroup_version"]),
            original=str(raw["original"]),
            applied=str(raw["applied"]),
            reason=str(raw["reason"]),
            changed_at=float(raw["changed_at"]),
            pending=None if raw.get("pending") is None else str(raw["pending"]),
        )
        entry.original_limit  # noqa: B018 - validates both limits now, not at restore time
        entry.applied_limit  # noqa: B018
        if entry.pending is not None:
            parse_cpu_max(entry.pending)
        entries[entry.workload_id] = entry
    return entries


@contextlib.contextmanager
def exclusive(path: str) -> Iterator[None]:
    """Hold the lock beside the ledger: one nodeguard acts on a node at a time."""
    directory = os.path.dirname(path) or "."
    os.makedirs(directory, mode=0o750, exist_ok=True)
    fd = os.open(path + ".lock", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o640)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise LedgerBusy(f"{path}.lock is held by another nodeguard process") from None
        yield
    finally:
        os.close(fd)
