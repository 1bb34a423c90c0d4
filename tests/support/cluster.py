"""A cluster on one broker, as the coordination tests run it: each node's coordination config, an auditor of
every message on the wire, real daemons with their gates as nodes, and the one cluster those tests start.

A test module declares its cluster as ``CLUSTER = ClusterSpec(...)``; the ``cluster`` fixture of
tests/coordination/conftest.py starts it (bare coordination processes, or real daemons when the spec names their
gate), waits until every node admits, and stops it after the test.
"""

from __future__ import annotations

import json
import threading
import time
import urllib.request
from collections import Counter
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Generic, Protocol, TypeVar

import paho.mqtt.client as paho
from paho.mqtt.enums import CallbackAPIVersion

from nodeguard.coordination.records import SlotLedger, Succession
from nodeguard.coordination.topics import (
    Malformed,
    Topics,
    decode_census,
    decode_gone,
    decode_inbox,
    decode_ledger,
    decode_member,
    decode_status,
)
from tests.support.broker import Broker, CuttableProxy
from tests.support.gate import Gate
from tests.support.poll import wait_until
from tests.support.ports import free_port

TIMINGS = {
    "willDelaySeconds": 4,
    "leaseSeconds": 3.0,
    "heartbeatSeconds": 0.3,
}


def coordination_config(
    port: int, seeds: list[str], semaphores: dict[str, int], state_dir: Path, **extra: Any
) -> dict[str, Any]:
    return {
        "enabled": True,
        "cluster": "test",
        "seeds": seeds,
        **extra,
        "semaphores": semaphores,
        "stateDir": str(state_dir),
        **TIMINGS,
        "broker": {
            "host": "127.0.0.1",
            "port": port,
            "keepaliveSeconds": 1,
            "reconnectMinSeconds": 0.1,
            "reconnectMaxSeconds": 0.5,
        },
    }


class WireAuditor:
    """Subscribed to every topic of the cluster: checks every message parses and that the allotments on the wire
    (estates counted until their named heir adopts them, grants until applied) never add up to more than a cap."""

    def __init__(self, port: int, semaphores: dict[str, int]) -> None:
        self.topics = Topics("test")
        self.caps = dict(semaphores)
        self.ledgers: dict[str, SlotLedger] = {}
        self.known: set[str] = set()  # every node whose ledger was ever seen (a view without one is partial)
        self.kinds: Counter[str] = Counter()
        self.malformed: list[str] = []
        self.max_total: dict[str, int] = dict.fromkeys(semaphores, 0)
        self.violations: list[str] = []
        self.wills: list[str] = []
        self.members: dict[str, str] = {}
        self.trail: list[str] = []
        self.partial_views = 0
        self.lock = threading.Lock()
        self.client = paho.Client(CallbackAPIVersion.VERSION2, client_id="auditor", protocol=paho.MQTTv5)
        self.client.on_connect = self._on_connect
        self.client.on_message = self._on_message
        self.client.connect("127.0.0.1", port, keepalive=5)
        self.client.loop_start()

    def close(self) -> None:
        self.client.disconnect()  # first: the network loop then ends at once, not at its next 1 s select
        self.client.loop_stop()

    def set_caps(self, semaphores: dict[str, int]) -> None:
        """A reload: the bound is the largest cap configured since the auditor started."""
        with self.lock:
            for sem, cap in semaphores.items():
                self.caps[sem] = max(self.caps.get(sem, 0), cap)
                self.max_total.setdefault(sem, 0)

    def _on_connect(self, client: paho.Client, *_: Any) -> None:
        with self.lock:
            self.ledgers.clear()  # a new broker or session: the retained state comes again
            self.trail.append(f"{time.monotonic():.3f} auditor connected")
        client.subscribe(f"{self.topics.prefix}/#", qos=1)

    def _on_message(self, client: paho.Client, userdata: Any, msg: paho.MQTTMessage) -> None:
        parsed = self.topics.parse(msg.topic)
        if parsed is None or not msg.payload:
            return
        kind, node = parsed
        with self.lock:
            self.kinds[kind] += 1
            try:
                if kind == "ledger":
                    ledger = decode_ledger(msg.payload, node)
                    self.trail.append(f"{time.monotonic():.3f} retain={int(msg.retain)} {_brief(ledger)}")
                    old = self.ledgers.get(node)
                    self.known.add(node)
                    if old is None or ledger.seq > old.seq:
                        self.ledgers[node] = ledger
                        self._check()
                elif kind == "status":
                    decode_status(msg.payload, node)
                elif kind == "inbox":
                    decode_inbox(msg.payload)
                elif kind == "member":
                    self.members[node] = decode_member(msg.payload, node).state.value
                elif kind in ("census", "bank"):
                    decode_census(msg.payload)
                elif kind == "gone":
                    self.wills.append(f"{node}@{decode_gone(msg.payload, node).epoch}")
            except Malformed as exc:
                self.malformed.append(f"{msg.topic}: {exc}")

    def _adopted(self, node: str, heir: str, succession: Succession | None) -> int:
        """How far ``node``'s estates are adopted: by its heir or another member of its succession (I16)."""
        names = {heir, *(n for n, _ in succession or ())} - {"", node}
        return max([0, *(self.ledgers[n].adopted.get(node, 0) for n in names if n in self.ledgers)])

    def total(self, sem: str) -> int:
        total = 0
        for node, ledger in self.ledgers.items():
            if ledger.seq > self._adopted(node, ledger.heir, ledger.succession):
                total += ledger.allot.get(sem, 0)
            for lost in ledger.lost:
                if self._adopted(node, lost.heir, lost.succession) < lost.seq:
                    total += lost.allot.get(sem, 0)
            for grant in ledger.grants:
                recipient = self.ledgers.get(grant.to)
                if grant.sem == sem and (recipient is None or grant.id not in recipient.applied.get(node, ())):
                    total += grant.n
        return total

    def _check(self) -> None:
        # Only a full set of latest ledgers is a cut of the cluster's state. In a partial one (after
        # reconnecting to a restarted broker, before every node republished) a missing recipient's
        # acknowledgement is unknown while the donor's lazily published drop of that grant may lag: the
        # same slot would be counted as in flight and again where the recipient passed it on.
        if set(self.ledgers) != self.known:
            self.partial_views += 1
            return
        for sem, cap in self.caps.items():
            total = self.total(sem)
            self.max_total[sem] = max(self.max_total.get(sem, 0), total)
            if total > cap:
                view = "\n".join(_brief(ledger) for _, ledger in sorted(self.ledgers.items()))
                trail = "\n".join(self.trail[-40:])
                self.violations.append(f"{sem}: {total} > {cap} in the ledgers seen:\n{view}\nlast messages:\n{trail}")

    def allotments(self, sem: str) -> dict[str, int]:
        with self.lock:
            return {n: ledger.allot.get(sem, 0) for n, ledger in self.ledgers.items()}


def _brief(ledger: SlotLedger) -> str:
    grants = [(g.id % 10000, g.to, g.epoch % 100000, g.n) for g in ledger.grants]
    applied = {d: sorted(i % 10000 for i in ids) for d, ids in ledger.applied.items()}
    return (
        f"{ledger.node} seq={ledger.seq} epoch={ledger.epoch % 100000} heir={ledger.heir} allot={dict(ledger.allot)} "
        f"mint={ledger.mint} grants={grants} applied={applied} adopted={dict(ledger.adopted)} "
        f"lost={[(x.seq, x.heir, dict(x.allot)) for x in ledger.lost]}{' leaving' if ledger.leaving else ''}"
    )


class ClusterNode(Protocol):
    """What a cluster needs of one of its nodes, whatever runs it."""

    name: str

    def start(self) -> object: ...

    def wait_admitting(self, timeout: float = 20.0, detail: Callable[[], str] | None = None) -> None: ...

    def log_tail(self, lines: int = 25) -> str: ...

    def terminate(self) -> None: ...

    def stop(self) -> None: ...


N = TypeVar("N", bound=ClusterNode)


@dataclass(frozen=True)
class ClusterSpec:
    """A test cluster's shape: its nodes, the seeds among them (they hold the caps at genesis), the caps, the node
    that reaches the broker through a proxy the test can cut, timings over ``TIMINGS``, and the gate of each node
    when the nodes are real daemons (None: bare coordination processes)."""

    nodes: tuple[str, ...]
    seeds: tuple[str, ...]
    caps: dict[str, int]
    cut: str | None = None
    timings: dict[str, float] = field(default_factory=dict)
    gate: dict[str, Any] | None = None


class Cluster(Generic[N]):
    """The spec's nodes started on ``broker``, an auditor on the wire, and the proxy of the node ``spec.cut``."""

    def __init__(
        self, broker: Broker, workdir: Path, spec: ClusterSpec, make_node: Callable[[str, dict[str, Any], Path], N]
    ) -> None:
        self.broker = broker
        self.spec = spec
        self.proxy = CuttableProxy(broker.port) if spec.cut is not None else None
        self.wire = WireAuditor(broker.port, spec.caps)
        self.nodes: dict[str, N] = {}
        try:
            for name in spec.nodes:
                port = self.proxy.port if self.proxy is not None and name == spec.cut else broker.port
                state = workdir / "state" / name
                config = {**coordination_config(port, list(spec.seeds), spec.caps, state), **spec.timings}
                self.nodes[name] = make_node(name, config, workdir)
            for node in self.nodes.values():  # all at once: their interpreters start side by side
                node.start()
        except BaseException:
            self.close()  # the ones started must not outlive the test
            raise

    def logs(self) -> str:
        """The end of every node's log, for a failure message."""
        return "\n".join(node.log_tail() for node in self.nodes.values())

    def wait_admitting(self, names: Iterable[str] | None = None, timeout: float = 20.0) -> None:
        """Until each named node (default: all) runs and its coordination admits."""
        for name in names or self.nodes:
            self.nodes[name].wait_admitting(timeout, detail=self.logs)

    def close(self) -> None:
        stop_together(self.nodes.values())
        self.wire.close()
        if self.proxy is not None:
            self.proxy.close()


def stop_together(nodes: Iterable[ClusterNode]) -> None:
    """Ask every node to stop at once (they drain together), then wait for each."""
    nodes = list(nodes)
    for node in nodes:
        node.terminate()
    for node in nodes:
        node.stop()


class GatedDaemon:
    """``nodeguard run`` as one node of a cluster: its gate on a socket of its own, coordination, and HTTP."""

    def __init__(self, name: str, coordination: dict[str, Any], workdir: Path, gate: dict[str, Any]) -> None:
        self.name = name
        home = workdir / name
        (home / "run").mkdir(parents=True)
        self.gate = Gate(home, gate)
        self.http = f"127.0.0.1:{free_port()}"
        self.gate.config["global"]["coordination"] = {**coordination, "nodeName": name}
        self.gate.config["global"]["http"] = {"listen": self.http}
        self.gate.daemon.config_path.write_text(json.dumps(self.gate.config))

    def start(self) -> GatedDaemon:
        self.gate.start(wait=False)
        return self

    def status(self) -> dict[str, Any]:
        """The daemon's /status."""
        with urllib.request.urlopen(f"http://{self.http}/status", timeout=5) as response:
            return dict(json.loads(response.read()))

    def coordination(self) -> dict[str, Any]:
        return dict(self.status()["coordination"])

    def admitting(self) -> bool:
        try:
            return bool(self.coordination()["admitting"])
        except OSError:  # its HTTP server is not up (yet, or any more)
            return False

    def wait_admitting(self, timeout: float = 20.0, detail: Callable[[], str] | None = None) -> None:
        """Until its gate answers and its coordination admits."""
        self.gate.wait_answering()
        wait_until(self.admitting, timeout, f"{self.name} admitting", detail=detail or self.log_tail)

    def log_tail(self, lines: int = 25) -> str:
        try:
            text = self.gate.daemon.log_path.read_text().splitlines()
        except OSError:
            return ""
        return f"--- {self.name} ---\n" + "\n".join(text[-lines:])

    def terminate(self) -> None:
        """Nothing ahead of ``stop``: the daemon acts on no cgroup (dry run), so it is killed with its clients."""

    def stop(self) -> None:
        self.gate.stop()
