"""Reading the history back: every well-formed entry in time order; malformed lines skipped and counted.

A line is malformed when it is not UTF-8 JSON, not an object, of another
version, or lacks a field the queries read (or has it of another type): a
line cut short by a crash, a disk's garbage after a power loss, an edit by
hand. It is skipped and counted, never an error. The newest file's last line
without its newline is being written: it is left for the next read.
"""

from __future__ import annotations

import json
import os
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from nodeguard.history.jsonl import VERSION
from nodeguard.history.segments import history_files

# Read at most this much of one file: a file of the history is at most history.maxBytes / files; one far larger was
# not written by nodeguard.
MAX_FILE_BYTES = 1 << 30
LATEST = 253_402_300_799  # 9999-12-31T23:59:59Z: a time any clock can show


@dataclass(frozen=True, slots=True)
class Named:
    """A workload an entry names: its cgroup, name and (a pod's) UID."""

    id: str
    name: str
    uid: str | None = None


@dataclass(frozen=True, slots=True)
class Record:
    """One entry as the queries read it; ``data`` is the whole entry, as written."""

    at: float
    kind: str
    lever: str | None
    group: str | None
    holds_back: bool
    release: bool
    workload: Named | None  # the workload changed or evicted
    listed: tuple[Named, ...]  # a group's change: the candidates it named
    under: tuple[Named, ...]  # a group's change: every workload it holds (the group's own, those under it)
    restored: tuple[str, ...]  # the daemon's start or stop: groups put back (every lever)
    kept: tuple[str, ...]  # the daemon's start or stop: groups it kept holding
    data: Mapping[str, Any] = field(repr=False)


@dataclass
class Scan:
    records: list[Record] = field(default_factory=list)  # in the order written (time order)
    malformed: int = 0
    skipped: int = 0  # whole lines left unparsed: ``keep`` did not want them
    files: int = 0
    bytes: int = 0
    oldest: float | None = None  # the time of the oldest entry

    @property
    def entries(self) -> int:
        return len(self.records) + self.skipped


def _text(value: object) -> bool:
    return isinstance(value, str)


def _named(value: object) -> Named | None:
    if not isinstance(value, Mapping):
        return None
    wid, name, uid = value.get("id"), value.get("name"), value.get("uid")
    if not (isinstance(wid, str) and isinstance(name, str) and (uid is None or isinstance(uid, str))):
        return None
    return Named(wid, name, uid)


def _names(value: object) -> tuple[Named, ...] | None:
    if value is None:
        return ()
    if not isinstance(value, list):
        return None
    found = [_named(item) for item in value]
    return None if any(n is None for n in found) else tuple(n for n in found if n is not None)


def _texts(value: object) -> tuple[str, ...] | None:
    if value is None:
        return ()
    if not isinstance(value, list) or not all(map(_text, value)):
        return None
    return tuple(value)


def record_of(data: object) -> Record | None:
    """The entry as a Record; None when it is malformed."""
    if not isinstance(data, dict) or type(data.get("v")) is not int or data["v"] != VERSION:
        return None
    at, kind, lever, group = data.get("at"), data.get("kind"), data.get("lever"), data.get("group")
    if isinstance(at, bool) or not isinstance(at, int | float) or not 0 <= at <= LATEST or not isinstance(kind, str):
        return None
    if not (lever is None or _text(lever)) or not (group is None or _text(group)):
        return None
    holds, release = data.get("holds_back", False), data.get("release", False)
    if not isinstance(holds, bool) or not isinstance(release, bool):
        return None
    workload = None
    if data.get("workload") is not None:
        workload = _named(data["workload"])
        if workload is None:
            return None
    under, ids = _names(data.get("under")), _texts(data.get("workloads"))
    restored, kept = _texts(data.get("restored")), _texts(data.get("kept"))
    if under is None or ids is None or restored is None or kept is None:
        return None
    names = {n.id: n for n in under}
    listed = tuple(names.get(wid) or Named(wid, wid) for wid in ids)
    if kind in ("start", "stop"):
        if group is not None:
            return None
    elif group is None:
        return None
    return Record(float(at), kind, lever, group, holds, release, workload, listed, under, restored, kept, data)


def _constant(name: str) -> object:
    raise ValueError(f"{name} is not JSON")


DECODER = json.JSONDecoder(parse_constant=_constant)  # one: making a decoder per line costs a fifth of the parse
HEAD = b'{"v":%d,"at":' % VERSION  # how every line the recorder writes begins
AT = re.compile(rb'\{"v":%d,"at":([0-9]+(?:\.[0-9]+)?)[,}]' % VERSION)


def parse_line(line: bytes) -> Record | None:
    try:
        data = DECODER.decode(line.decode())
    except (ValueError, RecursionError):  # UnicodeDecodeError is a ValueError
        return None
    return record_of(data)


def whole_at(line: bytes) -> float | None:
    """The time of a line that looks like a whole entry (read without parsing it); None: it does not."""
    match = AT.match(line)
    return float(match.group(1)) if match is not None and line.endswith(b"}") else None


def scan(directory: str, keep: Callable[[bytes], bool] | None = None) -> Scan:
    """Every entry of the history in ``directory`` (none when it does not exist), oldest first.

    ``keep`` chooses the lines worth parsing (a query's cheap test on the bytes); the others are only checked
    to look whole (how they begin and end), and counted as malformed when they do not.
    """
    found = Scan()
    files = history_files(directory)
    for index, (_, path) in enumerate(files):
        try:
            with open(path, "rb") as handle:
                # Sized by the file, not by the bound: read(n) allocates n bytes up front.
                data = handle.read(min(os.fstat(handle.fileno()).st_size, MAX_FILE_BYTES))
        except OSError:
            continue  # deleted as the oldest since it was listed
        found.files += 1
        found.bytes += len(data)
        lines = data.split(b"\n")
        tail = lines.pop()  # b"" when the file ends in a newline
        if tail and index < len(files) - 1:
            lines.append(tail)  # an older file's cut line: malformed below
        for line in lines:
            if not line.strip():
                continue
            if keep is not None and not keep(line):
                at = whole_at(line)
                if at is None:
                    found.malformed += 1
                else:
                    found.skipped += 1
                    found.oldest = at if found.oldest is None else min(found.oldest, at)
                continue
            record = parse_line(line)
            if record is None:
                found.malformed += 1
            else:
                found.records.append(record)
                found.oldest = record.at if found.oldest is None else min(found.oldest, record.at)
    return found


def directory_bytes(directory: str) -> int:
    """What the history's files take now."""
    total = 0
    for _, path in history_files(directory):
        try:
            total += os.stat(path).st_size
        except FileNotFoundError:
            continue
    return total
