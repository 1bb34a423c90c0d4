"""The gate's state file: admitted loads (starting and ready), so a restarted daemon keeps their slots.

JSON written atomically (temporary file, fsync, rename, fsync of the
directory). Times are CLOCK_MONOTONIC, which is shared by every process since
boot; the file records the boot it belongs to and is ignored after a reboot
(the loads it lists are gone with the processes).
"""

from __future__ import annotations

import contextlib
import json
import threading
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from nodeguard.atomic_file import set_aside, write_atomic
from nodeguard.gate.readiness import READINESS, dump_readiness
from nodeguard.gate.states import Load, LoadSpec, LoadState

STATE_FILE = "gate-state.json"
VERSION = 1
PERSISTED = (LoadState.STARTING, LoadState.READY)


def boot_id() -> str | None:
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip() or None
    except OSError:
        return None


def encode(loads: Iterable[Load], boot: str | None) -> bytes:
    records = [_record(load) for load in loads if load.state in PERSISTED]
    return json.dumps({"version": VERSION, "bootId": boot, "loads": records}, separators=(",", ":")).encode()


def _record(load: Load) -> dict[str, Any]:
    spec = load.spec
    return {
        "name": spec.name,
        "state": load.state.value,
        "reason": load.reason,
        "dependsOn": list(spec.depends_on),
        "readiness": dump_readiness(spec.readiness),
        "priority": spec.priority,
        "startTimeoutSeconds": spec.start_timeout,
        "detach": spec.detach,
        "uid": spec.uid,
        "gid": spec.gid,
        "semaphore": spec.semaphore,
        "seq": load.seq,
        "submittedAt": load.submitted_at,
        "wallSubmittedAt": load.wall_submitted_at,
        "admittedAt": load.admitted_at,
        "deadline": load.deadline,
        "finishedAt": load.finished_at,
    }


def _load(record: dict[str, Any]) -> Load:
    readiness = record["readiness"]
    spec = LoadSpec(
        name=str(record["name"]),
        depends_on=tuple(str(d) for d in record["dependsOn"]),
        readiness=None if readiness is None else READINESS.validate_python(readiness),
        priority=int(record["priority"]),
        start_timeout=None if record["startTimeoutSeconds"] is None else float(record["startTimeoutSeconds"]),
        detach=bool(record["detach"]),
        uid=int(record["uid"]),
        gid=int(record["gid"]),
        semaphore=None if record.get("semaphore") is None else str(record["semaphore"]),
    )
    state = LoadState(record["state"])
    if state not in PERSISTED:
        raise ValueError(f"state {state} is never persisted")
    return Load(
        spec=spec,
        seq=int(record["seq"]),
        state=state,
        reason=str(record["reason"]),
        submitted_at=float(record["submittedAt"]),
        wall_submitted_at=float(record["wallSubmittedAt"]),
        admitted_at=_optional_float(record["admittedAt"]),
        deadline=_optional_float(record["deadline"]),
        finished_at=_optional_float(record["finishedAt"]),
        restored=True,
    )


def _optional_float(value: object) -> float | None:
    return None if value is None else float(value)  # type: ignore[arg-type]


@dataclass
class ReadBack:
    loads: list[Load] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)
    set_aside: str | None = None  # where an unreadable file was moved
    other_boot: bool = False


def read(path: str, boot: str | None) -> ReadBack:
    """The loads of the state file; an unreadable file is renamed aside (never deleted) and reported."""
    result = ReadBack()
    try:
        text = Path(path).read_text(encoding="utf-8")
    except FileNotFoundError:
        return result
    except (OSError, UnicodeDecodeError) as exc:
        result.problems.append(f"cannot read: {exc}")
        return result
    try:
        data = json.loads(text)
        if not isinstance(data, dict) or data.get("version") != VERSION or not isinstance(data.get("loads"), list):
            raise ValueError(f"not a version {VERSION} gate state")
    except ValueError as exc:
        with contextlib.suppress(OSError):
            result.set_aside = set_aside(path)
        result.problems.append(str(exc))
        return result
    if data.get("bootId") != boot:
        result.other_boot = True
        return result
    for index, record in enumerate(data["loads"]):
        try:
            if not isinstance(record, dict):
                raise TypeError("not an object")
            result.loads.append(_load(record))
        except (KeyError, TypeError, ValueError, ValidationError) as exc:
            result.problems.append(f"loads[{index}]: {exc}")
    return result


class StateWriter:
    """Writes generations of the state in order: an older one never lands after a newer one."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._lock = threading.Lock()  # the daemon writes from a worker thread, and once more at exit
        self._written = -1

    def write(self, generation: int, data: bytes) -> bool:
        with self._lock:
            if generation <= self._written:
                return False
            write_atomic(self.path, data)
            self._written = generation
            return True
