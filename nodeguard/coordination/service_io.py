"""The service's output to the broker: the retained ledger before any copy of it (I3), copies, demands, the
membership and bank records, the heartbeat whose PUBACK renews the lease (I4), reads of retained ledgers, and
the clock that paces them."""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import Callable

from nodeguard import __version__
from nodeguard.coordination.mqtt_link import LinkDown, raise_if_cancelling
from nodeguard.coordination.records import Copy
from nodeguard.coordination.semaphore import Phase
from nodeguard.coordination.service_core import ServiceCore
from nodeguard.coordination.topics import (
    encode_census,
    encode_copy,
    encode_ledger,
    encode_member,
    encode_status,
    encode_want,
)

CLEANUP_SECONDS = 1.0  # acknowledgements and pruned grants wait at most this long for a ledger
CENSUS_MIN_SECONDS = 1.0  # the bank publishes allotment changes in its census once a heartbeat, at most once a second
BANK_RECORD_SECONDS = 0.2  # and a changed bank record at most this often (a burst of joins goes out as one)


class ServiceIO(ServiceCore):
    """The publish, read and clock loops."""

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
        self._write_lease()

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
