"""Loads in flight on real daemons (`nodeguard run`) over a real mosquitto: the cap holds for what actually starts,
counted from the loads' own records, through a drain-and-restart, a crash and a node cut off the broker (I13, I14)."""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path

from tests.support.cluster import Cluster, ClusterSpec, GatedDaemon
from tests.support.gate import output
from tests.support.poll import wait_until
from tests.support.records import max_overlap, read_records

LOAD = str(Path(__file__).with_name("notify_load.py"))
NODES = ("n0", "n1", "n2")  # n0 is the seed (the bank); n2 reaches the broker through a proxy the test can cut
CUT = "n2"
CAP = 1
# Longer than the other MQTT tests: a daemon restarted in place must be back within the client's fence
# (lease - heartbeat = 8.5 s) on a loaded machine; the will still fires soon enough to be waited for.
TIMINGS = {"willDelaySeconds": 11, "leaseSeconds": 9.0, "heartbeatSeconds": 0.5, "drainSeconds": 2}
FENCE = TIMINGS["leaseSeconds"] - TIMINGS["heartbeatSeconds"]
CLUSTER = ClusterSpec(NODES, seeds=NODES[:1], caps={"prepare": CAP}, cut=CUT, timings=TIMINGS,
                      gate={"maxStarting": 8, "maxStartingPerCore": None, "startTimeoutSeconds": 300})  # fmt: skip


def max_starting(log: Path) -> int:
    """The most loads starting at once by their own records: from ``start`` to ``ready`` or ``end`` (or now)."""
    now = time.monotonic()
    return max_overlap([(r["start"], min(r.get("ready", now), r.get("end", now))) for r in read_records(log).values()])


def load(cluster: Cluster[GatedDaemon], node: str, name: str, seconds: float, log: Path) -> subprocess.Popen[bytes]:
    """`nodeguard gate --semaphore prepare --notify` on ``node``, of a load that starts for ``seconds`` and records
    itself in ``log``."""
    return cluster.nodes[node].gate.client(
        "gate", "--name", name, "--semaphore", "prepare", "--notify",
        "--", sys.executable, LOAD, name, str(log), str(seconds),
    )  # fmt: skip


def started(name: str, log: Path, timeout: float = 20) -> float:
    """When the load ``name`` recorded its start, once it has."""
    return float(wait_until(lambda: read_records(log).get(name, {}).get("start"), timeout, f"{name} started"))


def test_a_node_drained_and_restarted_keeps_its_starting_load_s_slot(
    cluster: Cluster[GatedDaemon], tmp_path: Path
) -> None:
    """A rolling restart (SIGTERM, started again) of the node whose load holds the only slot: the load goes on
    starting, no other node's load starts meanwhile, and once it is ready the others get the slot."""
    log = tmp_path / "loads.log"
    gate = cluster.nodes["n1"].gate
    first = load(cluster, "n1", "inflight", 6.0, log)
    started("inflight", log)
    others = [load(cluster, node, f"{node}-{i}", 0.3, log) for node in ("n0", "n2") for i in range(2)]
    stopped = time.monotonic()
    gate.daemon.signal(signal.SIGTERM)
    assert gate.daemon.wait(15) == 0
    gate.daemon.start()
    gate.daemon.wait_for(gate._answers, 20, "the restarted gate")
    away = time.monotonic() - stopped
    code, text = output(first, timeout=30)
    assert code == 0, (away, text)
    assert "inflight is ready" in text  # the client re-attached and reported READY=1 to the restarted daemon
    for proc in others:
        code, text = output(proc, timeout=40)
        assert code == 0, text
    done = read_records(log)
    assert all("ready" in rec for rec in done.values()), done
    assert max_starting(log) == CAP, done
    assert min(rec["start"] for name, rec in done.items() if name != "inflight") > done["inflight"]["ready"]


def test_a_crashed_node_s_client_stops_its_load_before_the_heir_takes_the_slot(
    cluster: Cluster[GatedDaemon], tmp_path: Path
) -> None:
    """The daemon of the node holding the only slot is killed and stays down: its `nodeguard gate --notify` stops
    the command within the lease less a heartbeat, and only after that does a load elsewhere start on the slot."""
    log = tmp_path / "loads.log"
    victim = load(cluster, "n1", "orphaned", 60.0, log)
    started("orphaned", log)
    cluster.nodes["n1"].gate.daemon.kill()
    killed = time.monotonic()
    later = load(cluster, "n0", "later", 0.3, log)
    code, text = output(victim, timeout=30)
    assert code == 143, text  # the command was stopped
    ended = read_records(log)["orphaned"]["end"]
    assert ended - killed <= FENCE + 1.0, text
    code, text = output(later, timeout=40)
    assert code == 0, text
    assert read_records(log)["later"]["start"] > ended
    assert max_starting(log) == CAP


def test_a_notify_load_on_a_node_cut_off_the_broker_is_stopped_when_its_slot_is_revoked(
    cluster: Cluster[GatedDaemon], tmp_path: Path
) -> None:
    """`nodeguard gate --notify` watches its load from submission: when its node loses the broker past the lease
    and revokes the slot, the command is stopped before it says READY=1, and the slot serves another node."""
    log = tmp_path / "loads.log"
    victim = load(cluster, CUT, "cut", 60.0, log)
    started("cut", log)
    cluster.proxy.cut()
    cut_at = time.monotonic()
    later = load(cluster, "n0", "later", 0.3, log)
    code, text = output(victim, timeout=30)
    assert code == 143 and "revoked" in text, text
    ended = read_records(log)["cut"]["end"]
    assert TIMINGS["leaseSeconds"] - 1.0 <= ended - cut_at <= TIMINGS["leaseSeconds"] + 2.0
    code, text = output(later, timeout=40)
    assert code == 0, text
    assert max_starting(log) == CAP
    cluster.proxy.heal()
