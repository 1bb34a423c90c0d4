"""The coordination service: the protocol (semaphore.py) wired to the broker, the disk and the clock.

``acquire(semaphore, load)`` returns once this node holds a cluster slot for the
load; cancelling it never leaks a slot. ``release`` gives it back. A slot can
also be *revoked* (the node lost the broker for longer than its lease): the
``on_revoke`` callback hears of it, and so it does when coordination fails.
``run()`` is one task of the daemon's TaskGroup; cancelling it drains the node
(its free slots, and the mint if it is the bank, go to the bank or its heir
first, within ``drainSeconds``); the slots of loads still starting stay in its
persisted allotment (I13): a restarted gate ``claim``s them back before the node
is online, and the node leaves with its Last Will, so its heir adopts them unless
it is back within the will delay. The lease is persisted beside the state: a
restarted gate's loads run on it until their slots are held again (I14).
"""

from __future__ import annotations

import asyncio
import contextlib
import time

from nodeguard.coordination.mqtt_link import LinkDown
from nodeguard.coordination.semaphore import Cluster
from nodeguard.coordination.service_core import log
from nodeguard.coordination.service_status import ServiceStatus
from nodeguard.coordination.settings import CoordinationError, CoordinationSettings
from nodeguard.coordination.topics import (
    encode_member,
)


class CoordinationService(ServiceStatus):
    """The daemon's side: run (and drain), reloads, and slots acquired and released for loads."""

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
            self._write_lease(force=True)
        await asyncio.Event().wait()  # failed: the daemon's other tasks go on

    async def _drain(self) -> None:
        """Leaving: the free slots (and the mint) go to the bank or the heir, acknowledged within drainSeconds;
        then the membership record says so. A held remainder is adopted after the will (docs, I12)."""
        if not self.link.connected or self.node.state is None or self._changed is None:
            return
        started = time.monotonic()
        deadline = started + self.settings.drain_seconds
        self.on_revoke = None  # stopping, not losing the broker: the loads go on, a restarted gate claims their slots
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
        self._claims.discard(key)
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

    def claim(self, semaphore: str, load_id: str) -> None:
        """A load that was starting before a restart asks for its slot again, before this node is online, so that it
        is served from the node's allotment ahead of any new load and before free slots go back (I13); ``acquire``
        then waits for it."""
        if not self.enabled or self.failed is not None or semaphore not in self.cluster.caps:
            return
        self._claims.add((semaphore, load_id))
        self._apply(self.node.request(semaphore, load_id, time.monotonic()))

    def release(self, semaphore: str, load_id: str) -> None:
        if not self.enabled or semaphore not in self.node.held:
            return
        self._claims.discard((semaphore, load_id))
        self._apply(self.node.withdraw(semaphore, load_id, time.monotonic()))
