"""Ten node processes against a real mosquitto: the cap holds through bursts, kills, broker restarts and cuts.

The first three nodes are the seeds (they hold the cap at genesis); the others join with nothing."""

from __future__ import annotations

import json
import time
from pathlib import Path

import paho.mqtt.client as paho
from paho.mqtt.enums import CallbackAPIVersion

from tests.coordination.harness import LoadAuditor, NodeProcess, start_nodes
from tests.support.broker import Broker
from tests.support.cluster import TIMINGS, Cluster, ClusterSpec, WireAuditor, coordination_config, stop_together
from tests.support.poll import wait_until

CAP = 4
SEM = "prepare"
NODES = tuple(f"n{i}" for i in range(10))
# No test here drains a node while others stay. The fixture stops all ten at once, and the last to go has no one
# left to hand its slots to: it waits its whole drain, so the drain here is short.
CLUSTER = ClusterSpec(NODES, seeds=NODES[:3], caps={SEM: CAP}, cut="n5", timings={"drainSeconds": 0.5})
WILL = float(TIMINGS["willDelaySeconds"])


def loads(cluster: Cluster[NodeProcess]) -> LoadAuditor:
    """What every node's loads reported holding and freeing."""
    return LoadAuditor(list(cluster.nodes.values()))


def wait_done(cluster: Cluster[NodeProcess], count: int, timeout: float = 30.0) -> None:
    """Until ``count`` loads in the cluster are done."""
    wait_until(lambda: len(loads(cluster).done(SEM)) >= count, timeout, f"{count} loads done",
               detail=lambda: f"done {len(loads(cluster).done(SEM))}\n{cluster.logs()}")  # fmt: skip


def check_cap(cluster: Cluster[NodeProcess]) -> None:
    """The loads never held more than the cap together, and every message on the wire parsed and kept to it."""
    assert loads(cluster).max_held(SEM) <= CAP, cluster.logs()
    assert not cluster.wire.violations, cluster.wire.violations[0]
    assert not cluster.wire.malformed, cluster.wire.malformed[:3]


def settled(cluster: Cluster[NodeProcess]) -> bool:
    """Every slot is in some node's allotment and no grant is in flight (one in flight would wait for the broker)."""
    sems = [n.status()["semaphores"][SEM] for n in cluster.nodes.values()]
    return sum(s["allotment"] for s in sems) == CAP and not any(s["grantsOut"] for s in sems)


def wait_settled(cluster: Cluster[NodeProcess], timeout: float = 10.0) -> None:
    wait_until(lambda: settled(cluster), timeout, "every slot in an allotment, none in flight", detail=cluster.logs)


def wait_published(cluster: Cluster[NodeProcess], name: str) -> None:
    """Until the allotment the node works with is the one its latest ledger on the broker shows (what an heir
    adopts)."""
    node = cluster.nodes[name]
    wait_until(lambda: cluster.wire.allotments(SEM).get(name) == node.status()["semaphores"][SEM]["allotment"], 10,
               f"{name}'s allotment on the broker", detail=cluster.logs)  # fmt: skip


def test_bursts_never_exceed_the_cap_and_every_load_runs(cluster: Cluster[NodeProcess]) -> None:
    """Ten nodes each asking for three slots at once, twice, never hold more than the cap together and all run."""
    for node in cluster.nodes.values():
        node.burst(3, 0.15, SEM)
    wait_until(lambda: len(loads(cluster).requested(SEM)) == 30, 10, "the first burst asked for", detail=cluster.logs)
    for node in cluster.nodes.values():
        node.burst(3, 0.1, SEM)
    wait_done(cluster, 60)
    check_cap(cluster)
    assert loads(cluster).max_held(SEM) == CAP  # the cap was reached: slots moved to where loads waited
    assert loads(cluster).requested(SEM) == loads(cluster).done(SEM)
    assert cluster.wire.max_total[SEM] == CAP  # checked on complete views: every slot accounted for


def test_killed_node_slots_come_back_after_its_will_and_it_rejoins_without_them(cluster: Cluster[NodeProcess]) -> None:
    """SIGKILL a node holding slots: after its will its heir adopts them; restarted, it reads that before admitting."""
    victim = cluster.nodes["n3"]
    victim.burst(CAP, 30.0, SEM)  # holds whatever it can get, for long
    wait_until(lambda: victim.count("hold") >= 1, 10, "the victim holds a slot", detail=cluster.logs)
    wait_published(cluster, "n3")
    status = victim.status()
    held_by_victim, heir = status["semaphores"][SEM]["held"], cluster.nodes[status["heir"]]
    victim.kill()
    wait_until(lambda: any(w.startswith("n3@") for w in cluster.wire.wills), WILL + 5, "n3's will", detail=cluster.logs)
    wait_until(lambda: heir.status()["counters"].get("adoptions", 0) >= 1, 5, "the heir adopting", detail=cluster.logs)
    after_will = time.monotonic()
    for name in ("n0", "n1", "n7", "n8"):
        cluster.nodes[name].burst(2, 0.8, SEM)
    wait_done(cluster, 8)
    check_cap(cluster)
    assert held_by_victim >= 1
    assert loads(cluster).max_held(SEM, since=after_will) == CAP  # its slots are in use again

    victim.start()
    wait_until(lambda: victim.count("started") >= 2, 10, "the victim restarting")
    cluster.wait_admitting(["n3"])
    status = victim.status()
    assert status["counters"].get("rollbacks", 0) == 1
    for node in cluster.nodes.values():
        node.burst(1, 0.1, SEM)
    wait_done(cluster, 8 + 10)
    check_cap(cluster)


def test_broker_crash_keeps_local_admission_and_everything_recovers(cluster: Cluster[NodeProcess]) -> None:
    """With the broker crashed, nodes keep admitting within their allotments; after it restarts all loads run."""
    for node in cluster.nodes.values():
        node.burst(1, 0.1, SEM)
    wait_done(cluster, 10)
    wait_settled(cluster)
    cluster.broker.stop(crash=True)
    stopped = time.monotonic()
    for node in cluster.nodes.values():
        node.burst(2, 0.2, SEM)

    def admitted_during_outage() -> list[dict[str, object]]:
        return [
            e
            for n in cluster.nodes.values()
            for e in n.snapshot()
            if e["ev"] == "hold" and e["t"] > stopped and str(e["load"]).endswith(("-2", "-3"))
        ]

    wait_until(lambda: bool(admitted_during_outage()), 2.0, "a load admitted locally while the broker is down")
    outage = cluster.nodes["n0"].status()
    assert not outage["connected"] and outage["outageSeconds"] > 0
    cluster.broker.start()
    wait_done(cluster, 30, timeout=40)
    check_cap(cluster)
    wait_until(
        lambda: all(n.status()["connected"] for n in cluster.nodes.values()), 20, "all reconnected", detail=cluster.logs
    )
    cluster.wait_admitting()
    connects = {name: n.status()["broker"]["connects"] for name, n in cluster.nodes.items()}
    assert all(count >= 2 for count in connects.values()), (connects, cluster.logs())


def test_wills_fired_by_a_broker_shutdown_are_not_acted_on(cluster: Cluster[NodeProcess]) -> None:
    """A broker stopped gracefully publishes the will of every live node: nodes that see their own stop admitting and
    rejoin on a new connection, no heir adopts anything, and after the restart every load runs within the cap."""
    for node in cluster.nodes.values():
        node.burst(1, 0.1, SEM)
    wait_done(cluster, 10)
    wait_settled(cluster)
    cluster.broker.stop()
    for node in cluster.nodes.values():
        node.burst(2, 0.2, SEM)
    wait_until(lambda: not any(n.status()["connected"] for n in cluster.nodes.values()), 10,
               "every node seeing the broker gone", detail=cluster.logs)  # fmt: skip
    cluster.broker.start()
    wait_done(cluster, 30, timeout=40)
    check_cap(cluster)
    counters = {name: n.status()["counters"] for name, n in cluster.nodes.items()}
    assert any(c.get("own_will_on_this_connection") for c in counters.values()), "no node saw its will at shutdown"
    assert not any(c.get("adoptions") or c.get("rollbacks") for c in counters.values()), counters

    wait_settled(cluster)  # every slot back in some node's allotment: none lost


def test_cut_off_node_fences_and_the_cap_holds(cluster: Cluster[NodeProcess]) -> None:
    """A node cut off from the broker revokes its slots before its heir adopts them, and rejoins after."""
    assert cluster.proxy is not None
    cut = cluster.nodes["n5"]
    # Still holding when its lease runs out, however long the cut takes to come on a loaded machine: the lease
    # (3 s) runs from the cut, which has come up to 1.2 s after the first hold.
    cut.burst(CAP, TIMINGS["leaseSeconds"] + 3.0, SEM)
    wait_until(lambda: cut.count("hold") >= 1, 10, "the cut node holding", detail=cluster.logs)
    wait_published(cluster, "n5")
    heir = cluster.nodes[cut.status()["heir"]]
    cluster.proxy.cut()
    wait_until(lambda: cut.count("revoked") >= 1, TIMINGS["leaseSeconds"] + 3, "revocation", detail=cluster.logs)
    wait_until(lambda: heir.status()["counters"].get("adoptions", 0) >= 1, WILL + 5, "adoption", detail=cluster.logs)
    for name in ("n0", "n2", "n7", "n9"):
        cluster.nodes[name].burst(2, 0.4, SEM)
    wait_done(cluster, 8)
    check_cap(cluster)
    cluster.proxy.heal()
    cluster.wait_admitting(["n5"])
    assert cut.status()["counters"].get("rollbacks", 0) == 1
    wait_done(cluster, 8 + CAP, timeout=30)  # its own loads are admitted again, within the cap
    check_cap(cluster)


def test_malformed_foreign_and_duplicated_messages_are_ignored_and_counted(broker: Broker, tmp_path: Path) -> None:
    """Garbage, an unknown version, a forged grant for an unknown semaphore and a grant sent ten times do no harm."""
    node = NodeProcess("a", coordination_config(broker.port, ["a"], {SEM: 2}, tmp_path / "state"), tmp_path).start()
    try:
        wait_until(lambda: node.count("started") == 1, 10, "start")
        wait_until(lambda: node.status()["admitting"], 10, "admitting", detail=node.log_tail)
        status = node.status()
        epoch, before = status["epoch"], status["semaphores"][SEM]["allotment"]
        client = paho.Client(CallbackAPIVersion.VERSION2, client_id="forger", protocol=paho.MQTTv5)
        client.connect("127.0.0.1", broker.port)
        client.loop_start()

        def copy(seq: int, grants: list[dict[str, object]]) -> bytes:
            ledger = {"v": 2, "kind": "ledger", "node": "c", "seq": seq, "epoch": 1, "heir": "c", "allot": {SEM: 0},
                      "grants": grants, "applied": {}, "adopted": {}, "lost": []}  # fmt: skip
            return json.dumps(
                {"v": 2, "kind": "copy", "node": "c", "ask": False, "queue": {}, "ledger": ledger}
            ).encode()

        inbox = "nodeguard/test/inbox/a"
        publish = [
            (inbox, b"\xff not json"),
            (inbox, json.dumps({"v": 1, "kind": "copy", "node": "b"}).encode()),
            (inbox, copy(5, [{"id": 1, "sem": "nope", "to": "a", "epoch": epoch, "n": 9, "seq": 5}])),
        ]
        grant = {"id": 2, "sem": SEM, "to": "a", "epoch": epoch, "n": 1, "seq": 6}
        publish += [(inbox, copy(6 + i, [grant])) for i in range(10)]
        # Last, a copy of the node's own ledger, which it ignores and counts: once counted, all before it were read.
        own = {"v": 2, "kind": "ledger", "node": "a", "seq": 1, "epoch": 1, "heir": "a", "allot": {SEM: 0},
               "grants": [], "applied": {}, "adopted": {}, "lost": []}  # fmt: skip
        publish.append((inbox, json.dumps({"v": 2, "kind": "copy", "node": "a", "ask": False, "queue": {},
                                           "ledger": own}).encode()))  # fmt: skip
        for topic, payload in publish:
            client.publish(topic, payload, qos=1).wait_for_publish(5)
        client.disconnect()
        client.loop_stop()
        wait_until(lambda: node.status()["counters"].get("ignored.bad_copy", 0) >= 1, 5, "every message read",
                   detail=node.log_tail)  # fmt: skip
        status = node.status()
        counters = status["counters"]
        assert counters.get("ignored.malformed") == 1
        assert counters.get("ignored.unknown_version") == 1
        assert counters.get("ignored.bad_grant") == 1
        assert counters.get("grants.applied") == 1
        assert counters.get("ignored.bad_copy") == 1
        assert status["semaphores"][SEM]["allotment"] == before + 1
        node.burst(3, 0.05, SEM)
        wait_until(lambda: node.count("done") == 3, 10, "loads", detail=node.log_tail)
    finally:
        node.stop()


def test_a_persistent_broker_restart_keeps_retained_state_and_wills(tmp_path: Path) -> None:
    """With persistence on, a broker stopped and started again still has every retained ledger (a dead node's too),
    and the will of a node killed before the restart still lets its heir adopt its slots: every slot comes back,
    and the cap holds throughout."""
    broker = Broker(tmp_path, persistence=True)
    broker.start()
    names = ["p0", "p1", "p2", "p3"]
    wire = WireAuditor(broker.port, {SEM: 2})
    nodes = start_nodes(broker.port, names, ["p0"], {SEM: 2}, tmp_path)

    def logs() -> str:
        return "\n".join(n.log_tail(15) for n in nodes.values())

    try:
        for node in nodes.values():
            node.wait_admitting(detail=logs)
        victim = nodes["p3"]
        victim.burst(1, 60.0, SEM)
        wait_until(lambda: victim.count("hold") == 1, 10, "the victim holding", detail=logs)
        victim.kill()  # its will is pending (will delay) when the broker goes down
        broker.stop()
        broker.start()  # same port, same database
        probe = paho.Client(CallbackAPIVersion.VERSION2, client_id="probe", protocol=paho.MQTTv5)
        retained: set[str] = set()
        probe.on_message = lambda c, u, msg: retained.add(msg.topic) if msg.retain else None
        probe.connect("127.0.0.1", broker.port)
        probe.subscribe("nodeguard/test/ledger/+", qos=0)
        probe.loop_start()
        try:
            wait_until(lambda: "nodeguard/test/ledger/p3" in retained, 10, "the dead node's retained ledger")
        finally:
            probe.disconnect()
            probe.loop_stop()
        live = [nodes[n] for n in names[:3]]

        def accounted() -> bool:  # the victim's slot adopted by its heir: every slot in a live allotment
            sems = [n.status()["semaphores"][SEM] for n in live]
            return sum(s["allotment"] for s in sems) == 2 and not any(s["grantsOut"] for s in sems)

        wait_until(accounted, WILL + 20, "every slot back in live allotments", detail=logs)
        assert sum(n.status()["counters"].get("adoptions", 0) for n in live) >= 1
        after = time.monotonic()
        for node in live:
            node.burst(2, 0.3, SEM)
        loads = LoadAuditor(live)
        wait_until(lambda: len(loads.done(SEM)) == 6, 20, "six loads done", detail=logs)
        assert loads.max_held(SEM) <= 2 and loads.max_held(SEM, since=after) == 2
        assert not wire.violations and not wire.malformed, (wire.violations[:1], wire.malformed[:1])
    finally:
        stop_together(nodes.values())
        wire.close()
        broker.stop()
