"""The gate service inside the daemon: the socket, the table of loads, probes, timers and the state file.

Everything is event-driven. A request, a probe result, a start timeout or new
node signals changes the table, and the table admits what it can in the same
call. Timers exist only for what time alone changes: start timeouts, and holds
that lift at a known moment (the maxRate bucket refills, the minRate interval
ends). Clients never poll: ``wait`` is answered when its condition holds.

Cluster slots: a load that names a cluster semaphore gets its slot from the
coordination service (``acquire``) before it queues here, and gives it back
when it is ready or fails. A slot revoked because this node lost the broker
past its lease sends a queued load back to wait, and fails a starting one.

Restart safety: an admission is written to the state file (group commit:
every admission since the last write goes into the next one) before any client
hears of it, so a daemon killed at any moment comes back holding at least every
slot it granted.

GateService ties the parts together: requests.py carries out requests and
answers waits, timers.py runs probes and timers, slots.py asks for cluster
slots, statefile.py keeps the state file.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections import Counter
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from nodeguard.gate import store
from nodeguard.gate.loads import GateRefused, LoadTable
from nodeguard.gate.policy import Limits, SignalWindow
from nodeguard.gate.protocol import ProtocolError, error, parse_request, request_adapter
from nodeguard.gate.requests import Requests
from nodeguard.gate.server import (
    Connection,
    Listening,
    Peer,
    SocketUnavailable,
    accept_loop,
    apply_ownership,
    authorised,
    bind,
    load_psutil,
)
from nodeguard.gate.settings import GateSettings
from nodeguard.gate.slots import ClusterSlots, slot_id
from nodeguard.gate.statefile import StateFile
from nodeguard.gate.states import ClusterSlot, Load, LoadState
from nodeguard.gate.timers import Timers
from nodeguard.log import RateLimiter, get_logger
from nodeguard.model.snapshot import NodeUsage
from nodeguard.supervisor import supervise

if TYPE_CHECKING:
    from nodeguard.coordination.switch import Coordination

log = get_logger("nodeguard.gate")
CLIENT_GRACE = 10.0  # seconds a restored load's client has to attach again (the lease, with coordination)


def _warm_up() -> None:
    """What the first client would otherwise wait for: psutil (peer checks), the requests' validator."""
    load_psutil()
    request_adapter()


class GateService:
    def __init__(
        self, settings: GateSettings, cpus: int, state_dir: str, coordination: Coordination | None = None
    ) -> None:
        self.settings = settings
        self.coordination = coordination
        if coordination is not None:
            coordination.on_revoke = self.slot_revoked
        self.cpus = cpus
        self.state_path = os.path.join(state_dir, store.STATE_FILE)
        self.window = SignalWindow(settings.signal_window_seconds)
        self.table = LoadTable(
            Limits.from_settings(settings, cpus),
            self,
            time.monotonic(),
            start_timeout=settings.start_timeout_seconds,
            max_loads=settings.max_loads,
            keep_failed=settings.keep_failed_seconds,
        )
        self.counters: Counter[str] = Counter()  # requests, malformed, unauthorised, forbidden, refused
        self.serving = False
        self._problem: str | None = None
        # Called with each admitted load's wait (seconds from submit to admission), e.g. a metrics histogram.
        self.on_admission: Callable[[float], None] | None = None
        self._warnings = RateLimiter(60.0)
        self._state = StateFile(self.state_path, self.table, self._warnings)
        self._timers = Timers(self.table)
        self._slots = ClusterSlots(coordination, self.table, self._timers.after)

        def status() -> dict[str, Any]:
            return self.status()  # looked up on each request, not bound once: tests replace it to inject a fault

        self._requests = Requests(self.table, self._state, self.counters, coordination, status)
        self._group: asyncio.TaskGroup | None = None
        self._connections: set[Connection] = set()
        self._stopping = False
        self._state.restore(self._may_use)
        # Loads restored as starting: their clients must come back, and their cluster slots be held again, in time.
        self._restored = {load.name: load.seq for load in self.table.loads.values() if load.restored}
        self._checks: list[asyncio.TimerHandle] = []
        if coordination is not None:
            for load in self.table.loads.values():
                if load.cluster is ClusterSlot.WAITING and load.spec.semaphore is not None:
                    coordination.claim(load.spec.semaphore, slot_id(load.name, load.seq))

    # --- lifecycle ----------------------------------------------------------------

    async def run(self) -> None:
        """Serve until cancelled, under a supervisor: an error is logged, the gate restarts, the daemon goes on."""
        await supervise("gate", self._serve_once, self._report, expected=(SocketUnavailable,))

    def problem(self) -> str | None:
        """Why the gate does not serve (for /readyz), or None: serving."""
        if self.serving:
            return None
        return self._problem or "not serving yet"

    def _report(self, problem: str | None) -> None:
        self._problem = problem

    async def _serve_once(self) -> None:
        await asyncio.to_thread(_warm_up)  # off the event loop: ticks go on meanwhile
        try:
            listening = bind(self.settings)
        except (ValueError, OSError) as exc:  # a path the kernel refuses (NUL byte, too long) is a ValueError
            raise SocketUnavailable(f"cannot serve {self.settings.socket!r}: {exc}") from None
        await self._serve(listening)

    async def _serve(self, listening: Listening) -> None:
        self._stopping = False
        try:
            async with asyncio.TaskGroup() as group:
                self._group = group
                group.create_task(self._state.run(), name="gate-persist")
                group.create_task(accept_loop(listening.sock, self, self._connections), name="gate-accept")
                self._resume(time.monotonic(), group)
                self.serving, self._problem = True, None
                log.info("gate serving", socket=listening.path, **self._limits_status())
                try:
                    await asyncio.Event().wait()
                except asyncio.CancelledError:
                    # From here on a closing connection is the daemon stopping, not a client leaving.
                    self._stopping = True
                    raise
        finally:
            self._stopping = True
            self.serving = False
            self._group = None
            for handle in self._checks:
                handle.cancel()
            self._checks.clear()
            self._timers.stop()
            self._slots.stop()
            connections = list(self._connections)
            for conn in connections:
                conn.close(abort=True)  # a client that does not read would keep its descriptor
            self._connections.clear()
            self._requests.stop()
            self._state.forget_deferred()
            now = time.monotonic()
            for conn in connections:  # their clients reconnect and attach; what was not admitted yet fails
                self.table.disconnected(conn, now, keep_starting=True)
            self._state.write_now()
            listening.close()

    def _may_use(self, uid: int, gid: int) -> bool:
        return authorised(Peer(0, uid, gid), self.settings)

    @property
    def _writer(self) -> store.StateWriter:
        return self._state.writer  # tests reach in to inject write faults

    def _resume(self, now: float, group: asyncio.TaskGroup) -> None:
        """Serving (again): watch every starting load, ask for the cluster slots wanted, re-arm the hold timer."""
        for load in list(self.table.loads.values()):
            if load.state is LoadState.STARTING:
                self._timers.watch(load, now, group)
            if load.cluster is ClusterSlot.WAITING:
                self.wants_slot(load)
        self._timers.after()
        if self._restored:
            loop = asyncio.get_running_loop()
            coordination = self.coordination
            enabled = coordination is not None and coordination.enabled
            grace = coordination.settings.lease_seconds if coordination is not None and enabled else CLIENT_GRACE
            self._checks.append(loop.call_later(grace, self._clients_back))
            if coordination is not None and enabled:
                lease_left = max(0.0, coordination.previous_lease_until - now)
                self._checks.append(loop.call_later(lease_left, self._slots_back))

    def _restored_loads(self) -> list[Load]:
        found = (self.table.loads.get(name) for name in self._restored)
        return [
            load for load in found
            if load is not None and load.seq == self._restored[load.name] and load.state is LoadState.STARTING
        ]  # fmt: skip

    def _clients_back(self) -> None:
        """A restored load whose client did not attach again within the lease has no client: its command ended (or
        was stopped, I14) while the daemon was away, so its slots go now rather than at its start timeout."""
        now = time.monotonic()
        for load in self._restored_loads():
            if load.owner is None and not load.spec.detach:
                self.table.cancel(load.name, now, "its client did not come back after the daemon restarted")
                log.info("gate: restored load released: its client is gone", load=load.name)
        self._restored.clear()
        self._timers.after()

    def _slots_back(self) -> None:
        """A restored load ran on the previous process's lease; past it, without its cluster slot held again on a
        new connection, another node may have it (the will, I4): the start fails, and its client stops it (I14)."""
        now = time.monotonic()
        for load in self._restored_loads():
            if load.spec.semaphore is not None and load.cluster is not ClusterSlot.HELD:
                reason = f"cluster slot of {load.spec.semaphore!r} not held again within the node's lease"
                self.table.cancel(load.name, now, reason)
                log.warning("gate: restored load failed: " + reason, load=load.name)
        self._timers.after()

    # --- the daemon's calls -------------------------------------------------------

    def observe(self, node: NodeUsage) -> None:
        now = time.monotonic()
        self.window.add(now, None if node.load is None else node.load.load1, node.cpu_utilization)
        self.table.observe(self.window.signals(now), now)
        self.table.forget_failed(now)
        self._timers.after()

    def reconfigure(self, settings: GateSettings) -> None:
        old, self.settings = self.settings, settings
        if (settings.socket, settings.enabled) != (old.socket, old.enabled):
            log.warning("gate.socket and gate.enabled change only on restart", socket=old.socket)
        elif self.serving and (settings.socket_mode, settings.socket_owner, settings.socket_group) != (
            old.socket_mode,
            old.socket_owner,
            old.socket_group,
        ):
            try:
                apply_ownership(old.socket, settings)
            except (OSError, SocketUnavailable) as exc:
                log.error("gate socket: cannot apply the new owner or mode", error=str(exc))
        self.window.seconds = settings.signal_window_seconds
        self.table.reconfigure(
            Limits.from_settings(settings, self.cpus),
            time.monotonic(),
            start_timeout=settings.start_timeout_seconds,
            max_loads=settings.max_loads,
            keep_failed=settings.keep_failed_seconds,
        )
        self._timers.after()

    def status(self) -> dict[str, Any]:
        now = time.monotonic()
        signals = self.window.signals(now)
        decision = self.table.last_decision
        return {
            # Built only when gate.enabled (gate.switch); a reload turning it off takes a restart: on until then.
            "enabled": True,
            "serving": self.serving,
            "problem": self.problem(),
            "socket": self.settings.socket,
            "connections": len(self._connections),
            "limits": self._limits_status(),
            "signals": {"load1": signals.load1, "cpuPercent": signals.cpu_percent, "samples": signals.samples},
            "counts": self.table.counts(),
            "lastDecision": None if decision is None else {"admit": decision.admit, "reason": decision.reason},
            "counters": dict(self.table.counters + self.counters),
            "loads": list(self.table.statuses(now)),
        }

    def _limits_status(self) -> dict[str, Any]:
        limits = self.table.limits
        return {
            "slots": limits.slots,
            "cores": limits.cores,
            "maxLoadAverage": None if limits.max_load_multiplier is None else limits.max_load_multiplier * limits.cores,
            "maxCPU": limits.max_cpu,
            "minRate": limits.min_rate,
            "maxRate": limits.max_rate,
        }

    # --- requests (server.Handler) --------------------------------------------------

    def line(self, conn: Connection, raw: bytes) -> None:
        self.counters["requests"] += 1
        if not authorised(conn.peer, self.settings):
            self.counters["unauthorised"] += 1
            if self._warnings.allow(f"unauthorised-{conn.peer.uid}"):
                log.warning(
                    "gate: refused a peer", uid=conn.peer.uid, gid=conn.peer.gid, pid=conn.peer.pid,
                    command=conn.peer.command,
                )  # fmt: skip
            conn.send(error(None, "unauthorised", f"uid {conn.peer.uid} (gid {conn.peer.gid}) may not use the gate"))
            conn.close()
            return
        try:
            request = parse_request(raw)
        except ProtocolError as exc:
            self.counters["malformed"] += 1
            conn.send(error(exc.request_id, "invalid", exc.message, exc.details))
            return
        try:
            self._requests.dispatch(conn, request, time.monotonic())
        except GateRefused as exc:
            self.counters["refused"] += 1
            conn.send(error(request.id, exc.code, exc.message))
        except Exception:  # a bug in one request must not take the gate down
            log.error("gate: request failed", op=request.op, exc_info=True)
            conn.send(error(request.id, "internal", "internal error; see the daemon's log"))
        self._timers.after()

    def overlong(self, conn: Connection) -> None:
        self.counters["malformed"] += 1
        conn.send(error(None, "invalid", "request line too long"))

    def max_connections(self) -> int:
        return self.settings.max_connections

    def busy(self, connections: int) -> None:
        self.counters["busy"] += 1
        if self._warnings.allow("busy"):
            log.warning(
                "gate: too many connections; turning clients away",
                connections=connections,
                max_connections=self.settings.max_connections,
            )

    def accept_failed(self, exc: OSError) -> None:
        self.counters["accept_failed"] += 1
        if self._warnings.allow("accept"):
            log.error("gate: cannot accept connections for now; pausing", error=str(exc))

    def failed(self, conn: Connection, exc: Exception) -> None:
        self.counters["internal_errors"] += 1
        log.error("gate: a request could not be handled", pid=conn.peer.pid, exc_info=exc)
        conn.send(error(None, "internal", "internal error; see the daemon's log"))

    def closed(self, conn: Connection) -> None:
        if self._stopping:
            return
        self._requests.closed(conn)
        for load in self.table.disconnected(conn, time.monotonic()):
            log.info("gate: client left before its load was ready; slot freed", load=load.name, pid=conn.peer.pid)
        self._timers.after()

    # --- transitions (loads.Listener) ------------------------------------------------

    def changed(self, load: Load, previous: LoadState | None) -> None:
        if load.state in store.PERSISTED or previous in store.PERSISTED:
            self._state.bump()
        now = time.monotonic()
        if load.state is LoadState.STARTING:
            load.admit_gen = self._state.generation
            log.debug("gate: admitted", load=load.name, reason=load.reason)
            if self.on_admission is not None and load.admitted_at is not None and not load.restored:
                self.on_admission(load.admitted_at - load.submitted_at)
            if self._group is not None:
                self._timers.watch(load, now, self._group)
        elif previous is LoadState.STARTING:
            self._timers.unwatch(load.name)
        if load.state is LoadState.FAILED:
            log.info("gate: load failed", load=load.name, reason=load.reason)
        self._requests.changed(load)

    def removed(self, load: Load) -> None:
        if load.state in store.PERSISTED:
            self._state.bump()
        self._timers.unwatch(load.name)
        self._requests.removed(load.name)

    # --- cluster slots (loads.Listener and the coordination service) ------------------

    def wants_slot(self, load: Load) -> None:
        if self._group is not None:  # else not serving (not yet, or restarting): _resume asks for it
            self._slots.want(load, self._group)

    def slot_done(self, load: Load) -> None:
        self._slots.done(load)

    def slot_revoked(self, semaphore: str, slot: str) -> None:
        """The coordination service's ``on_revoke``."""
        self._slots.revoked(semaphore, slot)
