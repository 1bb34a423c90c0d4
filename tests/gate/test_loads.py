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

    def wants_slot(self, load: Load) -> None:
        self.transitions.append((load.name, load.state.value, "wants-slot"))

    def slot_done(self, load: Load) -> None:
        self.transitions.append((load.name, load.state.value, "slot-done"))


def table(max_starting: int = 2) -> LoadTable:
    limits = Limits(cores=4, max_starting=max_starting)
    return LoadTable(limits, Recorder(), 0.0, start_timeout=60, max_loads=100, keep_failed=10)


def spec(name: str, *after: str, priority: int = 0, detach: bool = False, semaphore: str | None = None) -> LoadSpec:
    return LoadSpec(
        name=name, depends_on=after, readiness=NOTIFY, priority=priority, detach=detach, semaphore=semaphore
    )


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


def slot_events(t: LoadTable) -> list[tuple[str, str | None, str]]:
    recorder = t.listener
    assert isinstance(recorder, Recorder)
    return [e for e in recorder.transitions if e[2] in ("wants-slot", "slot-done")]


def test_a_load_needing_a_cluster_slot_takes_no_node_slot_until_it_has_one() -> None:
    """A load waiting for its cluster slot leaves the node's starting slots to loads that need none."""
    t = table(max_starting=1)
    t.submit(spec("sem", semaphore="prepare"), None, 0.0)
    t.submit(spec("plain"), None, 0.0)
    assert states(t) == {"sem": "pending", "plain": "starting"}
    assert t.loads["sem"].reason == "waiting for a cluster slot of 'prepare'"
    assert slot_events(t) == [("sem", "pending", "wants-slot")]
    assert t.slot_granted("sem", t.loads["sem"].seq, 1.0)
    assert states(t)["sem"] == "pending"  # the node's one slot is still taken
    t.ready("plain", 2.0)
    assert states(t)["sem"] == "starting"
    t.ready("sem", 3.0)
    assert slot_events(t)[-1] == ("sem", "ready", "slot-done")


def test_cluster_slot_goes_back_on_failure_release_and_replacement() -> None:
    """Every way out of the table gives the cluster slot back exactly once, waiting or held."""
    t = table(max_starting=4)
    t.submit(spec("a", semaphore="s"), None, 0.0)
    t.submit(spec("b", semaphore="s"), None, 0.0)
    t.submit(spec("c", semaphore="s", detach=True), None, 0.0)
    t.slot_granted("a", t.loads["a"].seq, 0.1)
    t.slot_granted("c", t.loads["c"].seq, 0.1)
    t.cancel("a", 1.0)  # starting, holding its slot
    t.release("b", 1.0)  # still waiting for its slot
    t.submit(spec("c", semaphore="s"), None, 1.0)  # replaces the detached, starting c
    done = [e for e in slot_events(t) if e[2] == "slot-done"]
    assert done == [("a", "failed", "slot-done"), ("b", "pending", "slot-done"), ("c", "starting", "slot-done")]
    assert not t.slot_granted("b", 2, 2.0)  # too late: the caller gives that slot back


def test_a_revoked_slot_requeues_a_pending_load_and_fails_a_starting_one() -> None:
    """Fencing takes the slots: a load still queued asks again, a load already starting fails and frees its node slot."""
    t = table(max_starting=1)
    t.submit(spec("first", semaphore="s"), None, 0.0)
    t.submit(spec("second", semaphore="s"), None, 0.0)
    t.slot_granted("first", t.loads["first"].seq, 0.1)
    t.slot_granted("second", t.loads["second"].seq, 0.1)
    assert states(t) == {"first": "starting", "second": "pending"}
    t.slot_revoked("second", t.loads["second"].seq, 1.0)
    assert t.loads["second"].reason == "waiting for a cluster slot of 's'"
    t.slot_revoked("first", t.loads["first"].seq, 1.0)
    assert states(t) == {"first": "failed", "second": "pending"}
    assert "revoked" in t.loads["first"].reason
    assert t.starting == 0  # the node slot is free, but second must get a cluster slot first
    assert slot_events(t)[-1] == ("second", "pending", "wants-slot")
    t.slot_granted("second", t.loads["second"].seq, 2.0)
    assert states(t)["second"] == "starting"


def test_dependents_ask_for_their_cluster_slot_only_when_unblocked() -> None:
    """A blocked load holds nothing, not even a place in the cluster's queue."""
    t = table()
    t.submit(spec("base"), None, 0.0)
    t.submit(spec("app", "base", semaphore="s"), None, 0.0)
    assert slot_events(t) == []
    t.ready("base", 1.0)
    assert slot_events(t) == [("app", "pending", "wants-slot")]
