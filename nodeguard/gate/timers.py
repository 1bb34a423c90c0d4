"""The gate's probes and timers: a starting load's deadline and readiness probe, and the one timer for a hold
that lifts at a known moment (the maxRate bucket refills, the minRate interval ends)."""

from __future__ import annotations

import asyncio
import time

from nodeguard.gate.loads import LoadTable
from nodeguard.gate.readiness import NotifyReadiness, Probe, wait_until_ready
from nodeguard.gate.states import Load
from nodeguard.log import get_logger

log = get_logger("nodeguard.gate")


class Timers:
    def __init__(self, table: LoadTable) -> None:
        self.table = table
        self._probes: dict[str, asyncio.Task[None]] = {}
        self._timeouts: dict[str, asyncio.TimerHandle] = {}
        self._retry: asyncio.TimerHandle | None = None
        self._retry_at: float | None = None

    def watch(self, load: Load, now: float, group: asyncio.TaskGroup) -> None:
        """A starting load: fail it at its deadline, and probe it if the daemon is to find out when it is ready."""
        loop = asyncio.get_running_loop()
        if load.deadline is not None:
            self._timeouts[load.name] = loop.call_later(
                max(0.0, load.deadline - now), self._expire, load.name, load.seq
            )
        readiness = load.spec.readiness
        if readiness is not None and not isinstance(readiness, NotifyReadiness):
            self._probes[load.name] = group.create_task(
                self._probe(load.name, load.seq, readiness, load.spec.uid, load.spec.gid),
                name=f"gate-probe-{load.name}",
            )

    def unwatch(self, name: str) -> None:
        handle = self._timeouts.pop(name, None)
        if handle is not None:
            handle.cancel()
        task = self._probes.pop(name, None)
        if task is not None and task is not asyncio.current_task():
            task.cancel()

    def _expire(self, name: str, seq: int) -> None:
        self._timeouts.pop(name, None)
        self.table.expire(name, seq, time.monotonic())
        self.after()

    async def _probe(self, name: str, seq: int, probe: Probe, uid: int, gid: int) -> None:
        def report(detail: str) -> None:
            load = self.table.loads.get(name)
            if load is not None and load.seq == seq:
                load.probe = detail

        try:
            await wait_until_ready(probe, uid, gid, report)
        except Exception:  # a probe's bug must not stop the gate; the start timeout still applies
            log.error("gate: probe crashed", load=name, exc_info=True)
            return
        self._probes.pop(name, None)
        load = self.table.loads.get(name)
        self.table.probe_succeeded(name, seq, load.probe if load is not None else "", time.monotonic())
        self.after()

    def after(self) -> None:
        """After any change: (re)arm the timer of a time-based hold."""
        retry_at = self.table.retry_at
        if retry_at == self._retry_at:
            return
        if self._retry is not None:
            self._retry.cancel()
            self._retry = None
        self._retry_at = retry_at
        if retry_at is not None:
            try:
                loop = asyncio.get_running_loop()
            except RuntimeError:
                return
            self._retry = loop.call_later(max(0.0, retry_at - time.monotonic()), self._on_retry)

    def _on_retry(self) -> None:
        self._retry, self._retry_at = None, None
        self.table.pump(time.monotonic())
        self.after()

    def stop(self) -> None:
        """Not serving any more: the probes are tasks of the gate's group, cancelled with it."""
        for handle in [*self._timeouts.values(), *([self._retry] if self._retry else [])]:
            handle.cancel()
        self._timeouts.clear()
        self._probes.clear()
        self._retry, self._retry_at = None, None
