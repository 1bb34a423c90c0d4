"""The coordination service: the protocol (semaphore.py) wired to the broker, the disk and the clock.

``acquire(semaphore, load)`` returns once this node holds a cluster slot for the
load; cancelling it never leaks a slot. ``release`` gives it back. A slot can
also be *revoked* (the node lost the broker for longer than its lease): the
``on_revoke`` callback hears of it, and so it does when coordination fails.
``run()`` is one task of the daemon's TaskGroup; cancelling it drains the node
(its free slots, and the mint if it is the bank, go to the bank or its heir
first, within ``drainSeconds``), then takes every held slot back without
telling ``on_revoke`` (the holders stop with the daemon, and a restarted gate
asks for its starting loads' slots again) and leaves with the Last Will, so the
heir adopts the held remainder unless it is back within the will delay.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import math
import time
from collections import Counter
from collections.abc import Callable
from typing import Any

from nodeguard import __version__
from nodeguard.coordination.mqtt_link import Incoming, LinkDown, MqttLink, WillSpec, raise_if_cancelling
from nodeguard.coordination.records import Copy, Gone, Saved
from nodeguard.coordination.semaphore import Cluster, Effects, Phase, ProtocolNode
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
    encode_census,
    encode_copy,
    encode_gone,
    encode_ledger,
    encode_member,
    encode_status,
    encode_want,
)
from nodeguard.log import RateLimiter, get_logger
from nodeguard.node_identity import node_name as default_node_name

log = get_logger("nodeguard.coordination")

Revoke = Callable[[str, str], None]
Event = Callable[[str, dict[str, Any]], None]
CLEANUP_SECONDS = 1.0  # acknowledgements and pruned grants wait at most this long for a ledger
WARN_NOTES = {"fenced", "waiting for heir", "rolled back after own will: estate goes to heir"}
CENSUS_MIN_SECONDS = 1.0  # the bank publishes allotment changes in its census once a heartbeat, at most once a second
BANK_RECORD_SECONDS = 0.2  # and a changed bank record at most this often (a burst of joins goes out as one)


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

    # --- the daemon's side ---------------------------------------------------------------

    async def run(self) -> None:
        if not self.enabled:
            await asyncio.Event().wait()
            return
        self._wake = asyncio.Event()
        self._changed = asyncio.Event()
        try:
            async with asyncio.TaskGroup() as group:
                self._group = group
                group.create_task(self.link.run(), name="coordination-link")
                group.create_task(self._io_loop(), name="coordination-io")
                group.create_task(self._clock(), name="coordination-clock")
                try:
                    await asyncio.Event().wait()
                except asyncio.CancelledError:
                    await self._drain()  # the link is still up: hand the free slots on first
                    raise
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

    async def _drain(self) -> None:
        """Leaving: the free slots (and the mint) go to the bank or the heir, acknowledged within drainSeconds;
        then the membership record says so. A held remainder is adopted after the will (docs, I12)."""
        if not self.link.connected or self.node.state is None or self._changed is None:
            return
        started = time.monotonic()
        deadline = started + self.settings.drain_seconds
        self.on_revoke = None  # stopping, not losing the broker: a restarted gate asks for its loads' slots again
        self._apply(self.node.drain(started))
        while True:
            while not self.node.drained and time.monotonic() < deadline and self.link.connected:
                self._changed.clear()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._changed.wait(), max(0.0, deadline - time.monotonic()))
            member = self.node.member()
            with contextlib.suppress(LinkDown, TimeoutError):
                await asyncio.wait_for(
                    self.link.publish(self.topics.member(self.name), encode_member(member), retain=True), 1.0
                )
            # A grant sent before the others saw us leaving may have arrived meanwhile: it is passed on too.
            if self.node.drained or time.monotonic() >= deadline or not self.link.connected:
                break
        log.info(
            "drained" if self.node.drained else "drain incomplete: the heir adopts the rest after the will",
            node=self.name,
            seconds=round(time.monotonic() - started, 3),
            state=member.state.value,
        )

    def reconfigure(self, settings: CoordinationSettings) -> None:
        if settings == self.settings:
            return
        if not self.enabled or not settings.enabled:
            log.warning("turning coordination on or off takes a restart; keeping the running settings")
            return
        live = {"semaphores": settings.semaphores, "seeds": settings.seeds, "nodes": settings.nodes}
        rest_same = settings.model_copy(update={k: getattr(self.settings, k) for k in live}) == self.settings
        if settings.semaphores != self.settings.semaphores or settings.genesis_seeds != self.settings.genesis_seeds:
            self.settings = self.settings.model_copy(update=live)
            self.cluster = Cluster(tuple(self.settings.genesis_seeds), self.settings.semaphores)
            self._apply(self.node.reconfigure(self.cluster, time.monotonic()))
            log.info("coordination caps reloaded", caps=dict(self.settings.semaphores))
        if not rest_same:
            log.warning("coordination settings other than semaphores and seeds change only on restart")

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
        if not self.enabled or semaphore not in self.node.held:
            return
        self._apply(self.node.withdraw(semaphore, load_id, time.monotonic()))

    def status(self) -> dict[str, Any]:
        if not self.enabled:
            return {"enabled": False}
        node, now = self.node, time.monotonic()
        stats = self.link.stats
        state = node.state
        census = node.census
        applied = (
            dict(state.mint)
            if state is not None and state.mint is not None
            else (dict(census.caps) if census is not None else {})
        )
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
            "leaving": node.leaving,
            "epoch": node.epoch,
            "heir": node.heir,
            "bank": node.bank,
            "seeds": list(self.cluster.seeds),
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
                    "appliedCap": applied.get(sem),
                    "allotment": state.allot.get(sem, 0) if state is not None else 0,
                    "held": len(node.held[sem]),
                    "waiting": len(node.waiting[sem]),
                    "admitted": node.admitted[sem],
                    "grantsOut": sum(g.n for g in state.grants.values() if g.sem == sem) if state else 0,
                }
                for sem, cap in self.cluster.caps.items()
            },
            "members": self._members(),
            "counters": dict(self.counters + node.counters),
        }

    def _members(self) -> dict[str, dict[str, Any]]:
        """The members as the bank's census shows them (this node's own entry from its own state); the census is
        read again when it is older than a heartbeat, so a status or a scrape shows it a moment later."""
        now = time.monotonic()
        if (
            not self.node.is_bank
            and self.link.connected
            and self._group is not None
            and not self._census_reading
            and now - self._census_read_at >= self.settings.heartbeat
        ):
            self._census_read_at, self._census_reading = now, True
            self._group.create_task(self._read_census())
        census = self.node.full_census or self.node.census
        members: dict[str, dict[str, Any]] = {}
        if census is not None:
            for name in census.joined:
                members[name] = {"state": "joined", "allotment": {}, "heir": ""}
            for name, view in sorted(census.members.items()):
                members[name] = {"state": view.state.value, "allotment": dict(view.allot), "heir": view.heir}
            if census.bank in members:
                members[census.bank]["bank"] = True
        state = self.node.state
        if state is not None:
            me = "leaving" if self.node.leaving else ("joined" if self.node.phase is Phase.ONLINE else "offline")
            members[self.name] = {"state": me, "allotment": dict(state.allot), "heir": self.node.heir}
            if state.mint is not None:
                members[self.name]["bank"] = True
        return members

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

    # --- internals ----------------------------------------------------------------------------

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

    def _send(
        self,
        topic: str,
        payload: bytes,
        on_failure: Callable[[], None],
        *,
        expiry: int | None = None,
        retain: bool = True,
    ) -> None:
        """Publish without waiting for the PUBACK (the wire keeps the order); it renews the lease when it comes."""
        assert self._group is not None
        self._group.create_task(self._publish(topic, payload, on_failure, expiry, retain))

    async def _publish(
        self, topic: str, payload: bytes, on_failure: Callable[[], None], expiry: int | None, retain: bool
    ) -> None:
        sent_at = time.monotonic()
        try:
            conn = await self.link.publish(topic, payload, retain=retain, expiry=expiry)
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
        online = node.phase is Phase.ONLINE
        # A copy shows the persisted ledger: the retained one goes first, so no reader sees the copy's news before it.
        publish = online and (node.wants_ledger or (node.ledger_stale and (cleanup or node.copies_pending)))
        if node.may_publish_ledger and (publish or node.copies_pending):
            if not up_to_date or persisted is None:
                node.wants_persist = True
                self._kick()
                return
            ledger = persisted.ledger(self.name)
            if publish:
                node.wants_ledger = node.ledger_stale = False
                self._next_cleanup = now + CLEANUP_SECONDS
                self._send(self.topics.ledger(self.name), encode_ledger(ledger), self._ledger_failed)
            hint = node.queue_hint() if node.is_bank else {}
            for peer, ask in sorted(node.take_copies().items()):
                if peer != self.name:
                    forward = node.forward_hint(peer) if node.is_bank else {}
                    copy = encode_copy(Copy(ledger, ask, hint, forward))
                    self._send(self.topics.inbox(peer), copy, self._nothing, retain=False)
        want = node.take_want(now)
        if want is not None:
            self._send(self.topics.inbox(want[0]), encode_want(want[1]), self._want_failed, retain=False)
        if node.wants_member and (online or node.leaving):
            self._send(self.topics.member(self.name), encode_member(node.member()), self._member_failed)
        if online and node.is_bank:
            self._publish_bank_views(now)
        if node.wants_status or heartbeat:
            node.wants_status = False
            self._next_heartbeat = now + self.settings.heartbeat
            status = encode_status(node.status(__version__, int(time.time() * 1000)))
            self._send(self.topics.status(self.name), status, self._status_failed, expiry=self.status_ttl)
        extra = self.topics.bank_subscriptions() if node.is_bank and online else []
        if extra != self.link.extra and not self._subscribing:
            self._subscribing = True
            assert self._group is not None
            self._group.create_task(self._subscribe(extra))
        for other in sorted(node.take_reads()):
            await self._read(other)

    def _publish_bank_views(self, now: float) -> None:
        """The bank record when it changed (at most every BANK_RECORD_SECONDS: joins come in bursts), and the census
        once a heartbeat when allotments changed."""
        node = self.node
        if node.wants_census and now >= self._next_bank:
            record = node.take_census(full=False)
            if record is not None:
                key = dataclasses.replace(record, seq=0, ledger_seq=0)
                if key != self._last_bank:
                    self._last_bank = key
                    self._next_bank = now + BANK_RECORD_SECONDS
                    self._send(self.topics.bank, encode_census(record), self._census_failed)
        if node.census_stale and now >= self._next_census:
            census = node.take_census(full=True)
            if census is not None:
                self._next_census = now + max(CENSUS_MIN_SECONDS, self.settings.heartbeat)
                self._send(self.topics.census, encode_census(census), self._census_stale)

    def _census_stale(self) -> None:
        self.node.census_stale = True

    async def _read_census(self) -> None:
        """The census, for status: read on demand, not subscribed (it names every member)."""
        try:
            await self.link.refresh(self.topics.census, timeout=max(5.0, self.settings.lease_seconds))
        except LinkDown:
            pass
        finally:
            self._census_reading = False

    async def _subscribe(self, topics: list[str]) -> None:
        try:
            await self.link.set_extra(topics)
        except LinkDown:
            pass
        finally:
            self._subscribing = False
            self._kick()

    def _nothing(self) -> None:
        """A copy that did not go out: its grant or question is sent again after the retry delay."""

    def _ledger_failed(self) -> None:
        self.node.wants_ledger = True

    def _status_failed(self) -> None:
        self.node.wants_status = True

    def _member_failed(self) -> None:
        self.node.wants_member = True

    def _census_failed(self) -> None:
        self.node.wants_census = True

    def _want_failed(self) -> None:
        self.node._want_sent = None

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
        """Lease deadlines, heartbeats, retries and the census period."""
        while True:
            now = time.monotonic()
            self._apply(self.node.tick(now))
            node = self.node
            if self.link.connected and (
                now >= self._next_heartbeat
                or (node.ledger_stale and now >= self._next_cleanup)
                or (node.census_stale and now >= self._next_census)
                or (node.wants_census and now >= self._next_bank)
            ):
                self._kick()
            wake_at = min(self._next_heartbeat, now + min(CLEANUP_SECONDS, node.retry), node.next_read_at)
            if node.census_stale:
                wake_at = min(wake_at, self._next_census)
            if node.wants_census:
                wake_at = min(wake_at, self._next_bank)
            if not node.fenced:
                wake_at = min(wake_at, node.lease_until)
            await asyncio.sleep(max(0.005, wake_at - time.monotonic()))
            raise_if_cancelling()
