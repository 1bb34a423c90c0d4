"""The churn benchmark (``bench/cluster.py --churn``): real ``nodeguard run`` daemons, one per simulated node, a real
mosquitto, loads held by real ``nodeguard gate --semaphore --notify`` clients, and churn.

Each load is tests/coordination/notify_load.py: it appends its own ``start``, ``ready`` (or ``end``, when it is
stopped) with CLOCK_MONOTONIC to one log, and the auditor counts what runs at once from those records alone, not
from nodeguard's. Churn, in a seeded order: joins of new nodes, SIGKILL crashes restarted before and after the will
delay, SIGTERM drains restarted two seconds later (a rolling update), the bank drained and crashed, the bank crashed
while its heir is down, and live cap changes both ways (config rewritten, SIGHUP to every node).

Figures: ``violations`` (load starts at which more loads were starting than the cap; during the ten seconds after a
cap change the larger of the two caps), ``worst_overshoot``, ``longest_stall_s`` (the longest time with waiting
loads and no start anywhere), ``stranded_slot_s`` (the longest a node's gate held a cluster slot for a load whose
command had ended, from HTTP status polled every half second; ``stranded_after_back_s`` counts from the node's
restart for a load that ended while its node was down), ``admissions_per_s``, and the wait from a client's
spawn to its load's start, ``wait_p50_s`` / ``wait_p99_s``.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections import Counter
from pathlib import Path
from typing import Any

from bench.common import Broker, Gate, coordination_config, free_port

LOAD = str(Path(__file__).resolve().parents[1] / "tests" / "coordination" / "notify_load.py")
SEM = "prepare"
TIMINGS = {"willDelaySeconds": 6, "leaseSeconds": 4.5, "heartbeatSeconds": 0.4, "drainSeconds": 2}
CHANGE_WINDOW = 10.0  # seconds after a cap change during which the larger cap bounds


class Node:
    def __init__(self, name: str, home: Path, port: int, seeds: list[str], cap: int) -> None:
        self.name = name
        (home / "run").mkdir(parents=True, exist_ok=True)
        self.gate = Gate(home, {"maxStarting": 8, "maxStartingPerCore": None, "startTimeoutSeconds": 120})
        self.http = f"127.0.0.1:{free_port()}"
        coordination = {**coordination_config(port, seeds, {SEM: cap}, home / "state"), **TIMINGS}
        self.gate.config["global"]["coordination"] = {**coordination, "nodeName": name}
        # The guard's readings play no part here: fewer ticks leave the CPU to the daemons' coordination and the
        # broker (50 daemons on two cores were starved: fenced and reconnecting, with or without this).
        self.gate.config["global"]["sensing"]["tickSeconds"] = 1.0
        self.gate.config["global"]["http"] = {"listen": self.http}
        self.write()
        self.up = False

    def write(self) -> None:
        self.gate.daemon.config_path.write_text(json.dumps(self.gate.config))

    def start(self) -> None:
        self.gate.daemon.start()
        self.up = True

    def status(self) -> dict[str, Any] | None:
        try:
            with urllib.request.urlopen(f"http://{self.http}/status", timeout=2) as response:
                return dict(json.loads(response.read()))
        except (OSError, ValueError):
            return None


class Churn:
    def __init__(self, nodes: int, seconds: float, seed: int, cap: int) -> None:
        self.rng = random.Random(seed)
        self.seconds = seconds
        self.tmp = Path(
            tempfile.mkdtemp(prefix="nodeguard-churn-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
        )
        self.broker = Broker(self.tmp, sys_interval=1).start()
        self.port = self.broker.port
        self.log = self.tmp / "loads.log"
        self.cap = cap
        self.caps: list[tuple[float, int]] = [(0.0, cap)]
        self.names = [f"n{i:02d}" for i in range(nodes)]
        self.seeds = self.names[:3]
        self.nodes: dict[str, Node] = {}
        self.lock = threading.Lock()
        self.spawned: dict[str, tuple[str, float]] = {}  # load -> (node, spawned at)
        self.exited: dict[str, tuple[float, int]] = {}  # load -> (exited at, code)
        self.clients: dict[str, subprocess.Popen[bytes]] = {}
        self.last_held: dict[str, float] = {}  # load -> last time a gate listed it starting with its slot held
        self.stopped = threading.Event()
        self.events: list[str] = []
        self.restarts: dict[str, list[float]] = {}  # node -> when it was started again
        self.timers: list[threading.Timer] = []
        self._ids = 0
        self.stall_window = (0.0, 0.0)

    # --- nodes and churn ---------------------------------------------------------------

    def add(self, name: str) -> Node:
        node = self.nodes[name] = Node(name, self.tmp / name, self.port, self.seeds, self.cap)
        node.start()
        return node

    def note(self, what: str) -> None:
        self.events.append(f"{time.monotonic():.2f} {what}")

    def bank(self) -> str | None:
        for node in self.nodes.values():
            status = node.status() if node.up else None
            if status is not None and status.get("coordination", {}).get("bank"):
                return str(status["coordination"]["bank"])
        return None

    def heir_of(self, name: str) -> str | None:
        status = self.nodes[name].status()
        heir = status.get("coordination", {}).get("heir") if status else None
        return str(heir) if heir and heir != name else None

    def later(self, seconds: float, action: Any) -> None:
        timer = threading.Timer(seconds, action)
        timer.daemon = True
        timer.start()
        self.timers.append(timer)

    def restart_after(self, name: str, seconds: float) -> None:
        def restart() -> None:
            if not self.nodes[name].up:
                self.note(f"restart {name}")
                self.restarts.setdefault(name, []).append(time.monotonic())
                self.nodes[name].start()

        self.later(seconds, restart)

    def crash(self, name: str, restart_in: float | None) -> None:
        node = self.nodes[name]
        if not node.up:
            return
        self.note(f"crash {name}")
        node.gate.daemon.kill()
        node.up = False
        if restart_in is not None:
            self.restart_after(name, restart_in)

    def drain(self, name: str, restart_in: float | None) -> None:
        node = self.nodes[name]
        if not node.up:
            return
        self.note(f"drain {name}")
        node.gate.daemon.signal(signal.SIGTERM)
        node.up = False

        def reap() -> None:
            try:
                node.gate.daemon.wait(20)
            except subprocess.TimeoutExpired:
                node.gate.daemon.kill()
            if restart_in is not None:
                self.restart_after(name, restart_in)

        threading.Thread(target=reap, daemon=True).start()

    def set_cap(self, cap: int) -> None:
        self.note(f"cap {self.cap} -> {cap}")
        self.cap = cap
        self.caps.append((time.monotonic(), cap))
        for node in self.nodes.values():
            node.gate.config["global"]["coordination"]["semaphores"] = {SEM: cap}
            node.write()
            if node.up and node.gate.daemon.proc is not None and node.gate.daemon.proc.poll() is None:
                node.gate.daemon.signal(signal.SIGHUP)

    def live(self) -> list[str]:
        return [n for n, node in self.nodes.items() if node.up]

    def churn_step(self, step: int) -> None:
        will = TIMINGS["willDelaySeconds"]
        kind = step % 9
        live = self.live()
        current = self.bank()  # once: a status call per live node made a step take a minute at 50 nodes
        others = [n for n in live if n != current]
        if kind == 0:
            fresh = f"j{step:02d}"
            self.note(f"join {fresh}")
            self.add(fresh)
        elif kind == 1 and others:
            self.crash(self.rng.choice(others), 1.0)  # back before the will
        elif kind == 2 and others:
            self.drain(self.rng.choice(others), 2.0)  # a rolling update
        elif kind == 3 and others:
            self.crash(self.rng.choice(others), will + 2.0)  # back after the will
        elif kind == 4 and (bank := self.bank()):
            self.drain(bank, 2.0)
        elif kind == 5:
            self.set_cap(self.cap + 1)
        elif kind == 6 and (bank := self.bank()):
            heir = self.heir_of(bank)
            if heir is not None:
                self.crash(heir, will + 3.0)  # the heir is down when the bank's will fires
                time.sleep(0.5)
            self.crash(bank, 2 * will + 2.0)
        elif kind == 7:
            self.set_cap(max(1, self.cap - 1))
        elif kind == 8 and (bank := self.bank()):
            self.crash(bank, will + 2.0)

    # --- loads -------------------------------------------------------------------------

    def spawn(self, node: str) -> None:
        self._ids += 1
        load = f"{node}-{self._ids}"
        hold = self.rng.uniform(0.2, 1.0)
        proc = subprocess.Popen(
            [sys.executable, "-m", "nodeguard", "gate", "--name", load, "--semaphore", SEM, "--notify",
             "--connect-timeout", "10", "--", sys.executable, LOAD, load, str(self.log), f"{hold:.3f}"],
            cwd=str(Path(__file__).resolve().parents[1]),
            env={**os.environ, "NODEGUARD_GATE_SOCKET": self.nodes[node].gate.socket},
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True,
        )  # fmt: skip
        with self.lock:
            self.spawned[load] = (node, time.monotonic())
            self.clients[load] = proc

    def flow(self, per_node: int) -> None:
        """Every live node keeps ``per_node`` clients waiting or starting."""
        while not self.stopped.wait(0.1):
            with self.lock:
                outstanding: dict[str, int] = {}
                for load, (node, _) in self.spawned.items():
                    if load not in self.exited:
                        outstanding[node] = outstanding.get(node, 0) + 1
            for name in self.live():
                if outstanding.get(name, 0) < per_node and self.nodes[name].gate.daemon.proc is not None:
                    self.spawn(name)
                    break  # one a tick: client interpreters are not free on two cores

    def reap(self) -> None:
        while not (self.stopped.is_set() and not self._running()):
            with self.lock:
                clients = list(self.clients.items())
            for load, proc in clients:
                code = proc.poll()
                if code is not None:
                    with self.lock:
                        self.exited[load] = (time.monotonic(), code)
                        del self.clients[load]
            time.sleep(0.05)

    def _running(self) -> bool:
        with self.lock:
            return bool(self.clients)

    def poll_slots(self) -> None:
        while not self.stopped.wait(0.5):
            for node in list(self.nodes.values()):
                status = node.status() if node.up else None
                if status is None:
                    continue
                now = time.monotonic()
                for load in status.get("gate", {}).get("loads", []):
                    if load.get("state") == "starting" and load.get("clusterSlot") == "held":
                        self.last_held[load["name"]] = now

    # --- the run and the audit ---------------------------------------------------------

    def run(self, per_node: int) -> dict[str, Any]:
        initial = self.names
        try:
            for name in initial:
                self.add(name)
            wait = max(60.0, 4.0 * len(initial))  # 50 daemons starting at once on two cores take minutes
            deadline = time.monotonic() + wait
            while time.monotonic() < deadline:
                states = [node.status() for node in self.nodes.values()]
                admitting = sum(1 for s in states if s is not None and s["coordination"].get("admitting"))
                if admitting == len(states):
                    break
                time.sleep(0.5)
            else:
                raise SystemExit(f"{admitting} of {len(states)} nodes admitting after {wait:.0f} s")
            threads = [
                threading.Thread(target=self.flow, args=(per_node,), daemon=True),
                threading.Thread(target=self.reap, daemon=True),
                threading.Thread(target=self.poll_slots, daemon=True),
            ]
            for thread in threads:
                thread.start()
            started = time.monotonic()
            step = 0
            while time.monotonic() - started < self.seconds:
                time.sleep(self.rng.uniform(2.0, 4.0))
                self.churn_step(step)
                step += 1
            self.stopped.set()  # no more loads; restarts already due still happen
            finish = time.monotonic() + 90
            while self._running() and time.monotonic() < finish:
                time.sleep(0.2)
            for timer in self.timers:
                timer.join()
            for node in self.nodes.values():  # restart what is down, so that waiting clients can end
                if not node.up:
                    node.start()
            while self._running() and time.monotonic() < finish + 30:
                time.sleep(0.2)
            ended = time.monotonic()
            return self.audit(started, ended) | {"churn_events": len(self.events), "steps": step}
        finally:
            self.stopped.set()
            for timer in self.timers:
                timer.cancel()
            with self.lock:
                left = list(self.clients.values())
            for proc in left:
                if proc.poll() is None:
                    os.killpg(proc.pid, signal.SIGKILL)
            for node in self.nodes.values():
                node.gate.stop()
            self.broker.stop()

    def bound(self, at: float) -> int:
        caps = [cap for t, cap in self.caps if t <= at]
        recent = [cap for t, cap in self.caps if at - CHANGE_WINDOW <= t <= at]
        return max([caps[-1], *recent])

    def audit(self, started: float, ended: float) -> dict[str, Any]:
        records: dict[str, dict[str, float]] = {}
        for line in self.log.read_text().splitlines() if self.log.exists() else []:
            event, name, at = line.split()
            records.setdefault(name, {})[event] = float(at)
        intervals = []
        for name, rec in records.items():
            if "start" not in rec:
                continue
            stop = min(rec.get("ready", ended), rec.get("end", ended), self.exited.get(name, (ended, 0))[0])
            intervals.append((rec["start"], stop))
        violations, overshoot = 0, 0
        for start, _ in intervals:
            running = sum(1 for s, e in intervals if s <= start < e)
            over = running - self.bound(start)
            if over > 0:
                violations += 1
                overshoot = max(overshoot, over)
        starts = sorted(s for s, _ in intervals)
        waits = sorted(
            records[name]["start"] - at for name, (_, at) in self.spawned.items() if "start" in records.get(name, {})
        )
        # Stalls: waiting loads (spawned, not started, client not exited) and no start anywhere.
        moments: list[tuple[float, int, bool]] = []
        for name, (_, at) in self.spawned.items():
            began = records.get(name, {}).get("start")
            gone = self.exited.get(name, (ended, 0))[0]
            moments.append((at, 1, False))
            moments.append((min(began, gone) if began is not None else gone, -1, began is not None and began <= gone))
        moments.sort()
        waiting, since, stall = 0, started, 0.0
        for at, delta, admitted in moments:
            if waiting > 0 and at - since > stall:  # how long nothing has started while loads wait, up to now
                stall, self.stall_window = at - since, (since, at)
            if admitted or waiting == 0:
                since = at
            waiting += delta
        # A load that ended while its node was down can be released only once the node is back: the second figure
        # counts from then (the drain or crash's downtime left out).
        stranded, stranded_back, stranded_detail = 0.0, 0.0, ""
        for name, last in self.last_held.items():
            rec = records.get(name, {})
            end = min(rec.get("ready", ended), rec.get("end", ended), self.exited.get(name, (ended, 0))[0])
            node = self.spawned[name][0]
            back = max((t for t in self.restarts.get(node, []) if end <= t <= last), default=end)
            stranded_back = max(stranded_back, last - back)
            if last - end > stranded:
                stranded = last - end
                stranded_detail = (f"{name} on {node}: ended {end:.2f}, held until {last:.2f}, "
                                   f"its node back {back - end:.2f} s after the end")  # fmt: skip
        span = max(1e-9, ended - started)
        exits = dict(Counter(str(code) for _, code in self.exited.values()))

        def pct(p: float) -> float:
            return round(waits[min(len(waits) - 1, int(p * len(waits)))], 3) if waits else 0.0

        return {
            "nodes": len(self.names),
            "nodes_at_end": len(self.nodes),
            "violations": violations,
            "worst_overshoot": overshoot,
            "longest_stall_s": round(stall, 3),
            "stranded_slot_s": round(max(0.0, stranded), 3),
            "stranded_after_back_s": round(max(0.0, stranded_back), 3),
            **({"stranded_slot_detail": stranded_detail} if stranded_detail else {}),
            "admissions": len(starts),
            "admissions_per_s": round(len(starts) / span, 3),
            "wait_p50_s": pct(0.5),
            "wait_p99_s": pct(0.99),
            "client_exit_codes": exits,
            "cap_changes": len(self.caps) - 1,
            "seconds": round(span, 1),
        }


def run_churn(nodes: int, seconds: float, seed: int, cap: int, per_node: int) -> dict[str, Any]:
    churn = Churn(nodes, seconds, seed, cap)
    keep = True  # a run that fails or finds violations keeps the nodes' state and logs for a look
    try:
        result = churn.run(per_node)
        keep = bool(result.get("violations"))
    finally:
        if keep:
            sys.stderr.write(f"state and logs kept in {churn.tmp}\n")
        else:  # they are in /dev/shm: memory
            shutil.rmtree(churn.tmp, ignore_errors=True)
    result["seed"] = seed
    sys.stderr.write(
        "\n".join(churn.events) + f"\nlongest stall from {churn.stall_window[0]:.2f} to {churn.stall_window[1]:.2f}\n"
    )
    return result
