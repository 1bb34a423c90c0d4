"""Node processes, a cuttable TCP proxy and the auditors for the MQTT integration tests."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

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

REPO = Path(__file__).resolve().parents[2]
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


def wait_until(predicate: Callable[[], bool], timeout: float, what: str, *, detail: Callable[[], str] = str) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return
        time.sleep(0.05)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}\n{detail()}")


class NodeProcess:
    """``python -m tests.coordination.node_process`` with its JSON events collected from stdout."""

    def __init__(self, name: str, config: dict[str, Any], workdir: Path) -> None:
        self.name = name
        self.workdir = workdir
        self.config_path = workdir / f"{name}.json"
        self.config_path.write_text(json.dumps(config))
        self.stderr_path = workdir / f"{name}.log"
        self.events: list[dict[str, Any]] = []
        self.lock = threading.Lock()
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> NodeProcess:
        stderr = self.stderr_path.open("ab")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tests.coordination.node_process", "--config", str(self.config_path), "--node",
             self.name, "--stdin"],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=stderr, cwd=REPO,
        )  # fmt: skip
        stderr.close()
        threading.Thread(target=self._read, args=(self.proc,), daemon=True).start()
        return self

    def _read(self, proc: subprocess.Popen[bytes]) -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            try:
                event = json.loads(line)
            except ValueError:
                continue
            with self.lock:
                self.events.append(event)

    def send(self, **cmd: Any) -> None:
        assert self.proc is not None and self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(cmd).encode() + b"\n")
        self.proc.stdin.flush()

    def burst(self, count: int, hold: float, semaphore: str) -> None:
        self.send(cmd="burst", count=count, hold=hold, semaphore=semaphore)

    def snapshot(self) -> list[dict[str, Any]]:
        with self.lock:
            return list(self.events)

    def count(self, event: str) -> int:
        return sum(1 for e in self.snapshot() if e["ev"] == event)

    def wait_started(self, timeout: float = 30.0) -> None:
        """Until the process runs its event loop (ten interpreters starting at once on two cores take a while)."""
        wait_until(lambda: self.count("started") >= 1, timeout, f"{self.name} started", detail=self.log_tail)

    def wait_admitting(self, timeout: float = 20.0, detail: Callable[[], str] | None = None) -> None:
        """Until it runs and its coordination admits (``detail``: what a timeout shows, its own log by default)."""
        self.wait_started()
        wait_until(
            lambda: self.status()["admitting"], timeout, f"{self.name} admitting", detail=detail or self.log_tail
        )

    def status(self, timeout: float = 5.0) -> dict[str, Any]:
        before = self.count("status")
        self.send(cmd="status")
        wait_until(lambda: self.count("status") > before, timeout, f"status of {self.name}")
        return [e for e in self.snapshot() if e["ev"] == "status"][-1]["status"]

    def kill(self) -> None:
        assert self.proc is not None
        os.kill(self.proc.pid, signal.SIGKILL)
        self.proc.wait(5)
        with self.lock:  # after it is surely dead: its loads held until then
            self.events.append({"ev": "killed", "t": time.monotonic(), "node": self.name})

    def terminate(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGTERM)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGTERM)
        if self.proc is not None:
            try:
                self.proc.wait(10)  # it drains first: up to drainSeconds (3) and a second for its last record
            except subprocess.TimeoutExpired:
                os.kill(self.proc.pid, signal.SIGUSR2)  # its tasks' stacks go to its log
                time.sleep(0.3)
                os.kill(self.proc.pid, signal.SIGKILL)
                self.proc.wait(5)
                raise AssertionError(f"{self.name} did not stop on SIGTERM\n{self.log_tail(60)}") from None

    def log_tail(self, lines: int = 25) -> str:
        try:
            text = self.stderr_path.read_text().splitlines()
        except OSError:
            return ""
        return f"--- {self.name} ---\n" + "\n".join(text[-lines:])


def start_nodes(
    port: int, names: list[str], seeds: list[str], semaphores: dict[str, int], workdir: Path
) -> dict[str, NodeProcess]:
    """One node process per name on the broker at ``port``, each with its own state directory."""
    return {
        name: NodeProcess(name, coordination_config(port, seeds, semaphores, workdir / "state" / name), workdir).start()
        for name in names
    }


def stop_nodes(nodes: Iterable[NodeProcess]) -> None:
    """SIGTERM every node at once (they drain together), then wait for each."""
    nodes = list(nodes)
    for node in nodes:
        node.terminate()
    for node in nodes:
        node.stop()


class LoadAuditor:
    """The loads' own reports: the sum held at every instant, from CLOCK_MONOTONIC timestamps."""

    def __init__(self, nodes: list[NodeProcess]) -> None:
        self.nodes = nodes

    def intervals(self, sem: str) -> list[tuple[float, float, str]]:
        spans = []
        now = time.monotonic()
        for node in self.nodes:
            open_: dict[str, float] = {}
            for e in node.snapshot():
                if e["ev"] == "killed":
                    spans += [(start, e["t"], load) for load, start in open_.items()]
                    open_.clear()
                if e.get("sem") != sem:
                    continue
                if e["ev"] == "hold":
                    open_[e["load"]] = e["t"]
                elif e["ev"] in ("free", "revoked") and e["load"] in open_:
                    spans.append((open_.pop(e["load"]), e["t"], e["load"]))
            spans += [(start, max(start, now), load) for load, start in open_.items()]
        return spans

    def max_held(self, sem: str, since: float = 0.0) -> int:
        points = []
        for start, end, _ in self.intervals(sem):
            if end >= since:
                points += [(start, 1), (end, -1)]
        held = peak = 0
        for _, delta in sorted(points, key=lambda p: (p[0], p[1])):  # at equal times a release comes first
            held += delta
            peak = max(peak, held)
        return peak

    def requested(self, sem: str) -> set[str]:
        return {e["load"] for n in self.nodes for e in n.snapshot() if e["ev"] == "request" and e["sem"] == sem}

    def done(self, sem: str) -> set[str]:
        return {e["load"] for n in self.nodes for e in n.snapshot() if e["ev"] == "done" and e["sem"] == sem}


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
        self.client.loop_stop()
        self.client.disconnect()

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


class CuttableProxy:
    """A TCP proxy between one node and the broker; ``cut()`` drops its connections and refuses new ones."""

    def __init__(self, target_port: int) -> None:
        self.target_port = target_port
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = int(self.listener.getsockname()[1])
        self.cut_off = threading.Event()
        self.sockets: set[socket.socket] = set()
        self.lock = threading.Lock()
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            if self.cut_off.is_set():
                client.close()
                continue
            try:
                upstream = socket.create_connection(("127.0.0.1", self.target_port))
            except OSError:
                client.close()
                continue
            with self.lock:
                self.sockets |= {client, upstream}
            threading.Thread(target=self._pump, args=(client, upstream), daemon=True).start()
            threading.Thread(target=self._pump, args=(upstream, client), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket) -> None:
        try:
            while data := src.recv(65536):
                dst.sendall(data)
        except OSError:
            pass
        for sock in (src, dst):
            with self.lock:
                self.sockets.discard(sock)
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
            sock.close()

    def cut(self) -> None:
        self.cut_off.set()
        with self.lock:
            sockets = list(self.sockets)
        for sock in sockets:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)

    def heal(self) -> None:
        self.cut_off.clear()

    def close(self) -> None:
        self.cut()
        self.listener.close()
