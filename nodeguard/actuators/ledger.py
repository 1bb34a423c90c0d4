"""The ledger of originals: every CPU limit nodeguard changed, and what it was before.

A JSON file (default /run/nodeguard/ledger.json) written atomically: a
temporary file in the same directory, fsync, rename, fsync of the directory.
It outlives the daemon, so ``nodeguard restore --all`` works while it is down,
and a restarted daemon can tell its own throttles from anybody else's.

One entry per workload: the workload's own limit, and the limit of every
descendant cgroup nodeguard had to change with it (cgroup v1 refuses a parent
quota below a child's, so children are capped first). Each entry is checked on
its own when the file is read: a bad entry is set aside alone, in a file
beside the ledger, and the good ones are still restored.

CPU weights lowered for protected_cpu_stall are kept alike, under ``weights``
(one record per group; a ledger without weights is written as before).
"""

from __future__ import annotations

import errno
import json
import os
import time
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from enum import StrEnum
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, Field, TypeAdapter, ValidationError

from nodeguard.atomic_file import UnsafeFile, read_state_file, set_aside, write_atomic
from nodeguard.errors import NodeguardError, ParseError
from nodeguard.log import get_logger
from nodeguard.model.samples import CpuMax
from nodeguard.sources.cgroupfs import parse_cpu_max

log = get_logger("nodeguard.ledger")

LEDGER_VERSION = 1
MAX_LEDGER_BYTES = 64 << 20  # far above any real node (about 300 bytes an entry)


def _cpu_max_text(value: str) -> str:
    try:
        parse_cpu_max(value)
    except ParseError as exc:
        raise ValueError(str(exc)) from None
    return value


CpuMaxText = Annotated[str, AfterValidator(_cpu_max_text)]


class Ownership(StrEnum):
    """Who set a limit found in the kernel, as the ledger sees it."""

    OURS = "ours"  # nodeguard's value (applied, or about to be)
    ORIGINAL = "original"  # the recorded original: someone put it back (kubelet resyncing): drift
    MOVED = "moved"  # neither: someone set a new limit (an in-place resize): the new original


@dataclass(frozen=True, slots=True)
class LimitRecord:
    """One cgroup's CPU limit: before nodeguard, as nodeguard set it, and a write about to happen."""

    original: CpuMaxText  # cpu.max format, "max 100000" for unlimited (v1 values converted)
    applied: CpuMaxText
    # A value about to be written: saved before the write so that a crash
    # between the two still leaves the kernel's value recognisable as ours.
    pending: CpuMaxText | None = None

    @property
    def original_limit(self) -> CpuMax:
        return parse_cpu_max(self.original)

    @property
    def applied_limit(self) -> CpuMax:
        return parse_cpu_max(self.applied)

    def is_ours(self, current: CpuMax) -> bool:
        return current == self.applied_limit or (self.pending is not None and current == parse_cpu_max(self.pending))

    def ownership(self, current: CpuMax) -> Ownership:
        if self.is_ours(current):
            return Ownership.OURS
        if current == self.original_limit:
            return Ownership.ORIGINAL
        return Ownership.MOVED


@dataclass(frozen=True, slots=True, kw_only=True)
class LedgerEntry(LimitRecord):
    workload_id: str = ""
    cgroup_version: Literal["v1", "v2"] = "v2"
    reason: str = ""
    changed_at: float = 0.0  # wall-clock seconds
    # Descendant cgroups (paths relative to the hierarchy root) whose limits were
    # changed to let the workload's own be lowered, deepest paths sort last.
    children: Mapping[str, LimitRecord] = field(default_factory=dict)


def entry(
    workload_id: str,
    version: Literal["v1", "v2"],
    original: CpuMax,
    applied: CpuMax,
    reason: str,
    *,
    pending: CpuMax | None = None,
    children: Mapping[str, LimitRecord] | None = None,
) -> LedgerEntry:
    return LedgerEntry(
        original=original.render_v2(),
        applied=applied.render_v2(),
        pending=None if pending is None else pending.render_v2(),
        workload_id=workload_id,
        cgroup_version=version,
        reason=reason,
        changed_at=time.time(),
        children=dict(children or {}),
    )


@dataclass(frozen=True, slots=True, kw_only=True)
class WeightRecord:
    """A group's CPU weight (cpu.shares on v1, cpu.weight on v2, 0 for cpu.idle set on v2): before nodeguard, as
    nodeguard set it."""

    group: str
    cgroup_version: Literal["v1", "v2"]
    original: Annotated[int, Field(ge=0, le=262144)]
    applied: Annotated[int, Field(ge=0, le=262144)]
    pending: Annotated[int, Field(ge=0, le=262144)] | None = None  # about to be written
    reason: str = ""
    changed_at: float = 0.0

    def is_ours(self, current: int) -> bool:
        return current in (self.applied, self.pending)


_ENTRY = TypeAdapter(LedgerEntry)
_WEIGHT = TypeAdapter(WeightRecord)


class LedgerUnsaved(NodeguardError):
    """The ledger file could not be written (a full or read-only filesystem)."""

    def __init__(self, path: str, error: OSError) -> None:
        self.path = path
        self.errno_name = errno.errorcode.get(error.errno or 0, str(error.errno))
        super().__init__(f"cannot save the ledger {path}: {error.strerror or error} ({self.errno_name})")


class Ledger:
    def __init__(self, path: str) -> None:
        self.path = path
        self.entries: dict[str, LedgerEntry] = {}
        self.weights: dict[str, WeightRecord] = {}
        self.set_aside: str | None = None  # where an unreadable file was moved
        self.rejected: str | None = None  # where entries that failed their checks were kept

    @classmethod
    def load(cls, path: str) -> Ledger:
        """Read the ledger; what cannot be trusted is moved aside and reported, never deleted.

        An unreadable file (not UTF-8, not JSON, another version) is renamed
        aside whole; an entry that fails its checks is copied to a
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
            document = json.loads(raw.decode("utf-8"))
            if not isinstance(document, Mapping) or document.get("version") != LEDGER_VERSION:
                raise ValueError(f"not a version {LEDGER_VERSION} ledger")
            items = document.get("entries")
            if not isinstance(items, list):
                raise ValueError("'entries' is not a list")
            weights = document.get("weights", [])
            if not isinstance(weights, list):
                raise ValueError("'weights' is not a list")
        except (ValueError, RecursionError) as exc:  # UnicodeDecodeError and JSONDecodeError are ValueErrors
            aside = set_aside(path)
            ledger.set_aside = aside
            log.error("ledger unreadable; kept aside, starting without it", path=path, kept_as=aside, error=str(exc))
            return ledger
        rejected: list[Any] = []
        for item in items:
            try:
                found = _ENTRY.validate_python(item)
            except ValidationError as exc:
                rejected.append(item)
                problem = "; ".join(f"{'.'.join(map(str, e['loc'])) or 'entry'}: {e['msg']}" for e in exc.errors())
                workload = item.get("workload_id") if isinstance(item, Mapping) else None
                log.error("ledger entry rejected; the others are kept", path=path, workload=workload, problem=problem)
                continue
            if found.workload_id in ledger.entries or not found.workload_id:
                rejected.append(item)
                log.error("ledger entry rejected: duplicate or empty workload", path=path, workload=found.workload_id)
                continue
            ledger.entries[found.workload_id] = found
        rejected_weights: list[Any] = []
        for item in weights:
            try:
                weight = _WEIGHT.validate_python(item)
            except ValidationError as exc:
                rejected_weights.append(item)
                log.error("ledger weight rejected; the others are kept", path=path, problem=str(exc.errors()[0]["msg"]))
                continue
            if weight.group in ledger.weights or not weight.group:
                rejected_weights.append(item)
                continue
            ledger.weights[weight.group] = weight
        if rejected or rejected_weights:
            ledger.rejected = f"{path}.rejected-{int(time.time())}"
            document = {"version": LEDGER_VERSION, "entries": rejected, "weights": rejected_weights}
            body = json.dumps(document, indent=1, default=str)
            try:
                write_atomic(ledger.rejected, body.encode())
            except OSError as exc:
                log.error("cannot keep the rejected ledger entries", path=ledger.rejected, error=str(exc))
                ledger.rejected = None
        return ledger

    def record(self, entry: LedgerEntry) -> None:
        """Add or update an entry; recorded originals are never overwritten (see ``move_original``)."""
        held = self.entries.get(entry.workload_id)
        if held is not None:
            children = dict(entry.children)
            for path, child in held.children.items():
                if path in children:
                    children[path] = replace(children[path], original=child.original)
            entry = replace(entry, cgroup_version=held.cgroup_version, original=held.original, children=children)
        self.entries[entry.workload_id] = entry

    def move_original(self, workload_id: str, original: CpuMax, child: str | None = None) -> None:
        """Someone set a new limit behind nodeguard (an in-place resize): it is the original from now on."""
        held = self.entries[workload_id]
        if child is None:
            self.entries[workload_id] = replace(held, original=original.render_v2())
        else:
            children = dict(held.children)
            children[child] = replace(children[child], original=original.render_v2())
            self.entries[workload_id] = replace(held, children=children)

    def forget(self, workload_id: str) -> None:
        self.entries.pop(workload_id, None)

    def save(self) -> None:
        """Write the ledger; LedgerUnsaved when the filesystem refuses (nothing in memory changes)."""
        payload: dict[str, Any] = {"version": LEDGER_VERSION, "entries": [_encode(e) for e in self.entries.values()]}
        if self.weights:
            payload["weights"] = [_WEIGHT.dump_python(w, mode="json") for w in self.weights.values()]
        try:
            os.makedirs(os.path.dirname(self.path) or ".", mode=0o750, exist_ok=True)
            write_atomic(self.path, json.dumps(payload, indent=1, sort_keys=True).encode())
        except OSError as exc:
            raise LedgerUnsaved(self.path, exc) from None


def _encode(entry: LedgerEntry) -> dict[str, Any]:
    data: dict[str, Any] = _ENTRY.dump_python(entry, mode="json")
    if not entry.children:
        del data["children"]  # the format before children existed, still read by older versions
    return data

