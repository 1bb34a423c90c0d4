"""The gate's requests: each parsed request carried out on the table of loads, and the waits left open until their
load reaches what they wait for."""

from __future__ import annotations

import asyncio
import contextlib
import os
import time
from collections import Counter
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from nodeguard.gate.loads import GateRefused, LoadTable
from nodeguard.gate.protocol import (
    Attach,
    Cancel,
    Ping,
    Ready,
    Release,
    Request,
    RequestId,
    StatusRequest,
    Submit,
    Wait,
    error,
    ok,
)
from nodeguard.gate.server import Connection, Peer
from nodeguard.gate.statefile import StateFile
from nodeguard.gate.states import WAIT_TARGETS, Load, LoadSpec

if TYPE_CHECKING:
    from nodeguard.coordination.switch import Coordination

MAX_WAITS = 256  # waits one connection may have open at once

_Waiter = tuple[Connection, RequestId, str]  # its connection, its request's id, its ``until``


class Requests:
    def __init__(
        self,
        table: LoadTable,
        state: StateFile,
        counters: Counter[str],
        coordination: Coordination | None,
        status: Callable[[], dict[str, Any]],
    ) -> None:
        self.table = table
        self.state = state
        self.counters = counters  # the gate's, shared: this adds "forbidden"
        self.coordination = coordination
        self.status = status
        self._waiters: dict[str, list[_Waiter]] = {}

    def dispatch(self, conn: Connection, request: Request, now: float) -> None:
        rid = request.id
        if isinstance(request, Submit):
            existing = self.table.loads.get(request.name)
            if existing is not None:
                self._check_may_change(conn.peer, existing)
            self._check_semaphore(request.semaphore)
            spec = LoadSpec(
                name=request.name,
                depends_on=tuple(request.depends_on),
                readiness=request.readiness,
                priority=request.priority,
                start_timeout=request.start_timeout_seconds,
                detach=request.detach,
                uid=conn.peer.uid,
                gid=conn.peer.gid,
                semaphore=request.semaphore,
            )
            self._reply(conn, rid, self.table.submit(spec, conn, now))
        elif isinstance(request, Wait):
            load = self.table.get(request.name)
            if load.state in WAIT_TARGETS[request.until]:
                self._reply(conn, rid, load)
            else:
                if conn.waits >= MAX_WAITS:
                    raise GateRefused("too_many_waits", f"this connection has {conn.waits} waits open already")
                self._waiters.setdefault(request.name, []).append((conn, rid, request.until))
                conn.waiting.add(request.name)
                conn.waits += 1
        elif isinstance(request, Ready | Release | Cancel | Attach):
            self._check_may_change(conn.peer, self.table.get(request.name))
            if isinstance(request, Ready):
                self._reply(conn, rid, self.table.ready(request.name, now))
            elif isinstance(request, Release):
                released = self.table.release(request.name, now)
                conn.send(ok(rid, load={**self._view(released, now), "state": "released"}))
            elif isinstance(request, Cancel):
                self._reply(conn, rid, self.table.cancel(request.name, now))
            else:
                self._reply(conn, rid, self.table.attach(request.name, conn))
        elif isinstance(request, StatusRequest):
            if request.name is None:
                conn.send(ok(rid, gate=self.status()))
            else:
                conn.send(ok(rid, load=self._view(self.table.get(request.name), now)))
        elif isinstance(request, Ping):
            conn.send(ok(rid))

    def _check_semaphore(self, semaphore: str | None) -> None:
        if semaphore is None:
            return
        coordination = self.coordination
        if coordination is None or not coordination.enabled:
            raise GateRefused("no_coordination", f"semaphore {semaphore!r}: cluster coordination is not enabled")
        if semaphore not in coordination.settings.semaphores:
            known = ", ".join(sorted(coordination.settings.semaphores))
            raise GateRefused("unknown_semaphore", f"no cluster semaphore {semaphore!r} (configured: {known})")

    def _check_may_change(self, peer: Peer, load: Load) -> None:
        if peer.uid not in (0, os.geteuid(), load.spec.uid):
            self.counters["forbidden"] += 1
            raise GateRefused("forbidden", f"load {load.name!r} belongs to uid {load.spec.uid}")

    def _view(self, load: Load, now: float) -> dict[str, Any]:
        """A load's status for its client; one holding a cluster slot also learns how long it may go on starting
        without this daemon (the node's lease less a heartbeat: it must stop before the node's will can fire)."""
        data = load.to_status(now)
        coordination = self.coordination
        if load.spec.semaphore is not None and coordination is not None and coordination.enabled:
            data["clusterFenceSeconds"] = coordination.client_fence_seconds
        return data

    def _reply(self, conn: Connection, rid: RequestId, load: Load) -> None:
        message = ok(rid, load=self._view(load, time.monotonic()))
        if load.state.admitted and load.admit_gen > self.state.durable:
            self.state.defer(load.admit_gen, conn, message)  # sent once the admission is on disk
        else:
            conn.send(message)

    # --- the waits ---------------------------------------------------------------------

    def changed(self, load: Load) -> None:
        """Answer the waits on ``load`` that its new state satisfies."""
        waiters = self._waiters.get(load.name)
        if not waiters:
            return
        remaining = []
        for conn, rid, until in waiters:
            if conn.closed:
                continue
            if load.state in WAIT_TARGETS[until]:
                conn.waits -= 1
                self._reply(conn, rid, load)
            else:
                remaining.append((conn, rid, until))
        if remaining:
            self._waiters[load.name] = remaining
        else:
            del self._waiters[load.name]

    def removed(self, name: str) -> None:
        if name in self._waiters:
            # A replacement arrives in the same call; answer only if the name stays gone.
            with contextlib.suppress(RuntimeError):
                asyncio.get_running_loop().call_soon(self._answer_gone, name)

    def _answer_gone(self, name: str) -> None:
        if name in self.table.loads:
            return
        for conn, rid, _ in self._waiters.pop(name, []):
            conn.waits -= 1
            conn.send(error(rid, "unknown_load", f"load {name!r} was released"))

    def closed(self, conn: Connection) -> None:
        for name in conn.waiting:
            waiters = [w for w in self._waiters.get(name, []) if w[0] is not conn]
            if waiters:
                self._waiters[name] = waiters
            else:
                self._waiters.pop(name, None)

    def stop(self) -> None:
        """Not serving any more: every connection is closed, so are its waits."""
        self._waiters.clear()
