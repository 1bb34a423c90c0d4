"""The table of loads: states, slots, dependencies, replacement and disconnects (no I/O, time passed in)."""

from __future__ import annotations

import pytest

from nodeguard.gate.loads import GateRefused, LoadTable
from nodeguard.gate.policy import Limits
from nodeguard.gate.readiness import NotifyReadiness
from nodeguard.gate.states import Load, LoadSpec, LoadState

NOTIFY = NotifyReadiness(type="notify")


class Recorder:
    def __init__(self) -> None:
        self.transitions: list[tuple[str, str | None, str]] = []

    def changed(self, load: Load, previous: LoadState | None) -> None:
        self.transitions.append((load.name, previous.value if previous else None, load.state.value))

    def removed(self, load: Load) -> None:
        self.transitions.append((load.name, load.state.value, "removed"))


def table(max_starting: int = 2) -> LoadTable:
    limits = Limits(cores=4, max_starting=max_starting)
    return LoadTable(limits, Recorder(), 0.0, start_timeout=60, max_loads=100, keep_failed=10)


def spec(name: str, *after: str, priority: int = 0, detach: bool = False) -> LoadSpec:
    return LoadSpec(name=name, depends_on=after, readiness=NOTIFY, priority=priority, detach=detach)


def states(t: LoadTable) -> dict[str, str]:
    return {name: load.state.value for name, load in t.loads.items()}


def test_blocked_loads_hold_no_slot_so_dependents_cannot_deadlock() -> None:
    """B and C wait for A without holding slots: with 2 slots A and an unrelated D start, then B once A is ready."""
    t = table(max_starting=2)
    t.submit(spec("a"), None, 0)
    t.submit(spec("b", "a"), None, 0)
    t.submit(spec("c", "a"), None, 0)
    t.submit(spec("d"), None, 0)
    assert states(t) == {"a": "starting", "b": "blocked", "c": "blocked", "d": "starting"}
    t.ready("a", 1)
    assert states(t) == {"a": "ready", "b": "starting", "c": "pending", "d": "starting"}
    assert t.hold_reason() == "maxStarting: 2 of 2 starting"


def test_a_failure_fails_blocked_dependents_down_the_chain() -> None:
    """A timed-out load fails the loads blocked on it, transitively, with the reason; others are untouched."""
    t = table()
    t.submit(spec("a"), None, 0)
    t.submit(spec("b", "a"), None, 0)
    t.submit(spec("c", "b"), None, 0)
    t.submit(spec("d"), None, 0)
    assert t.expire("a", t.loads["a"].seq, 61)
    assert states(t) == {"a": "failed", "b": "failed", "c": "failed", "d": "starting"}
    assert t.loads["c"].reason == "dependency b failed: dependency a failed: not ready within 60s"
    assert t.starting == 1


def test_priority_orders_pending_loads() -> None:
    """The pending load with the highest priority is admitted first, then submission order."""
    t = table(max_starting=1)
    t.submit(spec("first"), None, 0)
    for name, priority in (("low", 0), ("high", 5), ("low2", 0)):
        t.submit(spec(name, priority=priority), None, 0)
    order = []
    for _ in range(3):
        running = next(name for name, state in states(t).items() if state == "starting")
        t.ready(running, 1)
        order.append(next(name for name, state in states(t).items() if state == "starting"))
    assert order == ["high", "low", "low2"]


def test_replacing_a_detached_load_keeps_dependents_waiting_on_the_name() -> None:
    """A detached starting load resubmitted under its name frees its slot and is replaced; its dependents wait for the new one."""
    t = table(max_starting=1)
    t.submit(spec("a", detach=True), None, 0)
    t.submit(spec("b", "a"), None, 0)
    t.submit(spec("a", detach=True), None, 1)
    assert states(t) == {"a": "starting", "b": "blocked"}
    assert t.starting == 1
    t.ready("a", 2)
    assert states(t)["b"] == "starting"


def test_a_connected_clients_load_cannot_be_replaced() -> None:
    """Submitting a name whose load is active and owned by a live connection is refused and changes nothing."""
    t = table()
    owner = object()
    t.submit(spec("a"), owner, 0)
    with pytest.raises(GateRefused) as caught:
        t.submit(spec("a"), object(), 1)
    assert caught.value.code == "name_in_use"
    assert t.loads["a"].owner is owner and t.starting == 1


def test_disconnect_fails_what_the_client_held_and_keeps_detached_admissions() -> None:
    """A closed connection fails its pending and starting loads (freeing the slot) but not a detached admitted one."""
    t = table(max_starting=2)
    owner = object()
    t.submit(spec("bound"), owner, 0)
    t.submit(spec("detached", detach=True), owner, 0)
    t.submit(spec("queued"), owner, 0)
    t.submit(spec("other"), None, 0)
    failed = t.disconnected(owner, 1)
    assert sorted(load.name for load in failed) == ["bound", "queued"]
    assert states(t) == {"bound": "failed", "detached": "starting", "queued": "failed", "other": "starting"}
    assert t.loads["detached"].owner is None


def test_release_before_ready_fails_blocked_dependents_and_after_ready_does_not() -> None:
    """Releasing a load that never became ready fails those blocked on it; a dependency released once ready blocks nothing."""
    t = table()
    t.submit(spec("a"), None, 0)
    t.submit(spec("b", "a"), None, 0)
    t.release("a", 1)
    assert states(t) == {"b": "failed"}
    t.submit(spec("x"), None, 2)
    t.submit(spec("y"), None, 2)
    t.submit(spec("z", "x", "y"), None, 2)
    t.ready("x", 3)
    t.release("x", 3)
    t.ready("y", 4)
    assert states(t)["z"] == "starting"
