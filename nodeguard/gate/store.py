"""The gate's state file: admitted loads (starting and ready), so a restarted daemon keeps their slots.

JSON written atomically (temporary file, fsync, rename, fsync of the
directory). Times are CLOCK_MONOTONIC, which is shared by every process since
boot; the file records the boot it belongs to and is ignored after a reboot
(the loads it lists are gone with the processes).
"""

from __future__ import annotations

import contextlib
import functools
import json
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Annotated, Any, Literal

from pydantic import Field, TypeAdapter, ValidationError

from nodeguard.atomic_file import UnsafeFile, keep_copy, read_state_file, set_aside, write_atomic
from nodeguard.config_base import LazyModel, format_location
from nodeguard.gate.protocol import MAX_START_TIMEOUT, LoadName
from nodeguard.gate.readiness import Readiness, dump_readiness
from nodeguard.gate.states import Load, LoadSpec, LoadState

STATE_FILE = "gate-state.json"
VERSION = 1
PERSISTED = (LoadState.STARTING, LoadState.READY)


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


MAX_STATE_BYTES = 64 << 20  # far above what maxLoads loads take; a larger file is not ours
# A restored time may be this far past the clock read at restore (the file was written just before).
_CLOCK_SLACK = 5.0
SemaphoreName = Annotated[str, Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9._:-]{0,252}$")]
Id = Annotated[int, Field(ge=0, lt=2**32 - 1)]
Moment = Annotated[float, Field(ge=0)]  # CLOCK_MONOTONIC seconds; finite (the base model refuses inf and NaN)


class _Record(LazyModel):
    """One load as the state file holds it: every field checked as strictly as a client's submit."""

    name: LoadName
    state: Literal["starting", "ready"]
    reason: str = Field(max_length=4096)
    depends_on: list[LoadName] = Field(max_length=64)
    readiness: Readiness | None
    priority: int = Field(ge=-1_000_000, le=1_000_000)
    start_timeout_seconds: float | None = Field(gt=0, le=MAX_START_TIMEOUT)
    detach: bool
    uid: Id
    gid: Id
    semaphore: SemaphoreName | None = None
    seq: int = Field(ge=1, le=2**62)
    submitted_at: Moment
    wall_submitted_at: float
    admitted_at: Moment
    deadline: Moment | None
    finished_at: Moment | None


@functools.cache
def record_adapter() -> TypeAdapter[_Record]:
    """The state file's record validator, built on first use (a gate with no state file never needs it)."""
    return TypeAdapter(_Record)


def _load(raw: object, now: float) -> Load:
    record = record_adapter().validate_python(raw, strict=True)
    if not record.submitted_at <= record.admitted_at <= now + _CLOCK_SLACK:
        raise ValueError("admittedAt is before submittedAt or in the future: not a time of this boot")
    state = LoadState(record.state)
    if state is LoadState.STARTING:
        if record.deadline is None or not record.admitted_at < record.deadline:
            raise ValueError("a starting load needs a deadline after its admission")
        if record.deadline - record.admitted_at > MAX_START_TIMEOUT + _CLOCK_SLACK:
            raise ValueError(f"deadline is more than {MAX_START_TIMEOUT:g}s after admission")
    if record.finished_at is not None and not record.admitted_at <= record.finished_at <= now + _CLOCK_SLACK:
        raise ValueError("finishedAt is before admission or in the future")
    spec = LoadSpec(
        name=record.name,
        depends_on=tuple(record.depends_on),
        readiness=record.readiness,
        priority=record.priority,
        start_timeout=record.start_timeout_seconds,
        detach=record.detach,
        uid=record.uid,
        gid=record.gid,
        semaphore=record.semaphore,
    )
    return Load(
        spec=spec,
        seq=record.seq,
        state=state,
        reason=record.reason,
        submitted_at=record.submitted_at,
        wall_submitted_at=record.wall_submitted_at,
        admitted_at=record.admitted_at,
        deadline=record.deadline,
        finished_at=record.finished_at,
        restored=True,
    )


@dataclass
class ReadBack:
    loads: list[Load] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)
    set_aside: str | None = None  # where an unreadable file was moved, or a copy of one with bad records
    other_boot: bool = False


def read(
    path: str, boot: str | None, allowed: Callable[[int, int], bool] | None = None, now: float | None = None
) -> ReadBack:
    """The loads of the state file; an unreadable file is renamed aside (never deleted) and reported.

    ``allowed(uid, gid)``: whether that peer may use the gate now. A load whose
    submitter may not is not restored (its exec probe would run as that uid).
    A file with bad records restores the good ones and keeps a copy aside.
    """
    result = ReadBack()
    now = time.monotonic() if now is None else now
    try:
        data = json.loads(read_state_file(path, MAX_STATE_BYTES).decode("utf-8"))
        if not isinstance(data, dict) or data.get("version") != VERSION or not isinstance(data.get("loads"), list):
            raise ValueError(f"not a version {VERSION} gate state")
    except FileNotFoundError:
        return result
    except (UnsafeFile, ValueError, RecursionError) as exc:  # UnicodeDecodeError and JSONDecodeError are ValueErrors
        with contextlib.suppress(OSError):
            result.set_aside = set_aside(path)
        result.problems.append(f"{type(exc).__name__}: {exc}" if isinstance(exc, RecursionError) else str(exc))
        return result
    except OSError as exc:
        result.problems.append(f"cannot read: {exc}")
        return result
    if data.get("bootId") != boot:
        result.other_boot = True
        return result
    found: dict[str, tuple[int, Load]] = {}
    for index, record in enumerate(data["loads"]):
        try:
            load = _load(record, now)
        except (ValidationError, ValueError) as exc:
            result.problems.append(f"loads[{index}]: {_brief(exc)}")
            continue
        if allowed is not None and not allowed(load.spec.uid, load.spec.gid):
            result.problems.append(
                f"loads[{index}]: {load.name!r} was submitted by uid {load.spec.uid} (gid {load.spec.gid}),"
                " which may not use the gate (gate.allowedUids, gate.allowedGids); not restored"
            )
            continue
        earlier = found.get(load.name)
        if earlier is not None:
            kept, dropped = (earlier, (index, load)) if earlier[1].seq >= load.seq else ((index, load), earlier)
            result.problems.append(
                f"loads[{dropped[0]}]: a second record of {load.name!r}; kept loads[{kept[0]}] (seq {kept[1].seq})"
            )
            found[load.name] = kept
        else:
            found[load.name] = (index, load)
    result.loads = [load for _, load in sorted(found.values(), key=lambda item: item[0])]
    if result.problems:
        with contextlib.suppress(OSError):
            result.set_aside = keep_copy(path)
    return result


def _brief(exc: Exception) -> str:
    if isinstance(exc, ValidationError):
        return "; ".join(
            f"{format_location(error['loc'])}: {error['msg']}" for error in exc.errors(include_url=False)[:5]
        )
    return str(exc)


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
