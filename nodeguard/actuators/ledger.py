"""The ledger of originals: every value a lever changed, and what it was before.

A JSON file (default /run/nodeguard/ledger.json) written atomically: a
temporary file in the same directory, fsync, rename, fsync of the directory.
It outlives the daemon, so ``nodeguard restore --all`` works while it is down,
and a restarted daemon can tell its own changes from anybody else's.

One record shape for every lever (``levers.REGISTERED``): the lever, the
group, the original, the value applied, a value about to be written, and the
descendants changed with the group (cgroup v1 refuses a parent quota below a
child's, so children are capped first). Each record is checked on its own when
the file is read, its values by its lever: a bad record is set aside alone, in
a file beside the ledger, and the good ones are still restored. A version 1
ledger (quotas under ``entries``, weights under ``weights``) is read and
written back as version 2.
"""

from __future__ import annotations

import errno
import json
import os
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field, replace
from enum import StrEnum
from typing import Any, Literal

from pydantic import TypeAdapter, ValidationError

from nodeguard.actuators.levers import REGISTERED
from nodeguard.atomic_file import UnsafeFile, read_state_file, set_aside, write_atomic
from nodeguard.errors import NodeguardError
from nodeguard.log import get_logger
from nodeguard.model.levers import CPU_QUOTA, CPU_WEIGHT, LeverKey

log = get_logger("nodeguard.ledger")

LEDGER_VERSION = 2
MAX_LEDGER_BYTES = 64 << 20  # far above any real node (about 300 bytes a record)
_CHECKS = {kind.name: kind.check for kind in REGISTERED}


class Ownership(StrEnum):
    """Who set a value found in the kernel, as the ledger sees it."""

    OURS = "ours"  # nodeguard's value (applied, or about to be)
    ORIGINAL = "original"  # the recorded original: someone put it back (kubelet resyncing): drift
    MOVED = "moved"  # neither: someone set a new value (an in-place resize, kubelet's new tier weight)


@dataclass(frozen=True, slots=True)
class HeldValue:
    """One cgroup's value: before nodeguard, as nodeguard set it, and a write about to happen."""

    original: str  # the lever's canonical text
    applied: str
    # A value about to be written: saved before the write so that a crash
    # between the two still leaves the kernel's value recognisable as ours.
    pending: str | None = None

    def is_ours(self, current: str) -> bool:
        return current == self.applied or (self.pending is not None and current == self.pending)

    def ownership(self, current: str) -> Ownership:
        if self.is_ours(current):
            return Ownership.OURS
        if current == self.original:
            return Ownership.ORIGINAL
        return Ownership.MOVED


@dataclass(frozen=True, slots=True, kw_only=True)
class LeverRecord(HeldValue):
    """What one lever changed on one group (and on the descendants it had to change with it)."""

    lever: str
    group: str
    cgroup_version: Literal["v1", "v2"]
    reason: str = ""
    changed_at: float = 0.0  # wall-clock seconds
    # Descendant cgroups (paths relative to the hierarchy root) changed with the group.
    children: Mapping[str, HeldValue] = field(default_factory=dict)
    # The value the group is held at when the lever holds it through its children, its own file left as it was
    # (cgroup v1 quotas where a container's own limit is above the hold); None: the group's own value, applied.
    effective: str | None = None

    @property
    def holds(self) -> str:
        """The value the group is held at."""
        return self.applied if self.effective is None else self.effective

    @property
    def key(self) -> LeverKey:
        return (self.lever, self.group)


_RECORD = TypeAdapter(LeverRecord)


def _checked(record: LeverRecord) -> LeverRecord:
    """The record with its values in its lever's canonical text; ValueError naming what is wrong."""
    check = _CHECKS.get(record.lever)
    if check is None:
        raise ValueError(f"lever: unknown lever {record.lever!r}")
    if not record.group:
        raise ValueError("group: empty")

    def held(where: str, value: HeldValue) -> dict[str, Any]:
        try:
            return {
                "original": check(value.original),
                "applied": check(value.applied),
                "pending": None if value.pending is None else check(value.pending),
            }
        except ValueError as exc:
            raise ValueError(f"{where}: {exc}") from None

    children = {path: HeldValue(**held(f"children.{path}", child)) for path, child in record.children.items()}
    try:
        effective = None if record.effective is None else check(record.effective)
    except ValueError as exc:
        raise ValueError(f"effective: {exc}") from None
    return replace(record, **held("value", record), children=children, effective=effective)


def _from_version_1(document: Mapping[str, Any]) -> list[Any]:
    """Version 1's quota entries and weight records as version 2 records (left as found where malformed)."""
    items = document.get("entries")
    weights = document.get("weights", [])
    if not isinstance(items, list):
        raise ValueError("'entries' is not a list")
    if not isinstance(weights, list):
        raise ValueError("'weights' is not a list")
    records: list[Any] = []
    for entry in items:
        if isinstance(entry, Mapping) and "workload_id" in entry:
            rest = {k: v for k, v in entry.items() if k != "workload_id"}
            records.append(rest | {"lever": CPU_QUOTA.name, "group": entry["workload_id"]})
        else:
            records.append(entry)
    numbers = ("original", "applied", "pending")
    for weight in weights:
        if isinstance(weight, Mapping):
            values = {k: str(v) for k, v in weight.items() if k in numbers and isinstance(v, int)}
            records.append({**weight, "lever": CPU_WEIGHT.name, **values})
        else:
            records.append(weight)
    return records


@dataclass(frozen=True, slots=True)
class RejectedRecord:
    """A ledger record that failed its checks: as found, the group it names (if any), and what is wrong."""

    item: Any
    group: str | None
    problem: str


@dataclass(frozen=True, slots=True)
class ParsedLedger:
    records: dict[LeverKey, LeverRecord]
    rejected: tuple[RejectedRecord, ...]


def parse_ledger(raw: bytes) -> ParsedLedger:
    """A ledger file's records, each checked by its lever, and the ones that failed; ValueError when the file is not
    a ledger at all (not UTF-8, not JSON, an unknown version). Reads nothing and writes nothing."""
    try:
        document = json.loads(raw.decode("utf-8"))
        if not isinstance(document, Mapping) or document.get("version") not in (1, LEDGER_VERSION):
            raise ValueError(f"not a version 1 or {LEDGER_VERSION} ledger")
        items = _from_version_1(document) if document["version"] == 1 else document.get("records")
        if not isinstance(items, list):
            raise ValueError("'records' is not a list")
    except RecursionError as exc:  # UnicodeDecodeError and JSONDecodeError are ValueErrors already
        raise ValueError(str(exc)) from None
    records: dict[LeverKey, LeverRecord] = {}
    rejected: list[RejectedRecord] = []
    for item in items:
        try:
            found = _checked(_RECORD.validate_python(item))
        except ValidationError as exc:
            problem = "; ".join(f"{'.'.join(map(str, e['loc'])) or 'record'}: {e['msg']}" for e in exc.errors())
        except ValueError as exc:
            problem = str(exc)
        else:
            if found.key not in records:
                records[found.key] = found
                continue
            problem = "duplicate record"
        group = item.get("group") if isinstance(item, Mapping) else None
        rejected.append(RejectedRecord(item, None if group is None else str(group), problem))
    return ParsedLedger(records, tuple(rejected))


class LedgerUnsaved(NodeguardError):
    """The ledger file could not be written (a full or read-only filesystem)."""

    def __init__(self, path: str, error: OSError) -> None:
        self.path = path
        self.errno_name = errno.errorcode.get(error.errno or 0, str(error.errno))
        super().__init__(f"cannot save the ledger {path}: {error.strerror or error} ({self.errno_name})")


class Ledger:
    def __init__(self, path: str) -> None:
        self.path = path
        self.records: dict[LeverKey, LeverRecord] = {}
        self.set_aside: str | None = None  # where an unreadable file was moved
        self.rejected: str | None = None  # where records that failed their checks were kept

    def __bool__(self) -> bool:
        return bool(self.records)

    def __iter__(self) -> Iterator[LeverRecord]:
        return iter(list(self.records.values()))

    def of(self, lever: str) -> dict[str, LeverRecord]:
        """One lever's records, by group."""
        return {group: record for (name, group), record in self.records.items() if name == lever}

    def holds(self, lever: str) -> bool:
        """Whether any group's ``lever`` is held (read every tick: stops at the first)."""
        return any(name == lever for name, _ in self.records)

    def get(self, lever: str, group: str) -> LeverRecord | None:
        return self.records.get((lever, group))

    @classmethod
    def load(cls, path: str) -> Ledger:
        """Read the ledger; what cannot be trusted is moved aside and reported, never deleted.

        An unreadable file (not UTF-8, not JSON, an unknown version) is
        renamed aside whole; a record that fails its checks is copied to a
        ``.rejected-*`` file alone, and the others are kept.
        """
        ledger = cls(path)
        try:
            raw = read_state_file(path, MAX_LEDGER_BYTES)
        except FileNotFoundError:
            return ledger
        except UnsafeFile as exc:
            log.error("ledger not read; starting without it", path=path, problem=exc.reason)
            ledger.set_aside = path  # left where it is: what it is, or points at, is not ours to move
            return ledger
        try:
            parsed = parse_ledger(raw)
        except ValueError as exc:
            aside = set_aside(path)
            ledger.set_aside = aside
            log.error("ledger unreadable; kept aside, starting without it", path=path, kept_as=aside, error=str(exc))
            return ledger
        ledger.records.update(parsed.records)
        for rejected in parsed.rejected:
            log.error("ledger record rejected; the others are kept", path=path, group=rejected.group,
                      problem=rejected.problem)  # fmt: skip
        if parsed.rejected:
            ledger.rejected = f"{path}.rejected-{int(time.time())}"
            records = [rejected.item for rejected in parsed.rejected]
            body = json.dumps({"version": LEDGER_VERSION, "records": records}, indent=1, default=str)
            try:
                write_atomic(ledger.rejected, body.encode())
            except OSError as exc:
                log.error("cannot keep the rejected ledger records", path=ledger.rejected, error=str(exc))
                ledger.rejected = None
        return ledger

    def record(self, record: LeverRecord) -> None:
        """Add or update a record; recorded originals are never overwritten (see ``move_original``)."""
        held = self.records.get(record.key)
        if held is not None:
            children = dict(record.children)
            for path, child in held.children.items():
                if path in children:
                    children[path] = replace(children[path], original=child.original)
            record = replace(record, cgroup_version=held.cgroup_version, original=held.original, children=children)
        self.records[record.key] = record

    def move_original(self, key: LeverKey, original: str, child: str | None = None) -> None:
        """Someone set a new value behind nodeguard (an in-place resize): it is the original from now on."""
        held = self.records[key]
        if child is None:
            self.records[key] = replace(held, original=original)
        else:
            children = dict(held.children)
            children[child] = replace(children[child], original=original)
            self.records[key] = replace(held, children=children)

    def forget(self, key: LeverKey) -> None:
        self.records.pop(key, None)

    def save(self) -> None:
        """Write the ledger; LedgerUnsaved when the filesystem refuses (nothing in memory changes)."""
        payload = {"version": LEDGER_VERSION, "records": [_encode(r) for r in self.records.values()]}
        try:
            os.makedirs(os.path.dirname(self.path) or ".", mode=0o750, exist_ok=True)
            write_atomic(self.path, json.dumps(payload, indent=1, sort_keys=True).encode())
        except OSError as exc:
            raise LedgerUnsaved(self.path, exc) from None


def _encode(record: LeverRecord) -> dict[str, Any]:
    data: dict[str, Any] = _RECORD.dump_python(record, mode="json")
    if not record.children:
        del data["children"]
    if record.effective is None:
        del data["effective"]
    return data
