"""Scenario tests of the protocol state machine (no network: tests.coordination.sim)."""

from __future__ import annotations

import dataclasses

import pytest

from nodeguard.coordination.semaphore import WILL_GRACE, Cluster, Grant, Ledger, Node, Phase, StateMismatch, water_fill
from tests.coordination.sim import LEASE, WILL_DELAY, Sim


def cluster3(cap: int = 3) -> Sim:
    sim = Sim(["a", "b", "c"], {"p": cap})
    sim.settle()
    return sim


def held(sim: Sim, sem: str = "p") -> dict[str, int]:
    return {name: len(node.held[sem]) for name, node in sim.nodes.items()}


def allot(sim: Sim, name: str, sem: str = "p") -> int:
    node = sim.nodes[name].node
    assert node is not None and node.state is not None
    return node.state.allot[sem]


def heir_reads(sim: Sim) -> None:
    """Messages flow, and the heir reads the estate once the will grace is over."""
    sim.pump()
    sim.advance(WILL_GRACE)
    sim.pump()


def cut_off_and_inherited(sim: Sim) -> None:
    """``a`` holds a slot, loses the broker, and its will lets its heir ``b`` adopt its allotment."""
    sim.request("a", "p")
    sim.disconnect("a")
    assert sim.fire_will("a", wait=True)
    heir_reads(sim)


def test_genesis_split_sums_to_each_cap() -> None:
    """The genesis allotments of all members add up to exactly each cap."""
    cluster = Cluster(tuple(f"n{i}" for i in range(7)), {"prepare": 8, "backup": 3, "none": 0, "big": 100})
    for sem, cap in cluster.caps.items():
        assert sum(cluster.share(sem, m) for m in cluster.members) == cap


def test_heir_is_the_next_member_in_sorted_order() -> None:
    """Each member's heir is the next one of the sorted list, the last one's is the first."""
    cluster = Cluster(("c", "a", "b"), {"p": 1})
    assert [cluster.heir(m) for m in ("a", "b", "c")] == ["b", "c", "a"]


def test_water_fill_is_max_min_fair_and_prefers_the_least_served() -> None:
    """Targets fill the smallest demands first and break ties by fewer admissions."""
    demand = {"a": 5, "b": 1, "c": 5}
    rank = {"a": (3, "a"), "b": (0, "b"), "c": (1, "c")}
    assert water_fill(4, demand, rank) == {"a": 1, "b": 1, "c": 2}


def test_a_waiting_load_gets_a_slot_donated_by_an_idle_node() -> None:
    """A node with allotment 0 and a waiting load is granted a slot by a node that does not need it."""
    sim = Sim(["a", "b", "c"], {"p": 1})
    sim.settle()
    needy = next(n for n in "abc" if allot(sim, n) == 0)
    sim.request(needy, "p")
    sim.settle()
    assert held(sim)[needy] == 1
    assert sum(allot(sim, n) for n in "abc") == 1


def test_a_grant_duplicated_ten_times_is_applied_once() -> None:
    """The same grant delivered ten times, also inside newer ledgers, raises the allotment once."""
    cluster = Cluster(("a", "b"), {"p": 2})
    node = Node("b", cluster, cluster.genesis("b", 5), lease_seconds=LEASE, status_ttl=1e9)
    node.begin_connect(5)
    node.connected(0.0, False)
    node.lease_renewed(0.0, node.conn, 0.0)
    node.synced(0.0)
    before = node.state.allot["p"] if node.state else 0
    grant = Grant(id=7, sem="p", to="b", epoch=node.epoch, n=1, seq=3)
    for seq in range(3, 13):
        node.on_ledger(Ledger("a", seq, 1, dict(cluster.fps), {"p": 0}, (grant,)), 0.0)
    assert node.state is not None and node.state.allot["p"] == before + 1
    assert node.counters["grants.applied"] == 1


def test_forged_grant_for_an_unknown_semaphore_is_ignored_and_counted() -> None:
    """A grant naming a semaphore this node does not know changes nothing and is counted."""
    cluster = Cluster(("a", "b"), {"p": 2})
    node = Node("b", cluster, cluster.genesis("b", 5), lease_seconds=LEASE, status_ttl=1e9)
    node.begin_connect(5)
    node.connected(0.0, False)
    node.synced(0.0)
    assert node.state is not None
    before = dict(node.state.allot)
    forged = Grant(id=1, sem="nope", to="b", epoch=node.epoch, n=50, seq=1)
    foreign = Grant(id=2, sem="p", to="b", epoch=node.epoch, n=50, seq=1)
    node.on_ledger(Ledger("a", 2, 1, {"p": "other-cluster-fp"}, {"p": 0}, (forged, foreign)), 0.0)
    assert node.state.allot == before
    assert node.counters["ignored.bad_grant"] == 2


def test_unknown_semaphore_request_raises() -> None:
    """Asking for a slot of a semaphore that is not configured is an error, not a wait."""
    cluster = Cluster(("a",), {"p": 1})
    node = Node("a", cluster, None, lease_seconds=LEASE, status_ttl=1e9)
    with pytest.raises(KeyError):
        node.request("nope", "load", 0.0)


def test_persisted_state_for_another_cap_is_refused() -> None:
    """A state saved for a different cap of a semaphore stops the node instead of being reused."""
    saved = Cluster(("a", "b"), {"p": 2}).genesis("a", 1)
    with pytest.raises(StateMismatch, match="'p'"):
        Node("a", Cluster(("a", "b"), {"p": 3}), saved, lease_seconds=LEASE, status_ttl=1e9)


def test_local_admission_continues_through_a_short_outage_then_fences_at_lease_end() -> None:
    """Without the broker a node keeps admitting within its allotment until its lease ends, then revokes."""
    sim = cluster3(cap=6)  # two slots each
    sim.request("a", "p")
    sim.disconnect("a")
    sim.advance(LEASE / 2)
    sim.request("a", "p")
    assert held(sim)["a"] == 2
    sim.request("a", "p")
    assert held(sim)["a"] == 2  # never beyond its allotment
    sim.advance(LEASE / 2 + 0.1)
    assert held(sim)["a"] == 0
    node = sim.nodes["a"].node
    assert node is not None and node.fenced and node.counters["revoked"] == 2


def test_cut_off_node_is_fenced_before_its_heir_uses_its_slots() -> None:
    """A node cut off while holding slots revokes them before its will lets the heir adopt and use them."""
    sim = cluster3()
    for name in "abc":
        sim.request(name, "p")
    sim.disconnect("a")
    assert sim.fire_will("a", wait=True)
    assert held(sim)["a"] == 0
    sim.settle()
    assert allot(sim, "b") == 2  # b is a's heir
    sim.request("b", "p")
    sim.settle()
    assert held(sim) == {"a": 0, "b": 2, "c": 1}


def test_a_node_back_after_its_will_rolls_back_and_the_estate_is_adopted_once() -> None:
    """A node killed and restarted after its will reads it before admitting, and its estate is counted once."""
    sim = cluster3()
    sim.request("a", "p")
    sim.crash("a")
    assert sim.fire_will("a", wait=True)
    sim.settle()  # a restarts here, reads its will, rolls back; b adopts
    node = sim.nodes["a"].node
    assert node is not None and node.counters["rollbacks"] == 1
    assert [allot(sim, n) for n in "abc"] == [0, 2, 1]
    for name in "abc":
        for _ in range(3):
            sim.request(name, "p")
    sim.settle()
    assert sum(held(sim).values()) == 3


def test_a_second_will_for_the_same_ledger_adopts_nothing() -> None:
    """A node that comes back and dies again before publishing anything is not inherited twice."""
    sim = cluster3()
    sim.disconnect("a")
    assert sim.fire_will("a", wait=True)
    sim.settle()
    assert allot(sim, "b") == 2
    sim.disconnect("a")
    sim.connect("a")  # back, then gone again at once: nothing new published in between
    sim.disconnect("a")
    assert sim.fire_will("a", wait=True)
    heir_reads(sim)
    assert allot(sim, "b") == 2
    assert sum(allot(sim, n) for n in "abc") == 3


def test_fenced_node_back_on_a_restarted_broker_waits_for_its_heir() -> None:
    """After a broker restart lost a will already acted on, the returning node learns it from its heir."""
    sim = cluster3()
    cut_off_and_inherited(sim)
    assert allot(sim, "b") == 2
    sim.restart_broker()  # the will and every retained message are gone
    sim.connect("a")
    node = sim.nodes["a"].node
    assert node is not None and node.phase is Phase.WAITING_HEIR and node.fenced
    sim.request("a", "p")
    assert held(sim)["a"] == 0
    sim.settle()
    assert node.phase is Phase.ONLINE
    assert sum(allot(sim, n) for n in "abc") == 3
    for name in "abc":
        sim.request(name, "p")
        sim.request(name, "p")
    sim.settle()
    assert sum(held(sim).values()) == 3


def test_quick_reconnect_keeps_the_allotment() -> None:
    """A connection that drops and comes back before the will keeps its allotment and its loads."""
    sim = cluster3()
    sim.request("a", "p")
    sim.disconnect("a")
    sim.advance(1.0)
    sim.connect("a")
    sim.settle()
    assert held(sim)["a"] == 1 and allot(sim, "a") == 1
    assert not sim.fire_will("a", wait=True)


def test_grant_to_an_earlier_connection_is_taken_back_by_its_donor() -> None:
    """A grant addressed to a connection that ended before applying it returns to the donor."""
    sim = Sim(["a", "b"], {"p": 1})
    sim.settle()
    needy = "a" if allot(sim, "a") == 0 else "b"
    donor = "b" if needy == "a" else "a"
    sim.request(needy, "p")
    sim.flush(needy)
    sim.deliver_all(donor)
    sim.flush(donor)  # the donor publishes the grant ...
    sim.disconnect(needy)  # ... but the needy node reconnects before seeing it
    sim.connect(needy)
    donor_node = sim.nodes[donor].node
    assert donor_node is not None and donor_node.state is not None
    grant_epoch = next(iter(donor_node.state.grants.values())).epoch
    assert grant_epoch < sim.nodes[needy].conn_epoch
    sim.settle()
    assert donor_node.counters["grants.retracted"] == 1
    assert sum(held(sim).values()) == 1  # and the load is served by a fresh grant


def test_stale_ledger_does_not_undo_a_newer_one() -> None:
    """A ledger older than one already seen is ignored and counted."""
    cluster = Cluster(("a", "b"), {"p": 2})
    node = Node("b", cluster, cluster.genesis("b", 5), lease_seconds=LEASE, status_ttl=1e9)
    newer = Ledger("a", 9, 1, dict(cluster.fps), {"p": 1})
    node.on_ledger(newer, 0.0)
    node.on_ledger(dataclasses.replace(newer, seq=4, allot={"p": 5}), 0.0)
    assert node.peers["a"].ledger == newer
    assert node.counters["ignored.stale"] == 1


def test_will_cannot_fire_before_lease_has_run_out() -> None:
    """The simulation's timing rule matches the protocol's: lease shorter than the will delay."""
    assert LEASE < WILL_DELAY


def test_a_pending_question_to_the_heir_survives_a_reconnect() -> None:
    """A node waiting for its heir after a broker restart still waits after reconnecting with a session."""
    sim = cluster3()
    cut_off_and_inherited(sim)
    assert allot(sim, "b") == 2
    sim.restart_broker()  # b stays away for now
    sim.connect("a")
    sim.disconnect("a")
    sim.connect("a")  # the new broker has a's session now
    node = sim.nodes["a"].node
    assert node is not None and sim.nodes["a"].connected and node.phase is Phase.WAITING_HEIR
    sim.request("a", "p")
    assert held(sim)["a"] == 0
    sim.settle()
    assert sum(allot(sim, n) for n in "abc") == 3


def test_a_crash_before_the_question_is_written_down_does_not_skip_it() -> None:
    """A node that crashes while waiting for its heir asks again after restarting, though its session survived."""
    sim = cluster3()
    cut_off_and_inherited(sim)
    sim.restart_broker()  # b stays away for now
    sim.connect("a")  # waits for b ...
    sim.crash("a")  # ... and dies before writing anything after connecting
    sim.connect("a")  # restarted; the new broker kept its session
    node = sim.nodes["a"].node
    assert node is not None and node.phase is Phase.WAITING_HEIR
    sim.request("a", "p")
    assert held(sim)["a"] == 0
    sim.settle()
    assert sum(allot(sim, n) for n in "abc") == 3


def test_wills_a_shutting_down_broker_fires_are_never_acted_on() -> None:
    """mosquitto publishes every pending will as it stops: live nodes stop admitting and rejoin on a new connection,
    heirs adopt nothing, and after the restart every slot is back where it was."""
    sim = cluster3()
    for name in "abc":
        sim.request(name, "p")
    before = {name: allot(sim, name) for name in "abc"}
    sim.restart_broker(fire_wills=True)
    for name in "abc":
        node = sim.nodes[name].node
        assert node is not None and node.fenced and node.counters["own_will_on_this_connection"] == 1
        assert node.counters["adoptions"] == 0 and node.counters["rollbacks"] == 0
    assert held(sim) == {"a": 0, "b": 0, "c": 0}
    sim.settle()
    assert {name: allot(sim, name) for name in "abc"} == before
    for name in "abc":
        sim.request(name, "p")
    sim.settle()
    assert sum(held(sim).values()) == 3
