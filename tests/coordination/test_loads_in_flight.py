"""Loads in flight on real daemons (`nodeguard run`) over a real mosquitto: the cap holds for what actually starts,
counted from the loads' own records, through a drain-and-restart, a crash and a node cut off the broker (I13, I14)."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.coordination.conftest import Broker
from tests.coordination.harness import CuttableProxy, coordination_config
from tests.gate.helpers import Gate, output, wait_until
from tests.ports import free_port

LOAD = str(Path(__file__).with_name("notify_load.py"))
NODES = ["n0", "n1", "n2"]  # n0 is the seed (the bank); n2 reaches the broker through a proxy the test can cut
CUT = "n2"
CAP = 1
# Longer than the other MQTT tests: a daemon restarted in place must be back within the client's fence
# (lease - heartbeat = 8.5 s) on a loaded machine; the will still fires soon enough to be waited for.
TIMINGS = {"willDelaySeconds": 11, "leaseSeconds": 9.0, "heartbeatSeconds": 0.5, "drainSeconds": 2}
FENCE = TIMINGS["leaseSeconds"] - TIMINGS["heartbeatSeconds"]


def records(log: Path) -> dict[str, dict[str, float]]:
    found: dict[str, dict[str, float]] = {}
    if log.exists():
        for line in log.read_text().splitlines():
            event, name, at = line.split()
            found.setdefault(name, {})[event] = float(at)
    return found


def max_starting(log: Path) -> int:
    """The most loads starting at once by their own records: from ``start`` to ``ready`` or ``end`` (or now)."""
    events = []
    for rec in records(log).values():
        events += [(rec["start"], 1), (min(rec.get("ready", time.monotonic()), rec.get("end", time.monotonic())), -1)]
    current = peak = 0
    for _, delta in sorted(events):  # an end sorts before a start at the same instant
        current += delta
        peak = max(peak, current)
    return peak


class Cluster:
    def __init__(self, broker: Broker, tmp: Path) -> None:
        self.proxy = CuttableProxy(broker.port)
        self.log = tmp / "loads.log"
        self.gates: dict[str, Gate] = {}
        self.http: dict[str, str] = {}
        self.clients: list[subprocess.Popen[bytes]] = []
        for name in NODES:
            home = tmp / name
            (home / "run").mkdir(parents=True)
            gate = Gate(home, {"maxStarting": 8, "maxStartingPerCore": None, "startTimeoutSeconds": 300})
            port = self.proxy.port if name == CUT else broker.port
            coordination = {**coordination_config(port, [NODES[0]], {"prepare": CAP}, home / "state"), **TIMINGS}
            self.http[name] = f"127.0.0.1:{free_port()}"
            gate.config["global"]["coordination"] = {**coordination, "nodeName": name}
            gate.config["global"]["http"] = {"listen": self.http[name]}
            gate.daemon.config_path.write_text(json.dumps(gate.config))
            self.gates[name] = gate
        for gate in self.gates.values():
            gate.start()

    def coordination(self, name: str) -> dict[str, Any]:
        with urllib.request.urlopen(f"http://{self.http[name]}/status", timeout=5) as response:
            return dict(json.loads(response.read())["coordination"])

    def admitting(self, name: str) -> bool:
        try:
            return bool(self.coordination(name)["admitting"])
        except OSError:
            return False

    def load(self, node: str, name: str, seconds: float) -> subprocess.Popen[bytes]:
        proc = self.gates[node].client(
            "gate", "--name", name, "--semaphore", "prepare", "--notify",
            "--", sys.executable, LOAD, name, str(self.log), str(seconds),
        )  # fmt: skip
        self.clients.append(proc)
        return proc

    def started(self, name: str, timeout: float = 20) -> float:
        return float(wait_until(lambda: records(self.log).get(name, {}).get("start"), timeout, f"{name} started"))

    def close(self) -> None:
        for gate in self.gates.values():
            gate.stop()
        self.proxy.close()


@pytest.fixture
def cluster(broker: Broker, tmp_path: Path) -> Iterator[Cluster]:
    made = Cluster(broker, tmp_path)
    try:
        for name in NODES:
            wait_until(lambda name=name: made.admitting(name), 20, f"{name} admitting")
        yield made
    finally:
        made.close()


def test_a_node_drained_and_restarted_keeps_its_starting_load_s_slot(cluster: Cluster) -> None:
    """A rolling restart (SIGTERM, started again) of the node whose load holds the only slot: the load goes on
    starting, no other node's load starts meanwhile, and once it is ready the others get the slot."""
    gate = cluster.gates["n1"]
    first = cluster.load("n1", "inflight", 6.0)
    cluster.started("inflight")
    others = [cluster.load(node, f"{node}-{i}", 0.3) for node in ("n0", "n2") for i in range(2)]
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
    done = records(cluster.log)
    assert all("ready" in rec for rec in done.values()), done
    assert max_starting(cluster.log) == CAP, done
    assert min(rec["start"] for name, rec in done.items() if name != "inflight") > done["inflight"]["ready"]


def test_a_crashed_node_s_client_stops_its_load_before_the_heir_takes_the_slot(cluster: Cluster) -> None:
    """The daemon of the node holding the only slot is killed and stays down: its `nodeguard gate --notify` stops
    the command within the lease less a heartbeat, and only after that does a load elsewhere start on the slot."""
    victim = cluster.load("n1", "orphaned", 60.0)
    cluster.started("orphaned")
    cluster.gates["n1"].daemon.kill()
    killed = time.monotonic()
    later = cluster.load("n0", "later", 0.3)
    code, text = output(victim, timeout=30)
    assert code == 143, text  # the command was stopped
    ended = records(cluster.log)["orphaned"]["end"]
    assert ended - killed <= FENCE + 1.0, text
    code, text = output(later, timeout=40)
    assert code == 0, text
    assert records(cluster.log)["later"]["start"] > ended
    assert max_starting(cluster.log) == CAP


def test_a_notify_load_on_a_node_cut_off_the_broker_is_stopped_when_its_slot_is_revoked(cluster: Cluster) -> None:
    """`nodeguard gate --notify` watches its load from submission: when its node loses the broker past the lease
    and revokes the slot, the command is stopped before it says READY=1, and the slot serves another node."""
    victim = cluster.load(CUT, "cut", 60.0)
    cluster.started("cut")
    cluster.proxy.cut()
    cut_at = time.monotonic()
    later = cluster.load("n0", "later", 0.3)
    code, text = output(victim, timeout=30)
    assert code == 143 and "revoked" in text, text
    ended = records(cluster.log)["cut"]["end"]
    assert TIMINGS["leaseSeconds"] - 1.0 <= ended - cut_at <= TIMINGS["leaseSeconds"] + 2.0
    code, text = output(later, timeout=40)
    assert code == 0, text
    assert max_starting(cluster.log) == CAP
    cluster.proxy.heal()
