"""A load (one start going through the gate) and its states: blocked -> pending -> starting -> ready | failed."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import Any

from nodeguard.gate.readiness import Readiness, dump_readiness


class LoadState(enum.StrEnum):
    BLOCKED = "blocked"  # a dependency is not ready yet; holds no slot
    PENDING = "pending"  # the policy holds it
    STARTING = "starting"  # admitted: holds a slot until it is ready
    READY = "ready"
    FAILED = "failed"

    @property
    def active(self) -> bool:
        """Not finished: the load can still change state on its own."""
        return self in (LoadState.BLOCKED, LoadState.PENDING, LoadState.STARTING)

    @property
    def admitted(self) -> bool:
        return self in (LoadState.STARTING, LoadState.READY)


#: What ``wait`` may wait for, and the states that satisfy it (failed always ends a wait).
WAIT_TARGETS: dict[str, frozenset[LoadState]] = {
    "starting": frozenset({LoadState.STARTING, LoadState.READY, LoadState.FAILED}),
    "ready": frozenset({LoadState.READY, LoadState.FAILED}),
}


@dataclass(frozen=True, slots=True)
class LoadSpec:
    """What a client asks for at submit: validated, immutable."""

    name: str
    depends_on: tuple[str, ...] = ()
    readiness: Readiness | None = None  # None: ready as soon as admitted
    priority: int = 0
    start_timeout: float | None = None  # seconds; None: the gate's startTimeoutSeconds
    detach: bool = False  # once admitted, the load outlives the submitting connection
    uid: int = 0  # of the submitting peer: exec probes run as this user
    gid: int = 0
    semaphore: str | None = None  # a cluster semaphore it also needs a slot of while it starts


class ClusterSlot(enum.StrEnum):
    """Where a load stands with its cluster semaphore (loads without one stay NONE)."""

    NONE = ""
    WAITING = "waiting"  # asked the coordination service for a slot
    HELD = "held"  # holds a slot until it is ready or fails


@dataclass(slots=True)
class Load:
    """One load in the gate's table (mutable: the table moves it through its states)."""

    spec: LoadSpec
    seq: int  # submission order; also tells a replaced load from its successor
    state: LoadState
    reason: str
    submitted_at: float  # monotonic
    wall_submitted_at: float = field(default_factory=time.time)
    admitted_at: float | None = None  # monotonic
    deadline: float | None = None  # monotonic: failed if not ready by then
    finished_at: float | None = None  # monotonic: became ready or failed
    owner: object | None = None  # the connection that must stay open until ready; None: detached
    probe: str = ""  # the last probe result, for status
    restored: bool = False  # read back from the state file after a restart
    admit_gen: int = 0  # the generation of the state file that first records its admission
    cluster: ClusterSlot = ClusterSlot.NONE

    @property
    def name(self) -> str:
        return self.spec.name

    def to_status(self, now: float) -> dict[str, Any]:
        data: dict[str, Any] = {
            "name": self.name,
            "state": self.state.value,
            "reason": self.reason,
            "dependsOn": list(self.spec.depends_on),
            "priority": self.spec.priority,
            "readiness": dump_readiness(self.spec.readiness),
            "detached": self.owner is None,
            "ageSeconds": round(now - self.submitted_at, 3),
        }
        if self.admitted_at is not None:
            data["admittedSecondsAgo"] = round(now - self.admitted_at, 3)
        if self.deadline is not None and self.state is LoadState.STARTING:
            data["timeoutInSeconds"] = round(self.deadline - now, 3)
        if self.spec.semaphore is not None:
            data["semaphore"] = self.spec.semaphore
            data["clusterSlot"] = self.cluster.value or "none"
        if self.probe:
            data["probe"] = self.probe
        if self.restored:
            data["restored"] = True
        return data
