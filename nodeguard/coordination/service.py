"""The coordination service: the protocol (semaphore.py) wired to the broker, the disk and the clock.

``acquire(semaphore, load)`` returns once this node holds a cluster slot for the
load; cancelling it never leaks a slot. ``release`` gives it back. A slot can
also be *revoked* (the node lost the broker for longer than its lease): the
``on_revoke`` callback hears of it, and so it does when coordination fails.
``run()`` is one task of the daemon's TaskGroup; cancelling it takes every slot
back without telling ``on_revoke`` (the holders stop with the daemon, and a
restarted gate asks for its starting loads' slots again) and leaves with the
Last Will, so the heir adopts this node's slots unless it is back within the
will delay.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import time
from collections import Counter
from collections.abc import Callable
from typing import Any

from nodeguard import __version__
from nodeguard.coordination.mqtt_link import Incoming, LinkDown, MqttLink, WillSpec, raise_if_cancelling
from nodeguard.coordination.semaphore import Cluster, Effects, Gone, Node, Saved, StateMismatch
from nodeguard.coordination.settings import CoordinationError, CoordinationSettings, load_password, tls_context
from nodeguard.coordination.store import StateStore
from nodeguard.coordination.topics import (
    Malformed,
    Topics,
    UnknownVersion,
    decode_gone,
    decode_ledger,
    decode_status,
    encode_gone,
    encode_ledger,
    encode_status,
)
from nodeguard.log import RateLimiter, get_logger
from nodeguard.node_identity import node_name as default_node_name

log = get_logger("nodeguard.coordination")

Revoke = Callable[[str, str], None]
Event = Callable[[str, dict[str, Any]], None]
CLEANUP_SECONDS = 1.0  # acknowledgements and pruned grants wait at most this long for a ledger
WARN_NOTES = {"fenced", "waiting for heir", "rolled back after own will: estate goes to heir"}


class CoordinationService:
    def __init__(
        self,
        settings: CoordinationSettings,
        node_name: str | None = None,
        *,
        on_revoke: Revoke | None = None,
        on_event: Event | None = None,
    ) -> None:
        self.settings = settings
        self.enabled = settings.enabled
        self.on_revoke = on_revoke
        self.on_event = on_event  # instrumentation (benchmarks, tests)
        self.counters: Counter[str] = Counter()
        self.failed: str | None = None
        self._futures: dict[tuple[str, str], asyncio.Future[None]] = {}
        self._wake: asyncio.Event | None = None
        self._warn = RateLimiter(30.0)
        if not self.enabled:
            return
        name = settings.node_name or node_name or default_node_name()
        if name not in settings.nodes:
            raise CoordinationError(f"coordination.nodes: this node ({name!r}) is not listed")
        self.name = name
        self.cluster = Cluster(tuple(settings.nodes), settings.semaphores)
        self.topics = Topics(settings.cluster)
        self.store = StateStore(settings.state_path(), name)
        try:
            saved = self.store.load()
        except OSError as exc:
            raise CoordinationError(f"coordination.stateDir: cannot read {self.store.path}: {exc}") from None
        self.status_ttl = math.ceil(settings.heartbeat * 3) + 1
        try:
            self.node = Node(
                name, self.cluster, saved, lease_seconds=settings.lease_seconds, status_ttl=self.status_ttl
            )
        except StateMismatch as exc:
            raise CoordinationError(f"coordination.semaphores.{exc.semaphore}: {exc} ({self.store.path})") from None
        self.link = MqttLink(
            settings.broker,
            name,
            self.topics.subscriptions(name),
            self.topics.sync(name),
            self,
            password=load_password(settings.broker),
            tls=tls_context(settings.broker),
        )
        self._persisted: Saved | None = saved
        self._reading: dict[str, Any] = {}
        self._sync_task: asyncio.Task[None] | None = None
        self._group: asyncio.TaskGroup | None = None
        self._next_heartbeat = 0.0
        self._next_cleanup = 0.0

    # --- the daemon's side ---------------------------------------------------------------

    async def run(self) -> None:
        if not self.enabled:
            await asyncio.Event().wait()
            return
        self._wake = asyncio.Event()
        try:
            async with asyncio.TaskGroup() as group:
                self._group = group
                group.create_task(self.link.run(), name="coordination-link")
                group.create_task(self._io_loop(), name="coordination-io")
                group.create_task(self._clock(), name="coordination-clock")
        except Exception as exc:  # a bug here must not take the node's guard down: fence and stay down
            self.failed = repr(exc)
            log.error("coordination failed; no cluster slots until restart", error=self.failed, exc_info=True)
        finally:
            if self._sync_task is not None:
                self._sync_task.cancel()
            if self.failed is None:
                self.on_revoke = None  # stopping, not losing the broker
            self._apply(self.node.stop(time.monotonic()))
            for future in self._futures.values():
                if not future.done():
                    future.set_exception(CoordinationError("coordination stopped"))
            with contextlib.suppress(OSError):
                snapshot = self.node.snapshot()
                if snapshot is not None:
                    self.store.save(snapshot)
        await asyncio.Event().wait()  # failed: the daemon's other tasks go on

    def reconfigure(self, settings: CoordinationSettings) -> None:
        if settings == self.settings:
            return
        # Caps and members must change together on every node; the rest needs a new connection.
        log.warning("coordination settings change only on restart; keeping the running ones")

    async def acquire(self, semaphore: str, load_id: str) -> None:
        """Returns once this node holds a slot of ``semaphore`` for ``load_id``; cancellable."""
        if not self.enabled:
            raise CoordinationError("coordination is disabled (coordination.enabled)")
        if self.failed is not None:
            raise CoordinationError(f"coordination failed: {self.failed}")
        if semaphore not in self.cluster.caps:
            raise CoordinationError(f"unknown cluster semaphore {semaphore!r}; configured: {sorted(self.cluster.caps)}")
        key = (semaphore, load_id)
        if load_id in self.node.held[semaphore]:
            return
        if key in self._futures:
            raise CoordinationError(f"{load_id!r} is already waiting for {semaphore!r}")
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._futures[key] = future
        try:
            self._apply(self.node.request(semaphore, load_id, time.monotonic()))
            await future
        except asyncio.CancelledError:
            # Admitted or not: give it back, so a cancelled waiter never keeps a slot.
            self._apply(self.node.withdraw(semaphore, load_id, time.monotonic()))
            raise
        finally:
            self._futures.pop(key, None)

    def release(self, semaphore: str, load_id: str) -> None:
        if not self.enabled or semaphore not in self.cluster.caps:
            return
        self._apply(self.node.withdraw(semaphore, load_id, time.monotonic()))

    def status(self) -> dict[str, Any]:
        if not self.enabled:
            return {"enabled": False}
        node, now = self.node, time.monotonic()
        stats = self.link.stats
        state = node.state
        return {
            "enabled": True,
            "failed": self.failed,
            "node": self.name,
            "cluster": self.settings.cluster,
            "phase": node.phase.value,
            "connected": self.link.connected,
            "admitting": node.admitting,
            "fenced": node.fenced,
            "fencedReason": node.fenced_reason,
            "epoch": node.epoch,
            "heir": node.heir,
            "leaseRemainingSeconds": round(max(0.0, node.lease_until - now), 3),
            "outageSeconds": round(now - stats.disconnected_since, 3) if stats.disconnected_since else 0.0,
            "broker": {
                "address": f"{self.settings.broker.host}:{self.settings.broker.port}",
                "connects": stats.connects,
                "disconnects": stats.disconnects,
                "failedAttempts": stats.failed_attempts,
                "refused": stats.refused,
                "published": stats.published,
                "received": stats.received,
                "lastError": stats.last_error,
            },
            "semaphores": {
                sem: {
                    "cap": cap,
                    "allotment": state.allot.get(sem, 0) if state is not None else 0,
                    "held": len(node.held[sem]),
                    "waiting": len(node.waiting[sem]),
                    "admitted": node.admitted[sem],
                    "grantsOut": sum(g.n for g in state.grants.values() if g.sem == sem) if state else 0,
                }
                for sem, cap in self.cluster.caps.items()
            },
            "counters": dict(self.counters + node.counters),
        }

    # --- the link's side (mqtt_link.Handler) ------------------------------------------------

    async def before_connect(self) -> WillSpec:
        epoch = self.node.begin_connect(int(time.time() * 1000))
        await self._persist()  # the will names this epoch: it must survive a crash
        delay = self.settings.will_delay_seconds
        return WillSpec(self.topics.gone(self.name), encode_gone(Gone(self.name, epoch)), delay, 2 * delay)

    def on_connected(self, session_present: bool) -> None:
        self._apply(self.node.connected(time.monotonic(), session_present))
        self._next_heartbeat = 0.0
        self._sync_task = asyncio.get_running_loop().create_task(self._sync(self.link.conn))

    def on_disconnected(self, reason: str) -> None:
        if self._sync_task is not None:
            self._sync_task.cancel()
        self._apply(self.node.disconnected(time.monotonic()))

    def on_message(self, message: Incoming) -> None:
        parsed = self.topics.parse(message.topic)
        if parsed is None:
            self.counters["ignored.topic"] += 1
            return
        kind, sender = parsed
        now = time.monotonic()
        if not message.payload:
            return  # a cleared retained message
        try:
            if kind == "ledger":
                ledger = decode_ledger(message.payload, sender)
                if sender in self._reading:
                    self._reading[sender] = ledger
                self._apply(self.node.on_ledger(ledger, now))
            elif kind == "status":
                self._apply(self.node.on_status(decode_status(message.payload, sender), now))
            elif kind == "gone":
                self._apply(self.node.on_gone(decode_gone(message.payload, sender), now))
        except UnknownVersion as exc:
            self._ignored("unknown_version", message.topic, exc)
        except Malformed as exc:
            self._ignored("malformed", message.topic, exc)

    # --- internals ----------------------------------------------------------------------------

    def _ignored(self, what: str, topic: str, exc: Exception) -> None:
        self.counters[f"ignored.{what}"] += 1
        if self._warn.allow(f"{what}:{topic}"):
            log.warning("ignored a coordination message", reason=what, topic=topic, error=str(exc))

    async def _sync(self, conn: int) -> None:
        """Read the broker's retained state (a barrier after subscribing) before rejoining."""
        try:
            await self.link.barrier(timeout=max(5.0, self.settings.lease_seconds))
        except LinkDown:
            return
        if conn == self.link.conn:
            self._apply(self.node.synced(time.monotonic()))

    def _apply(self, fx: Effects) -> None:
        now = time.monotonic()
        for a in fx.admitted:
            future = self._futures.get((a.sem, a.load))
            if future is None or future.done():
                self._apply(self.node.withdraw(a.sem, a.load, now))  # nobody waits for it any more
                continue
            future.set_result(None)
            if self.on_event is not None:
                self.on_event("admitted", {"sem": a.sem, "load": a.load, "via": a.via, "t": now})
        for r in fx.revoked:
            if self.on_revoke is not None:
                self.on_revoke(r.sem, r.load)
        for d in fx.donated:
            if self.on_event is not None:
                self.on_event("donated", {"grant": d.grant, "freed_at": d.freed_at, "t": now})
        for event, fields in fx.notes:
            if event in WARN_NOTES:
                log.warning(event, node=self.name, **fields)
            else:
                log.info(event, node=self.name, **fields)
        node = self.node
        if node.wants_reconnect:
            node.wants_reconnect = False
            self.link.reconnect()
        if node.wants_sync:
            node.wants_sync = False
            if self.link.connected:
                if self._sync_task is not None:
                    self._sync_task.cancel()
                self._sync_task = asyncio.get_running_loop().create_task(self._sync(self.link.conn))
        if self._wake is not None and (
            node.wants_persist or node.wants_ledger or node.wants_status or node.wants_reads
        ):
            self._wake.set()

    async def _persist(self) -> bool:
        snapshot = self.node.snapshot()
        if snapshot is None:
            return True
        try:
            if self.store.boot is None:
                await asyncio.to_thread(self.store.save, snapshot)  # fsync'd: not in the loop
            else:
                self.store.save(snapshot)  # a few kilobytes into the page cache: microseconds
        except OSError as exc:
            self.node.wants_persist = True
            if self._warn.allow("persist"):
                log.error(
                    "cannot persist the coordination state; publishing nothing new",
                    path=str(self.store.path),
                    error=str(exc),
                )
            return False
        self._persisted = snapshot
        return True

    def _send(self, topic: str, payload: bytes, on_failure: Callable[[], None], *, expiry: int | None = None) -> None:
        """Publish without waiting for the PUBACK (the wire keeps the order); it renews the lease when it comes."""
        assert self._group is not None
        self._group.create_task(self._publish(topic, payload, on_failure, expiry))

    async def _publish(self, topic: str, payload: bytes, on_failure: Callable[[], None], expiry: int | None) -> None:
        sent_at = time.monotonic()
        try:
            conn = await self.link.publish(topic, payload, retain=True, expiry=expiry)
        except LinkDown:
            on_failure()
            self._kick()
            return
        self._apply(self.node.lease_renewed(sent_at, conn, time.monotonic()))

    async def _io_loop(self) -> None:
        assert self._wake is not None
        while True:
            await self._wake.wait()
            self._wake.clear()
            await self._flush()
            raise_if_cancelling()

    async def _flush(self) -> None:
        node = self.node
        if node.wants_persist and not await self._persist():
            return
        if not self.link.connected:
            return
        now = time.monotonic()
        heartbeat = now >= self._next_heartbeat
        cleanup = now >= self._next_cleanup
        persisted, state = self._persisted, node.state
        up_to_date = (
            persisted is not None and state is not None and (persisted.seq, persisted.epoch) == (state.seq, state.epoch)
        )
        if node.may_publish_ledger and (node.wants_ledger or (node.ledger_stale and cleanup)):
            if not up_to_date or persisted is None:
                node.wants_persist = True
                self._kick()
                return
            node.wants_ledger = node.ledger_stale = False
            self._next_cleanup = now + CLEANUP_SECONDS
            self._send(self.topics.ledger(self.name), encode_ledger(persisted.ledger(self.name)), self._ledger_failed)
        if node.wants_status or heartbeat:
            node.wants_status = False
            self._next_heartbeat = now + self.settings.heartbeat
            status = encode_status(node.status(__version__, int(time.time() * 1000)))
            self._send(self.topics.status(self.name), status, self._status_failed, expiry=self.status_ttl)
        for other in sorted(node.take_reads()):
            await self._read(other)

    def _ledger_failed(self) -> None:
        self.node.wants_ledger = True

    def _status_failed(self) -> None:
        self.node.wants_status = True

    async def _read(self, other: str) -> None:
        conn = self.link.conn
        self._reading[other] = None
        try:
            await self.link.refresh(self.topics.ledger(other), timeout=max(5.0, self.settings.lease_seconds))
        except LinkDown:
            return
        finally:
            ledger = self._reading.pop(other, None)
        self._apply(self.node.read_done(other, ledger, conn, time.monotonic()))

    def _kick(self) -> None:
        if self._wake is not None:
            self._wake.set()

    async def _clock(self) -> None:
        """Lease deadlines and heartbeats."""
        while True:
            now = time.monotonic()
            self._apply(self.node.tick(now))
            if self.link.connected and (
                now >= self._next_heartbeat or (self.node.ledger_stale and now >= self._next_cleanup)
            ):
                self._kick()
            wake_at = min(self._next_heartbeat, now + CLEANUP_SECONDS, self.node.next_read_at)
            if not self.node.fenced:
                wake_at = min(wake_at, self.node.lease_until)
            await asyncio.sleep(max(0.005, wake_at - time.monotonic()))
            raise_if_cancelling()
