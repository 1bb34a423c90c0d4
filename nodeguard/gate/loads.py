"""The table of loads and every transition between their states; no I/O, time passed in.

The service drives it (requests, probe results, timers, node signals) and hears
about every transition through a ``Listener``. Admission happens inside the
call that made room (a slot freed, a dependency ready, new signals), so a freed
slot admits the next pending load at once.

A load that names a cluster semaphore first waits for a cluster slot (asked of
the listener) and only then queues for the node's own admission, so loads
waiting on the cluster never take the node's starting slots from loads that
do not need it. The cluster slot is held until the load is ready or fails.
"""

from __future__ import annotations

import heapq
from collections import Counter
from collections.abc import Iterator
from typing import Any, Protocol

from nodeguard.errors import NodeguardError
from nodeguard.gate.graph import find_cycle, render_cycle
from nodeguard.gate.policy import Decision, Limits, Rates, Signals, admitted, decide
from nodeguard.gate.states import ClusterSlot, Load, LoadSpec, LoadState


class GateRefused(NodeguardError):
    """A request the gate turns down; nothing was changed."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


class Listener(Protocol):
    def changed(self, load: Load, previous: LoadState | None) -> None:
        """``load`` moved from ``previous`` (None: it is new) to ``load.state``."""

    def removed(self, load: Load) -> None:
        """``load`` left the table (released, replaced or forgotten)."""

    def wants_slot(self, load: Load) -> None:
        """``load`` needs a slot of its cluster semaphore: answer with ``slot_granted``."""

    def slot_done(self, load: Load) -> None:
        """``load`` no longer needs the cluster slot it waits for or holds."""


class LoadTable:
    def __init__(
        self,
        limits: Limits,
        listener: Listener,
        now: float,
        *,
        start_timeout: float,
        max_loads: int,
        keep_failed: float,
    ) -> None:
        self.limits = limits
        self.listener = listener
        self.start_timeout = start_timeout
        self.max_loads = max_loads
        self.keep_failed = keep_failed
        self.loads: dict[str, Load] = {}
        self.starting = 0
        self.signals = Signals()
        self.rates = Rates.initial(limits, now)
        self.last_decision: Decision | None = None
        self.retry_at: float | None = None  # monotonic: when a time-based hold lifts
        self.counters: Counter[str] = Counter()
        self._seq = 0
        self._pending: list[tuple[int, int, str]] = []  # (-priority, seq, name); stale entries skipped
        self._dependents: dict[str, set[str]] = {}  # name -> loads that depend on that name

    # --- requests -----------------------------------------------------------------

    def submit(self, spec: LoadSpec, owner: object | None, now: float) -> Load:
        """Add a load (or replace a detached or finished one of the same name); GateRefused changes nothing."""
        existing = self.loads.get(spec.name)
        self._check_dependencies(spec)
        if existing is not None and existing.owner is not None and existing.state.active:
            raise GateRefused("name_in_use", f"load {spec.name!r} is {existing.state} and its client is connected")
        if existing is None and len(self.loads) >= self.max_loads:
            self.forget_failed(now)
            if len(self.loads) >= self.max_loads:
                raise GateRefused("too_many_loads", f"the gate tracks {self.max_loads} loads (maxLoads); release some")
        if existing is not None:
            # Dependents wait on the name, not on one instance: they wait for the new one.
            self._drop(existing)
        self._seq += 1
        blockers = self._blockers(spec)
        load = Load(
            spec=spec,
            seq=self._seq,
            state=LoadState.BLOCKED if blockers else LoadState.PENDING,
            reason=f"waiting for {', '.join(blockers)}" if blockers else "queued",
            submitted_at=now,
            owner=owner,
        )
        self.loads[spec.name] = load
        for dep in spec.depends_on:
            self._dependents.setdefault(dep, set()).add(spec.name)
        self.counters["submitted"] += 1
        self.listener.changed(load, None)
        if load.state is LoadState.PENDING:
            self._enqueue(load)
        self.pump(now)
        return load

    def ready(self, name: str, now: float, how: str = "notified") -> Load:
        load = self.get(name)
        if load.state is LoadState.STARTING:
            self._become_ready(load, how, now)
            self.pump(now)
        elif load.state is not LoadState.READY:
            code = "failed" if load.state is LoadState.FAILED else "not_admitted"
            raise GateRefused(code, f"load {name!r} is {load.state} ({load.reason}): it cannot become ready")
        return load

    def cancel(self, name: str, now: float, reason: str = "cancelled by the client") -> Load:
        load = self.get(name)
        if not load.state.active:
            raise GateRefused("not_active", f"load {name!r} is already {load.state}; release it instead")
        self._fail(load, reason, now)
        self.pump(now)
        return load

    def release(self, name: str, now: float) -> Load:
        """The load's owner is done with it: it leaves the table, freeing its slot if it had one."""
        load = self.get(name)
        self._drop(load)
        if load.state is not LoadState.READY:
            self._fail_dependents(name, f"dependency {name} was released before it was ready", now)
        self.pump(now)
        return load

    def attach(self, name: str, owner: object) -> Load:
        """``owner`` takes over a detached load (a client reconnecting after a daemon restart)."""
        load = self.get(name)
        if load.owner is not None and load.owner is not owner and load.state.active:
            raise GateRefused("name_in_use", f"load {name!r} belongs to another connected client")
        load.owner = owner
        return load

    def get(self, name: str) -> Load:
        load = self.loads.get(name)
        if load is None:
            raise GateRefused("unknown_load", f"no load named {name!r}")
        return load

    # --- events -------------------------------------------------------------------

    def disconnected(self, owner: object, now: float, *, keep_starting: bool = False) -> list[Load]:
        """The connection ``owner`` closed: loads it still had to see through fail; the rest are detached.

        ``keep_starting``: the gate closed the connection (it restarts), not the
        client; an admitted load keeps its slot until its client attaches again
        or its start times out, as after a daemon restart.
        """
        failed = []
        for load in [load for load in self.loads.values() if load.owner is owner]:
            load.owner = None
            held = load.state in (LoadState.BLOCKED, LoadState.PENDING) or (
                load.state is LoadState.STARTING and not load.spec.detach and not keep_starting
            )
            if held:
                self.counters["disconnected"] += 1
                self._fail(load, "client disconnected", now)
                failed.append(load)
        if failed:
            self.pump(now)
        return failed

    def probe_succeeded(self, name: str, seq: int, detail: str, now: float) -> None:
        load = self.loads.get(name)
        if load is not None and load.seq == seq and load.state is LoadState.STARTING:
            self._become_ready(load, f"probe {detail}", now)
            self.pump(now)

    def expire(self, name: str, seq: int, now: float) -> bool:
        """Fail the load if it is still starting past its deadline."""
        load = self.loads.get(name)
        if load is None or load.seq != seq or load.state is not LoadState.STARTING:
            return False
        if load.deadline is None or now < load.deadline:
            return False
        self.counters["timed_out"] += 1
        detail = f"; last probe {load.probe}" if load.probe else ""
        self._fail(load, f"not ready within {self._timeout(load):g}s{detail}", now)
        self.pump(now)
        return True

    def slot_granted(self, name: str, seq: int, now: float) -> bool:
        """The cluster slot ``load`` waited for is its; False: it no longer wants it (give it back)."""
        load = self.loads.get(name)
        if load is None or load.seq != seq or load.cluster is not ClusterSlot.WAITING:
            return False
        load.cluster = ClusterSlot.HELD
        if load.state is LoadState.PENDING:
            load.reason = "queued"
            heapq.heappush(self._pending, (-load.spec.priority, load.seq, load.name))
            self.pump(now)
        return True

    def slot_revoked(self, name: str, seq: int, now: float) -> None:
        """The node lost its cluster slots (fenced): a queued load asks again, a starting one fails."""
        load = self.loads.get(name)
        if load is None or load.seq != seq or load.cluster is not ClusterSlot.HELD:
            return
        load.cluster = ClusterSlot.NONE  # already gone: nothing to give back
        self.counters["cluster_revoked"] += 1
        if load.state is LoadState.PENDING:
            self._enqueue(load)
        elif load.state is LoadState.STARTING:
            self._fail(load, f"cluster slot of {load.spec.semaphore!r} revoked: this node lost the broker", now)
            self.pump(now)

    def observe(self, signals: Signals, now: float) -> None:
        self.signals = signals
        self.pump(now)

    def reconfigure(
        self, limits: Limits, now: float, *, start_timeout: float, max_loads: int, keep_failed: float
    ) -> None:
        self.limits, self.start_timeout, self.max_loads, self.keep_failed = (
            limits,
            start_timeout,
            max_loads,
            keep_failed,
        )
        self.rates = Rates(min(self.rates.tokens, float(limits.burst)), self.rates.refilled_at, self.rates.last_admit)
        self.pump(now)

    def forget_failed(self, now: float) -> None:
        for load in [load for load in self.loads.values() if load.state is LoadState.FAILED]:
            if load.finished_at is not None and now - load.finished_at >= self.keep_failed:
                self._drop(load)

    def restore(self, load: Load) -> bool:
        """Put back a load read from the state file (starting or ready); False if the name is taken already."""
        if load.name in self.loads:
            return False  # counting a second one as starting would hold its slot for ever
        self._seq = max(self._seq, load.seq)
        self.loads[load.name] = load
        for dep in load.spec.depends_on:
            self._dependents.setdefault(dep, set()).add(load.name)
        if load.state is LoadState.STARTING:
            self.starting += 1
        self.listener.changed(load, None)
        if load.state is LoadState.STARTING and load.spec.semaphore is not None:
            self._want_slot(load)  # it is starting already: counted again as soon as the node can
        return True

    # --- admission ----------------------------------------------------------------

    def pump(self, now: float) -> None:
        """Admit pending loads, best first, while the policy allows."""
        self.retry_at = None
        while self._pending:
            _, seq, name = self._pending[0]
            load = self.loads.get(name)
            if (
                load is None
                or load.seq != seq
                or load.state is not LoadState.PENDING
                or load.cluster is ClusterSlot.WAITING
            ):
                heapq.heappop(self._pending)
                continue
            decision = decide(self.starting, self.signals, self.limits, self.rates, now)
            self.last_decision = decision
            if not decision.admit:
                self.retry_at = decision.retry_at
                return
            heapq.heappop(self._pending)
            self._admit(load, decision.reason, now)

    def _enqueue(self, load: Load) -> None:
        """A pending load joins the node's queue, after getting its cluster slot if it needs one."""
        if load.spec.semaphore is not None and load.cluster is not ClusterSlot.HELD:
            self._want_slot(load)
        else:
            heapq.heappush(self._pending, (-load.spec.priority, load.seq, load.name))

    def _want_slot(self, load: Load) -> None:
        load.cluster = ClusterSlot.WAITING
        if load.state is LoadState.PENDING:
            load.reason = f"waiting for a cluster slot of {load.spec.semaphore!r}"
        self.listener.wants_slot(load)

    def _let_slot_go(self, load: Load) -> None:
        if load.cluster is not ClusterSlot.NONE:
            load.cluster = ClusterSlot.NONE
            self.listener.slot_done(load)

    def _admit(self, load: Load, reason: str, now: float) -> None:
        self.rates = admitted(self.rates, self.limits, now)
        load.state, load.reason = LoadState.STARTING, f"admitted: {reason}"
        load.admitted_at, load.deadline = now, now + self._timeout(load)
        self.starting += 1
        self.counters["admitted"] += 1
        if reason.startswith("minRate"):
            self.counters["admitted_by_min_rate"] += 1
        self.listener.changed(load, LoadState.PENDING)
        if load.spec.readiness is None:
            self._become_ready(load, "no readiness check", now)

    def _timeout(self, load: Load) -> float:
        return load.spec.start_timeout if load.spec.start_timeout is not None else self.start_timeout

    def _become_ready(self, load: Load, how: str, now: float) -> None:
        load.state, load.reason, load.finished_at = LoadState.READY, f"ready: {how}", now
        self.starting -= 1
        self._let_slot_go(load)
        self.counters["ready"] += 1
        self.listener.changed(load, LoadState.STARTING)
        for name in sorted(self._dependents.get(load.name, ())):
            dependent = self.loads.get(name)
            if dependent is None or dependent.state is not LoadState.BLOCKED:
                continue
            blockers = self._blockers(dependent.spec)
            if blockers:
                dependent.reason = f"waiting for {', '.join(blockers)}"
                continue
            dependent.state, dependent.reason = LoadState.PENDING, "queued"
            self.listener.changed(dependent, LoadState.BLOCKED)
            self._enqueue(dependent)

    def _fail(self, load: Load, reason: str, now: float) -> None:
        # A worklist, not recursion: a long chain of blocked dependents fails with it.
        work = [(load, reason)]
        while work:
            failing, why = work.pop()
            previous = failing.state
            if previous is LoadState.FAILED:
                continue
            failing.state, failing.reason, failing.finished_at = LoadState.FAILED, why, now
            if previous is LoadState.STARTING:
                self.starting -= 1
            self._let_slot_go(failing)
            self.counters["failed"] += 1
            self.listener.changed(failing, previous)
            work += [(d, f"dependency {failing.name} failed: {why}") for d in self._blocked_on(failing.name)]

    def _fail_dependents(self, name: str, reason: str, now: float) -> None:
        for dependent in self._blocked_on(name):
            if dependent.state is LoadState.BLOCKED:  # an earlier one in this loop may have failed it
                self._fail(dependent, reason, now)

    def _blocked_on(self, name: str) -> list[Load]:
        found = (self.loads.get(n) for n in sorted(self._dependents.get(name, ())))
        return [load for load in found if load is not None and load.state is LoadState.BLOCKED]

    def _drop(self, load: Load) -> None:
        del self.loads[load.name]
        if load.state is LoadState.STARTING:
            self.starting -= 1
        self._let_slot_go(load)
        for dep in load.spec.depends_on:
            names = self._dependents.get(dep)
            if names is not None:
                names.discard(load.name)
                if not names:
                    del self._dependents[dep]
        self.listener.removed(load)

    # --- checks -------------------------------------------------------------------

    def _check_dependencies(self, spec: LoadSpec) -> None:
        cycle = find_cycle(
            spec.name, spec.depends_on, lambda n: self.loads[n].spec.depends_on if n in self.loads else ()
        )
        if cycle is not None:
            raise GateRefused("cycle", f"dependency cycle: {render_cycle(cycle)}")
        for dep in spec.depends_on:
            found = self.loads.get(dep)
            if found is None:
                raise GateRefused("unknown_dependency", f"dependsOn names {dep!r}, which is not a known load")
            if found.state is LoadState.FAILED:
                raise GateRefused("dependency_failed", f"dependency {dep!r} failed: {found.reason}")

    def _blockers(self, spec: LoadSpec) -> list[str]:
        # A dependency gone from the table was released once ready (released
        # before that, it failed its blocked dependents): it blocks nothing.
        found = ((dep, self.loads.get(dep)) for dep in spec.depends_on)
        return [dep for dep, load in found if load is not None and load.state is not LoadState.READY]

    # --- status -------------------------------------------------------------------

    def counts(self) -> dict[str, int]:
        found = Counter(load.state.value for load in self.loads.values())
        return {state.value: found.get(state.value, 0) for state in LoadState}

    def hold_reason(self) -> str | None:
        decision = self.last_decision
        return None if decision is None or decision.admit else decision.reason

    def statuses(self, now: float) -> Iterator[dict[str, Any]]:
        hold = self.hold_reason()
        for load in sorted(self.loads.values(), key=lambda load: load.seq):
            data = load.to_status(now)
            if load.state is LoadState.PENDING and hold is not None:
                data["reason"] = f"held: {hold}"
            yield data
