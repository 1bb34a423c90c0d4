"""The coordination service's state, the broker link's events turned into protocol steps, and each step's effects
carried out: waiters admitted, revocations reported, the node's state persisted before anything shows it (I3)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import time
from collections import Counter
from collections.abc import Callable
from typing import Any

from nodeguard.atomic_file import write_atomic
from nodeguard.coordination.mqtt_link import Incoming, LinkDown, MqttLink, WillSpec
from nodeguard.coordination.records import Copy, Gone, Saved
from nodeguard.coordination.semaphore import Cluster, Effects, ProtocolNode
from nodeguard.coordination.settings import CoordinationError, CoordinationSettings, load_password, tls_context
from nodeguard.coordination.store import StateStore
from nodeguard.coordination.topics import (
    Malformed,
    Topics,
    UnknownVersion,
    decode_census,
    decode_gone,
    decode_inbox,
    decode_ledger,
    decode_member,
    encode_gone,
)
from nodeguard.log import RateLimiter, get_logger
from nodeguard.node_identity import node_name as default_node_name

log = get_logger("nodeguard.coordination")

Revoke = Callable[[str, str], None]
Event = Callable[[str, dict[str, Any]], None]
WARN_NOTES = {"fenced", "waiting for heir", "rolled back after own will: estate goes to heir"}


class ServiceCore:
    """The protocol node (semaphore.py) fed from the link (mqtt_link.Handler), and its effects carried out."""

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
        self._claims: set[tuple[str, str]] = set()  # restored loads' requests not yet awaited (service.claim)
        self._wake: asyncio.Event | None = None
        self._changed: asyncio.Event | None = None
        self._warn = RateLimiter(30.0)
        if not self.enabled:
            return
        name = settings.node_name or node_name or default_node_name()
        self.name = name
        self.cluster = Cluster(tuple(settings.genesis_seeds), settings.semaphores)
        self.topics = Topics(settings.cluster)
        self.store = StateStore(settings.state_path(), name)
        try:
            saved = self.store.load()
        except OSError as exc:
            raise CoordinationError(f"coordination.stateDir: cannot read {self.store.path}: {exc}") from None
        self.status_ttl = math.ceil(settings.heartbeat * 3) + 1
        self.node = ProtocolNode(name, self.cluster, saved, lease_seconds=settings.lease_seconds)
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
        # The lease of the previous process, on this boot's CLOCK_MONOTONIC: the restarted gate's loads that were
        # starting keep their slots on it until they hold them again on a new connection (I14).
        self._lease_path = settings.state_path().with_suffix(".lease")
        self.previous_lease_until = self._read_lease()
        self._lease_written = -math.inf
        self._reading: dict[str, Any] = {}
        self._sync_task: asyncio.Task[None] | None = None
        self._group: asyncio.TaskGroup | None = None
        self._next_heartbeat = 0.0
        self._next_cleanup = 0.0
        self._next_census = 0.0
        self._next_bank = 0.0
        self._last_bank: Any = None
        self._census_read_at = -math.inf
        self._census_reading = False
        self._subscribing = False

    @property
    def client_fence_seconds(self) -> float:
        """How long a client may go on starting its load without this daemon: the lease less a heartbeat, so it
        stops before the node's will can fire (the last renewal can be up to a heartbeat before it lost us, I14)."""
        return max(0.0, self.settings.lease_seconds - self.settings.heartbeat)

    def _read_lease(self) -> float:
        with contextlib.suppress(OSError, ValueError, TypeError, KeyError):
            doc = json.loads(self._lease_path.read_bytes())
            if self.store.boot is not None and doc["boot"] == self.store.boot:
                return float(doc["until"])
        return -math.inf

    def _write_lease(self, force: bool = False) -> None:
        """Persist the lease, at most once a second: the value on disk lags the real one, never leads it."""
        until = self.node.lease_until
        if self.store.boot is None or until == -math.inf or not (force or until >= self._lease_written + 1.0):
            return
        self._lease_written = until
        data = json.dumps({"boot": self.store.boot, "until": until}).encode()
        try:
            try:
                write_atomic(str(self._lease_path), data, durable=False)
            except FileNotFoundError:
                self._lease_path.parent.mkdir(parents=True, exist_ok=True)
                write_atomic(str(self._lease_path), data, durable=False)
        except OSError as exc:
            if self._warn.allow("lease"):
                log.error("cannot persist the coordination lease", path=str(self._lease_path), error=str(exc))

    # --- the link's side (mqtt_link.Handler) ------------------------------------------

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
            elif kind == "inbox":
                if sender != self.name:
                    self.counters["ignored.topic"] += 1
                    return
                item = decode_inbox(message.payload)
                if isinstance(item, Copy):
                    self._apply(self.node.on_copy(item, item.ledger.node, now))
                else:
                    self._apply(self.node.on_want(item, now))
            elif kind == "gone":
                self._apply(self.node.on_gone(decode_gone(message.payload, sender), now))
            elif kind == "bank":
                self._apply(self.node.on_census(decode_census(message.payload), now))
            elif kind == "census":
                self.node.on_full_census(decode_census(message.payload))
            elif kind == "member":
                self._apply(self.node.on_member(decode_member(message.payload, sender), now))
        except UnknownVersion as exc:
            self._ignored("unknown_version", message.topic, exc)
        except Malformed as exc:
            self._ignored("malformed", message.topic, exc)

    # --- carrying out a step ----------------------------------------------------------

    def _ignored(self, what: str, topic: str, exc: Exception) -> None:
        self.counters[f"ignored.{what}"] += 1
        if self._warn.allow(f"{what}:{topic}"):
            log.warning("ignored a coordination message", reason=what, topic=topic, error=str(exc))

    async def _sync(self, conn: int) -> None:
        """Read the broker's retained state (this node's ledger, a barrier after subscribing) before rejoining."""
        timeout = max(5.0, self.settings.lease_seconds)
        try:
            await self.link.refresh(self.topics.ledger(self.name), timeout=timeout)
            await self.link.barrier(timeout=timeout)
        except LinkDown:
            return
        if conn == self.link.conn:
            self._apply(self.node.synced(time.monotonic()))

    def _apply(self, fx: Effects) -> None:
        now = time.monotonic()
        for a in fx.admitted:
            future = self._futures.get((a.sem, a.load))
            if (a.sem, a.load) in self._claims:
                continue  # held for a restored load; its acquire finds it held
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
                self.on_event("donated", {"grant": d.grant, "freed_at": d.freed_at, "via": d.via, "t": now})
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
            node.wants_persist
            or node.wants_ledger
            or node.wants_status
            or node.wants_reads
            or node.copies_pending
            or node.wants_member
            or node.wants_census
            or node.want_pending
            or node.is_bank != bool(self.link.extra)
        ):
            self._wake.set()
        if self._changed is not None:
            self._changed.set()

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

    def _kick(self) -> None:
        if self._wake is not None:
            self._wake.set()
