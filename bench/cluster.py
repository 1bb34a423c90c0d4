"""Benchmark: nodeguard's cluster semaphore at 20 to 200 nodes on one broker, and a Velero-style best-effort count.

``--churn``: real daemons under churn instead (bench/churn.py). ``--nodes N`` nodes (default 20), each with its own MQTT connection, run as
asyncio tasks in worker processes (5 to 20 nodes each: N interpreters would
crowd two cores; one process for all measures Python's MQTT client, not the
protocol); each node gets 10 simultaneous requests for a cap of 8, for three
rounds; a load holds its slot for 20-80 ms. One seed (the first node) holds the
cap at genesis; every other node joins with nothing. Both schemes run against
one mosquitto started here (``sys_interval 1``) or ``--broker host:port``, one
after the other; the best-effort count only up to ``--best-effort-max`` nodes
(every count goes to every node: at 200 nodes it measures the broker, not the
scheme).

* nodeguard: a CoordinationService per node (state dirs on a tmpfs,
  /dev/shm, as nodeguard's default /run/nodeguard is on most hosts).
* best effort (Velero's node-agent): each node publishes its count (retained)
  and admits one load whenever the sum it sees is below the cap, then waits to
  see its own count come back before admitting the next; bound cap + nodes.

The auditor is a client subscribed to the broker: every load publishes
``hold`` and ``free`` with CLOCK_MONOTONIC timestamps (one clock: one machine),
and the auditor merges them into the largest sum held at any instant.
Handoff: from the release of a slot on one node to the admission, on another
node, of a waiting load through the grant (or the two grants, through the bank)
that slot became. Messages per admission: PUBLISH packets the nodes sent
(heartbeats, ledgers, copies, demands, census; not the audit reports) per
admitted load. Deliveries per admission: PUBLISH packets the broker sent, from
its own counter ``$SYS/broker/publish/messages/sent`` between the start and the
end of the run, less those it sent to the bench's own clients (the auditor and
the $SYS reader count what they receive), per admitted load; the nodes' own
count of what they received is printed beside it as a cross-check. Broker CPU:
user + system time of the mosquitto process (/proc/<pid>/stat) over the same
span, per admission. Prints one JSON line last.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from pathlib import Path
from typing import IO, Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import paho.mqtt.client as paho
from paho.mqtt.enums import CallbackAPIVersion

from bench.common import Broker, stop_cleanly_on_sigterm
from nodeguard.coordination.mqtt_link import Incoming, MqttLink, WillSpec
from nodeguard.coordination.service import CoordinationService
from nodeguard.coordination.settings import BrokerSettings, CoordinationSettings
from nodeguard.log import configure

REQUESTS = 10
CAP = 8
ROUNDS = 3
HOLD = (0.020, 0.080)
SEM = "prepare"
SYS_SENT = "$SYS/broker/publish/messages/sent"


def names(nodes: int) -> list[str]:
    return [f"node{i:03d}" for i in range(nodes)]


def workers_for(nodes: int) -> int:
    """4 workers of 5 nodes at 20; 10 workers of 20 at 200."""
    return max(1, min(10, max(4, nodes // 20), nodes))


# --- the broker and the auditor ---------------------------------------------------------------


class Auditor:
    """Subscribed to ``bench/audit/#``: the loads' own hold/free reports, merged on one clock."""

    def __init__(self, port: int) -> None:
        self.events: list[tuple[float, int, str]] = []
        self.received = 0  # every PUBLISH the broker sent this client (audit reports and $SYS)
        self.sys_sent: tuple[int, int] | None = None  # (the broker's counter, self.received when it arrived)
        self.sys_updates = 0
        self.lock = threading.Lock()
        ready = threading.Event()
        self.client = paho.Client(CallbackAPIVersion.VERSION2, client_id="bench-auditor", protocol=paho.MQTTv5)
        self.client.on_connect = lambda c, *_: (c.subscribe([("bench/audit/#", 1), (SYS_SENT, 0)]), ready.set())
        self.client.on_message = self._on_message
        self.client.connect("127.0.0.1", port)
        self.client.loop_start()
        ready.wait(5)

    def _on_message(self, client: Any, userdata: Any, msg: paho.MQTTMessage) -> None:
        with self.lock:
            self.received += 1
            if msg.topic == SYS_SENT:
                self.sys_sent = (int(msg.payload), self.received)
                self.sys_updates += 1
                return
        e = json.loads(msg.payload)
        with self.lock:
            self.events.append((e["t"], 1 if e["ev"] == "hold" else -1, msg.topic))

    def broker_sent(self, timeout: float = 5.0) -> tuple[int, int]:
        """The broker's next count of PUBLISH packets sent, and how many of them this client had received by then."""
        with self.lock:
            seen = self.sys_updates
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with self.lock:
                if self.sys_updates > seen and self.sys_sent is not None:
                    return self.sys_sent
            time.sleep(0.02)
        raise SystemExit("no $SYS/broker/publish/messages/sent from the broker (sys_interval?)")

    def max_held(self, scheme: str, expected: int, timeout: float = 10.0) -> int:
        deadline = time.monotonic() + timeout
        while True:
            with self.lock:
                events = [(t, d) for t, d, topic in self.events if topic.startswith(f"bench/audit/{scheme}/")]
            if len(events) >= expected or time.monotonic() > deadline:
                break
            time.sleep(0.05)
        if len(events) < expected:
            raise SystemExit(f"the auditor saw {len(events)} of {expected} reports")
        held = peak = 0
        for _, delta in sorted(events):  # at equal times a release comes first
            held += delta
            peak = max(peak, held)
        return peak

    def close(self) -> None:
        self.client.disconnect()  # first: the network loop then ends at once, not at its next 1 s select
        self.client.loop_stop()


class Reporter:
    """A worker's loads report hold/free to the auditor through the broker, from the worker's own event loop."""

    def __init__(self, port: int, worker: int) -> None:
        broker = BrokerSettings(host="127.0.0.1", port=port)
        self.link = MqttLink(broker, f"bench-reporter-{worker}", [], f"bench/reporter-sync/{worker}", self)
        self.connected = asyncio.Event()
        self.pending: set[asyncio.Task[int]] = set()
        self.task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        self.task = asyncio.create_task(self.link.run())
        await self.connected.wait()

    async def before_connect(self) -> WillSpec:
        return WillSpec("bench/reporter-gone", b"", 30, 60)

    def on_connected(self, session_present: bool) -> None:
        self.connected.set()

    def on_disconnected(self, reason: str) -> None:
        self.connected.clear()

    def on_message(self, message: Incoming) -> None:
        pass

    def report(self, scheme: str, event: str, load: str) -> None:
        payload = json.dumps({"ev": event, "load": load, "t": time.monotonic()}).encode()
        task = asyncio.get_running_loop().create_task(self.link.publish(f"bench/audit/{scheme}/{load}", payload))
        self.pending.add(task)
        task.add_done_callback(self.pending.discard)

    async def close(self) -> None:
        await asyncio.gather(*self.pending)
        if self.task is not None:
            self.task.cancel()
            await asyncio.gather(self.task, return_exceptions=True)


def emit(**fields: Any) -> None:
    sys.stdout.write(json.dumps(fields) + "\n")
    sys.stdout.flush()


async def wait_go() -> None:
    await asyncio.get_running_loop().run_in_executor(None, sys.stdin.readline)


# --- nodeguard (in a worker) -------------------------------------------------------------------


async def nodeguard_worker(
    mine: list[str], everyone: list[str], port: int, state: Path, *, reporter: Reporter, rng: random.Random
) -> None:
    def hook(name: str) -> Any:
        def on_event(event: str, fields: dict[str, Any]) -> None:
            if event == "donated" and (fields["freed_at"] is not None or fields["via"] is not None):
                via = list(fields["via"]) if fields["via"] is not None else None
                emit(ev="donated", grant=[name, fields["grant"].id], freed_at=fields["freed_at"], via=via, node=name)
            elif event == "admitted" and fields["via"] is not None:
                emit(ev="admitted", via=list(fields["via"]), t=fields["t"], node=name)

        return on_event

    services = []
    for name in mine:
        settings = CoordinationSettings.model_validate(
            {
                "enabled": True,
                "cluster": "bench",
                "seeds": everyone[:1],
                "semaphores": {SEM: CAP},
                "stateDir": str(state / name),
                "broker": {"host": "127.0.0.1", "port": port},
            }
        )
        services.append(CoordinationService(settings, name, on_event=hook(name)))
    kinds: Counter[str] = Counter()  # what the nodes received during the run, by topic kind
    counting = False
    for service in services:

        def on_message(message: Incoming, original: Any = service.on_message, topics: Any = service.topics) -> None:
            if counting:
                parsed = topics.parse(message.topic)
                kinds[parsed[0] if parsed else "other"] += 1
            original(message)

        service.on_message = on_message  # type: ignore[method-assign]
    tasks = [asyncio.create_task(s.run()) for s in services]
    while not all(s.status()["admitting"] for s in services):
        await asyncio.sleep(0.05)
    emit(ev="ready")
    await wait_go()
    counting = True
    published = sum(s.link.stats.published for s in services)
    received = sum(s.link.stats.received for s in services)

    async def load(service: CoordinationService, load_id: str) -> None:
        await service.acquire(SEM, load_id)
        reporter.report("nodeguard", "hold", load_id)
        await asyncio.sleep(rng.uniform(*HOLD))
        reporter.report("nodeguard", "free", load_id)
        service.release(SEM, load_id)

    async def node_rounds(service: CoordinationService) -> None:
        for r in range(ROUNDS):
            await asyncio.gather(*(load(service, f"{service.name}-{r}-{i}") for i in range(REQUESTS)))

    await asyncio.gather(*(node_rounds(s) for s in services))
    counters: Counter[str] = Counter()
    for service in services:
        counters.update(service.node.counters)
    emit(
        ev="finished",
        published=sum(s.link.stats.published for s in services) - published,
        received=sum(s.link.stats.received for s in services) - received,
        counters=dict(counters),
        kinds=dict(kinds),
    )
    await wait_go()  # everyone's loads are done: now stopping disturbs nobody
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


# --- Velero-style best effort (in a worker) -----------------------------------------------------


class BestEffortNode:
    """Publishes its count; admits one load while the sum it sees is below the cap, then waits to see itself."""

    def __init__(self, name: str, everyone: list[str], port: int, reporter: Reporter) -> None:
        self.name = name
        self.reporter = reporter
        self.counts = dict.fromkeys(everyone, 0)
        self.held = 0
        self.published_count = -1
        self.seen_own = True
        self.waiting: list[asyncio.Future[None]] = []
        broker = BrokerSettings(host="127.0.0.1", port=port)
        self.link = MqttLink(broker, f"be-{name}", ["bench/besteffort/count/+"], f"bench/besteffort/sync/{name}", self)
        self.connected = asyncio.Event()

    async def before_connect(self) -> WillSpec:
        return WillSpec(f"bench/besteffort/gone/{self.name}", b"", 30, 60)

    def on_connected(self, session_present: bool) -> None:
        self.connected.set()

    def on_disconnected(self, reason: str) -> None:
        self.connected.clear()

    def on_message(self, message: Incoming) -> None:
        node = message.topic.rsplit("/", 1)[1]
        self.counts[node] = int(message.payload or b"0")
        if node == self.name and self.counts[node] == self.published_count:
            self.seen_own = True
        self.admit()

    def admit(self) -> None:
        if self.waiting and self.seen_own and sum(self.counts.values()) - self.counts[self.name] + self.held < CAP:
            self.held += 1
            self.waiting.pop(0).set_result(None)
            self.publish()

    def publish(self) -> None:
        self.seen_own = False
        self.published_count = self.held
        asyncio.get_running_loop().create_task(
            self.link.publish(f"bench/besteffort/count/{self.name}", str(self.held).encode(), retain=True)
        )

    async def load(self, load_id: str, rng: random.Random) -> None:
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self.waiting.append(future)
        self.admit()
        await future
        self.reporter.report("besteffort", "hold", load_id)
        await asyncio.sleep(rng.uniform(*HOLD))
        self.reporter.report("besteffort", "free", load_id)
        self.held -= 1
        self.publish()
        self.admit()


async def best_effort_worker(
    mine: list[str], everyone: list[str], port: int, reporter: Reporter, rng: random.Random
) -> None:
    nodes = [BestEffortNode(n, everyone, port, reporter) for n in mine]
    tasks = [asyncio.create_task(n.link.run()) for n in nodes]
    for n in nodes:
        await n.connected.wait()
        n.publish()
    emit(ev="ready")
    await wait_go()
    published = sum(n.link.stats.published for n in nodes)
    received = sum(n.link.stats.received for n in nodes)

    async def node_rounds(node: BestEffortNode) -> None:
        for r in range(ROUNDS):
            await asyncio.gather(*(node.load(f"{node.name}-{r}-{i}", rng) for i in range(REQUESTS)))

    await asyncio.gather(*(node_rounds(n) for n in nodes))
    emit(
        ev="finished",
        published=sum(n.link.stats.published for n in nodes) - published,
        received=sum(n.link.stats.received for n in nodes) - received,
    )
    await wait_go()
    for task in tasks:
        task.cancel()
    await asyncio.gather(*tasks, return_exceptions=True)


def worker(args: argparse.Namespace) -> None:
    configure("error", json=True)
    everyone = names(args.nodes)
    mine = everyone[args.worker :: workers_for(args.nodes)]
    rng = random.Random(args.seed * 100 + args.worker)

    async def run() -> None:
        reporter = Reporter(args.port, args.worker)
        await reporter.start()
        try:
            if args.scheme == "nodeguard":
                await nodeguard_worker(mine, everyone, args.port, Path(args.state), reporter=reporter, rng=rng)
            else:
                await best_effort_worker(mine, everyone, args.port, reporter, rng)
        finally:
            await reporter.close()

    asyncio.run(run())


# --- the parent --------------------------------------------------------------------------------


class WorkerOutput:
    """A worker's stdout read by a thread of its own: a worker must never block writing its events (a full pipe
    would stall its event loop, and its nodes would lose the broker)."""

    def __init__(self, stream: IO[str]) -> None:
        self.events: list[dict[str, Any]] = []
        self.ended = False
        self.cond = threading.Condition()
        threading.Thread(target=self._read, args=(stream,), daemon=True).start()

    def _read(self, stream: IO[str]) -> None:
        for line in stream:
            with self.cond:
                self.events.append(json.loads(line))
                self.cond.notify_all()
        with self.cond:
            self.ended = True
            self.cond.notify_all()

    def wait_for(self, event: str, timeout: float = 900.0) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        with self.cond:
            while True:
                found = [e for e in self.events if e["ev"] == event]
                if found:
                    return found[0]
                if self.ended or time.monotonic() > deadline:
                    raise SystemExit(f"a worker ended (or took too long) before {event!r}")
                self.cond.wait(1.0)


def cpu_seconds(pid: int | None) -> float | None:
    """User + system time of a process (the broker we started), from /proc/<pid>/stat."""
    if pid is None:
        return None
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def handoffs(events: list[dict[str, Any]]) -> list[float]:
    """Milliseconds from a slot freed on one node to its use on another, through one grant or two (the bank)."""
    donated = {tuple(e["grant"]): e for e in events if e["ev"] == "donated"}
    out = []
    for e in events:
        if e["ev"] != "admitted":
            continue
        grant = donated.get(tuple(e["via"]))
        for _ in range(2):
            if grant is None or grant["freed_at"] is not None:
                break
            grant = donated.get(tuple(grant["via"])) if grant["via"] else None
        if grant is not None and grant["freed_at"] is not None and grant["node"] != e["node"]:
            out.append((e["t"] - grant["freed_at"]) * 1000)
    return out


def run_scheme(
    scheme: str, nodes: int, port: int, state: Path, *, seed: int, auditor: Auditor, broker_pid: int | None
) -> dict[str, Any]:
    procs = [
        subprocess.Popen(
            [
                sys.executable,
                __file__,
                "--worker",
                str(w),
                "--scheme",
                scheme,
                "--port",
                str(port),
                "--state",
                str(state),
                "--seed",
                str(seed),
                "--nodes",
                str(nodes),
            ],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        for w in range(workers_for(nodes))
    ]
    outputs = []
    for proc in procs:
        assert proc.stdout is not None
        outputs.append(WorkerOutput(proc.stdout))
    try:
        for output in outputs:
            output.wait_for("ready")
        time.sleep(1.0)  # the census and every node's first messages are out
        sent_before, own_before = auditor.broker_sent()
        cpu_before = cpu_seconds(broker_pid)
        started = time.monotonic()
        for proc in procs:
            assert proc.stdin is not None
            proc.stdin.write("go\n")
            proc.stdin.flush()
        published = received = 0
        counters: Counter[str] = Counter()
        for output in outputs:
            finished = output.wait_for("finished")
            published += finished["published"]
            received += finished["received"]
            counters.update(finished.get("counters", {}))
            counters.update({f"received.{k}": v for k, v in finished.get("kinds", {}).items()})
        elapsed = time.monotonic() - started
        cpu_after = cpu_seconds(broker_pid)
        sent_after, own_after = auditor.broker_sent()  # the first count taken after the end
        for proc in procs:
            assert proc.stdin is not None
            proc.stdin.write("go\n")
            proc.stdin.close()
        for proc in procs:
            proc.wait(60)
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
    events = [e for output in outputs for e in output.events]
    admissions = nodes * REQUESTS * ROUNDS
    broker_cpu = None if cpu_before is None or cpu_after is None else cpu_after - cpu_before
    return {
        "handoffs": handoffs(events) if scheme == "nodeguard" else [],
        "messages_per_admission": published / admissions,
        "deliveries_per_admission": ((sent_after - sent_before) - (own_after - own_before)) / admissions,
        "received_per_admission": received / admissions,
        "broker_cpu_per_admission": None if broker_cpu is None else broker_cpu / admissions,
        "seconds": elapsed,
        "counters": dict(counters),
    }


def percentile(values: list[float], p: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(p / 100 * (len(ordered) - 1)))]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--nodes", type=int, default=20, help="nodes in the cluster (default 20; up to 200)")
    parser.add_argument("--broker", help="port on 127.0.0.1 of a running broker (default: start mosquitto here)")
    parser.add_argument(
        "--state-dir",
        default="/dev/shm" if os.access("/dev/shm", os.W_OK) else None,
        help="where the nodes' state dirs go (default: /dev/shm, a tmpfs as /run is on most hosts; else the temp dir)",
    )
    parser.add_argument("--best-effort-max", type=int, default=20, help="run the best-effort count up to this size")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--churn", action="store_true", help="the churn benchmark on real daemons (bench/churn.py)")
    parser.add_argument("--seconds", type=float, default=60.0, help="--churn: how long the churn goes on")
    parser.add_argument("--cap", type=int, default=3, help="--churn: the cap at the start")
    parser.add_argument("--per-node", type=int, default=2, help="--churn: clients each live node keeps outstanding")
    parser.add_argument("--worker", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--scheme", help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--state", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker is not None:
        if os.environ.get("BENCH_PROFILE"):  # a worker's profile, to find where the time goes
            import cProfile

            cProfile.runctx("worker(args)", globals(), {"args": args}, f"{os.environ['BENCH_PROFILE']}.{args.worker}")
        else:
            worker(args)
        return
    if not 2 <= args.nodes <= 1000:
        raise SystemExit("--nodes: between 2 and 1000")
    if args.churn:
        from bench.churn import run_churn  # here: the workers this module starts by the hundred need none of it

        print(json.dumps(run_churn(args.nodes, args.seconds, args.seed, args.cap, args.per_node)))
        return
    nodes = args.nodes
    workdir = Path(tempfile.mkdtemp(prefix="nodeguard-bench-", dir=args.state_dir))
    broker = None
    try:
        if args.broker:
            port = int(args.broker.rsplit(":", 1)[-1])
        else:
            broker = Broker(workdir, sys_interval=1).start()  # $SYS counts what the broker sent, every second
            port = broker.port
        pid = broker.proc.pid if broker is not None and broker.proc is not None else None
        auditor = Auditor(port)
        admissions = nodes * REQUESTS * ROUNDS
        nodeguard = run_scheme("nodeguard", nodes, port, workdir, seed=args.seed, auditor=auditor, broker_pid=pid)
        print("protocol counters:", json.dumps(dict(sorted(nodeguard["counters"].items()))), flush=True)
        nodeguard["max_held"] = auditor.max_held("nodeguard", 2 * admissions)
        best = None
        if nodes <= args.best_effort_max:
            best = run_scheme("besteffort", nodes, port, workdir, seed=args.seed, auditor=auditor, broker_pid=pid)
            best["max_held"] = auditor.max_held("besteffort", 2 * admissions)
        auditor.close()
    finally:
        if broker is not None:
            broker.stop()
        shutil.rmtree(workdir, ignore_errors=True)
    handoff = nodeguard["handoffs"]
    workers = workers_for(nodes)
    cpu = nodeguard["broker_cpu_per_admission"]
    print(
        f"nodeguard:   max held {nodeguard['max_held']} (cap {CAP}), {admissions} admissions in "
        f"{nodeguard['seconds']:.2f} s, {len(handoff)} handoffs between nodes, "
        f"{nodeguard['messages_per_admission']:.2f} messages and {nodeguard['deliveries_per_admission']:.2f} "
        f"deliveries per admission (the nodes counted {nodeguard['received_per_admission']:.2f} received)"
        + ("" if cpu is None else f", broker CPU {cpu * 1000:.3f} ms per admission")
    )
    if best is not None:
        print(
            f"best effort: max held {best['max_held']} (bound cap + nodes = {CAP + nodes}), {admissions} admissions in "
            f"{best['seconds']:.2f} s, {best['messages_per_admission']:.2f} messages and "
            f"{best['deliveries_per_admission']:.2f} deliveries per admission"
        )
    print(
        f"({nodes} nodes in {workers} processes of about {nodes // workers} asyncio nodes, each its own MQTT "
        f"connection; {os.cpu_count()} CPUs)"
    )
    result = {
        "nodes": nodes,
        "cap": CAP,
        "nodeguard_max_held": nodeguard["max_held"],
        "best_effort_max_held": None if best is None else best["max_held"],
        "handoff_p50_ms": round(statistics.median(handoff), 2) if handoff else None,
        "handoff_p99_ms": round(percentile(handoff, 99), 2) if handoff else None,
        "messages_per_admission": round(nodeguard["messages_per_admission"], 2),
        "deliveries_per_admission": round(nodeguard["deliveries_per_admission"], 2),
        "broker_cpu_seconds_per_admission": None if cpu is None else round(cpu, 6),
    }
    print(json.dumps(result))


if __name__ == "__main__":
    stop_cleanly_on_sigterm()
    main()
