"""Benchmark: nodeguard's start-up and its commands' cost, against a bare interpreter started in the same run.

Every process is started the way it runs in production, and measured whole,
from exec to exit (or to the event named), against ``python -c pass`` on the
same interpreter with the same environment, measured in the same rounds (the
commands alternate with it, so load on the machine falls on both alike; the
medians are compared). Bytecode is compiled once beforehand into a cache of
this run's own (``PYTHONPYCACHEPREFIX``; ``PYTHONDONTWRITEBYTECODE`` is
dropped), as an installed package has it. The command is what pip's
``nodeguard`` console script runs (the entry point in pyproject.toml), as the
OCI hook and init containers run it, on this tree (its directory is the
children's working directory and first on their PYTHONPATH).

- ``cli_help_ms``: ``nodeguard --help``.
- ``gate_client_ms``: ``nodeguard admit --name N`` against a running gate with a
  free slot (no readiness check: admitted and ready at once; released after,
  untimed).
- ``hook_create_ms`` p50/p99: ``nodeguard oci-hook`` with the OCI state of a
  ``creating`` container on stdin (createRuntime), against the same gate;
  ``hook_poststop_ms`` the same at poststop (it releases the load).
- ``exec_to_first_tick_ms``: ``nodeguard run --dry-run`` with
  packaging/examples/kubernetes.json (its cgroupRoot, socket, ledger and HTTP
  port pointed at this host and this run; gate and HTTP on as in the example;
  its Kubernetes integration off, as no API server runs here)
  on a kubelet-shaped tree (tests/support/node.py: pods under
  ``<parent>/kubepods/burstable`` and a Guaranteed pod, limits at pod and
  container, in this host's v1 cpu hierarchy or the v2 mount), from exec to
  its READY=1 on $NOTIFY_SOCKET, which the daemon sends after its first good
  tick. ``first_tick_cpu_ms`` is the CPU it used until then (/proc/PID/stat).
- ``daemon_rss_mb``: the daemon's VmRSS after ``--ticks`` ticks (counted by its
  WATCHDOG=1 notifications) with every optional feature off (gate, HTTP,
  coordination, Kubernetes) and with all on: gate, HTTP, coordination with a
  real mosquitto on a free loopback port. The Kubernetes integration stays off
  in both: it needs an API server. Against a bare interpreter's VmRSS.
  ``daemon_anon_mb`` (RssAnon) and ``daemon_pss_mb`` (Pss) of the same
  processes say what of it is the daemon's own: VmRSS counts every page of the
  shared libraries it touched (libpython, OpenSSL, pydantic-core) whole.

Each figure has ``<name>_ratio`` to the bare interpreter's (time, or RSS).
Targets (issue 22): hook and admit within 3x, first tick within 5x, RSS with
features off under 35 MB.

``--cpu-limit 0.25`` also runs the daemon, with the gate, in a scratch cgroup
with a CFS quota of that many cores (v1 ``cpu.cfs_quota_us``/``cfs_period_us``
25000/100000, v2 ``cpu.max``), as a DaemonSet's CPU limit does, and the same
without the limit in the same run: exec to first tick; a storm of
``--burst`` gate requests at once (one connection each, from this process,
outside the cgroup: submit and wait until admitted); and a reload (SIGHUP to
the "config reloaded" log line), with the cgroup's throttled periods.

Needs root (cgroups) for the kubelet tree and ``--cpu-limit``; run it alone on
the node (it starts dry-run daemons, which act on nothing). The last line is
one JSON object.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import tomllib
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from nodeguard.gate.wire import BlockingGateClient  # noqa: E402
from nodeguard.model.samples import CpuMax  # noqa: E402
from nodeguard.scratch_cgroups import plan_cgroups, remove_cgroup_dir  # noqa: E402

EXAMPLE = REPO / "packaging" / "examples" / "kubernetes.json"
HZ = os.sysconf("SC_CLK_TCK")
STOP_READING = b"BENCH-STOP"  # to the notify socket: its reader ends


def percentile(samples: list[float], fraction: float) -> float:
    """Nearest rank: of 100 samples the p99 is the second slowest."""
    ordered = sorted(samples)
    return ordered[max(0, math.ceil(fraction * len(ordered)) - 1)]


def load() -> str:
    return " ".join(Path("/proc/loadavg").read_text().split()[:3])


class Run:
    """This run's scratch directory, children's environment and command."""

    def __init__(self, work: Path) -> None:
        self.work = work
        env = {k: v for k, v in os.environ.items() if k not in ("PYTHONDONTWRITEBYTECODE", "NOTIFY_SOCKET")}
        env["PYTHONPYCACHEPREFIX"] = str(work / "pycache")
        env["PYTHONPATH"] = os.pathsep.join([str(REPO), *filter(None, [os.environ.get("PYTHONPATH")])])
        self.env = env
        # What pip's console script for pyproject.toml's entry point does (an installed one may be of another tree).
        target = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["scripts"]["nodeguard"]
        module, _, function = target.partition(":")
        script = f"import re\nimport sys\nfrom {module} import {function}\nsys.exit({function}())"
        self.nodeguard, self.entry = [sys.executable, "-c", script], f"console script ({target})"
        self.bare = [sys.executable, "-c", "pass"]
        self._names = 0

    def name(self, prefix: str) -> str:
        self._names += 1
        return f"{prefix}-{os.getpid()}-{self._names}"

    def timed(self, cmd: list[str], stdin: bytes = b"", expect: int = 0) -> float:
        """Milliseconds from exec to exit."""
        started = time.perf_counter()
        result = subprocess.run(
            cmd, input=stdin, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=self.env, cwd=REPO
        )
        took = (time.perf_counter() - started) * 1000
        if result.returncode != expect:
            raise SystemExit(f"{' '.join(cmd)} exited {result.returncode}: {result.stderr.decode()[-2000:]}")
        return took


# --- the daemon -----------------------------------------------------------------------


def example_config(run: Run, node: Any, tag: str, tick: float | None = None) -> dict[str, Any]:
    """The example kubernetes config, pointed at this host's tree (the kubelet-shaped node) and this run's files."""
    config: dict[str, Any] = json.loads(EXAMPLE.read_text())
    config.pop("$schema", None)
    g = config["global"]
    g["sensing"]["cgroupRoot"] = "/sys/fs/cgroup"
    if node is not None:
        g["sensing"].update(node.sensing)
        g["sensing"]["cgroupVersion"] = node.hierarchy.version
    if tick is not None:
        g["sensing"]["tickSeconds"] = tick
    state = run.work / tag
    state.mkdir(exist_ok=True)
    g["actuation"] = {"ledgerPath": str(state / "ledger.json")}
    g["gate"] = {"socket": str(state / "gate.sock")}
    g["http"] = {"listen": "127.0.0.1:0"}
    g["kubernetes"] = {"enabled": False}  # no API server here
    return config


class Daemon:
    """``nodeguard run --dry-run``, its notifications on a datagram socket of ours, its log in a file."""

    def __init__(self, run: Run, config: dict[str, Any], tag: str, cgroup: list[Path] | None = None) -> None:
        self.dir = run.work / tag
        self.dir.mkdir(exist_ok=True)
        self.config_path = self.dir / "config.json"
        self.config_path.write_text(json.dumps(config))
        self.notify = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.notify.bind(str(self.dir / f"notify-{time.monotonic_ns()}"))
        env = {**run.env, "NOTIFY_SOCKET": self.notify.getsockname(), "WATCHDOG_USEC": str(3600 * 10**6)}
        self.log_path = self.dir / f"daemon-{time.monotonic_ns()}.log"
        cmd = [*run.nodeguard, "run", "--node-name", "bench-node", "--dry-run", "--config", str(self.config_path)]
        if cgroup is not None:
            # A shell moves itself into the cgroup, then execs the daemon: its whole start-up runs in there
            # (given an empty list, the same shell and exec, for a like-for-like comparison).
            moves = "".join(f'echo $$ > "{d}/cgroup.procs" && ' for d in cgroup)
            cmd = ["/bin/sh", "-c", moves + 'exec "$@"', "sh", *cmd]
        self.ticks: list[float] = []  # when each good tick was reported (READY=1, then WATCHDOG=1 each tick)
        self.reported = threading.Condition()
        with self.log_path.open("wb") as log:
            self.started = time.perf_counter()
            self.proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=log, cwd=REPO)
        # Read every notification as it comes: the daemon drops them when the queue is full, and the ticks count.
        self.reader = threading.Thread(target=self._read, daemon=True)
        self.reader.start()

    def _read(self) -> None:
        with contextlib.suppress(OSError):
            while True:
                data = self.notify.recv(4096)
                if data == STOP_READING:
                    return
                lines = data.split(b"\n")
                now = time.perf_counter()
                with self.reported:
                    if b"READY=1" in lines or (self.ticks and b"WATCHDOG=1" in lines):
                        self.ticks.append(now)
                        self.reported.notify_all()

    def wait_ticks(self, ticks: int, timeout: float = 120.0) -> float:
        """Milliseconds from exec until the daemon reported its ``ticks``-th good tick."""
        with self.reported:
            if not self.reported.wait_for(lambda: len(self.ticks) >= ticks, timeout):
                raise SystemExit(f"no tick {len(self.ticks) + 1} in {timeout}s; log:\n{self.log_tail()}")
            return (self.ticks[ticks - 1] - self.started) * 1000

    def cpu_ms(self) -> float:
        fields = Path(f"/proc/{self.proc.pid}/stat").read_text().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) * 1000 / HZ

    def log_tail(self) -> str:
        return self.log_path.read_text(errors="replace")[-3000:]

    def events(self) -> list[dict[str, Any]]:
        found = []
        for line in self.log_path.read_text(errors="replace").splitlines():
            with contextlib.suppress(ValueError):
                found.append(json.loads(line))
        return found

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as waker:
            waker.sendto(STOP_READING, self.notify.getsockname())
        self.reader.join(5)
        self.notify.close()


def status_mb(pid: int, key: str) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) / 1024
    raise KeyError(key)


@contextlib.contextmanager
def running(run: Run, config: dict[str, Any], tag: str, cgroup: list[Path] | None = None) -> Iterator[Daemon]:
    daemon = Daemon(run, config, tag, cgroup)
    try:
        yield daemon
    finally:
        daemon.stop()


def gate_config(run: Run, tag: str) -> dict[str, Any]:
    """A daemon for the clients: the gate with room for every start (a free slot each time), nothing else."""
    state = run.work / tag
    state.mkdir(exist_ok=True)
    return {
        "global": {
            "sensing": {"kubepods": False},
            "actuation": {"ledgerPath": str(state / "ledger.json")},
            "gate": {"socket": str(state / "gate.sock"), "maxStarting": 10_000, "maxStartingPerCore": None,
                     "maxLoadAverageMultiplier": None, "maxCPU": None, "minRate": 0, "maxRate": None,
                     "maxLoads": 100_000, "maxConnections": 4096},
            "http": {"enabled": False},
        }
    }  # fmt: skip


def wait_for_socket(path: str, daemon: Daemon, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while True:
        try:
            client = BlockingGateClient.connect(path)
        except Exception:
            if time.monotonic() > deadline or daemon.proc.poll() is not None:
                raise SystemExit(f"the gate did not serve {path}; log:\n{daemon.log_tail()}") from None
            time.sleep(0.05)
            continue
        client.request("ping")
        client.close()
        return


def release(path: str, name: str) -> None:
    client = BlockingGateClient.connect(path, 5.0)
    try:
        client.request("release", name=name)
    finally:
        client.close()


# --- the measurements ------------------------------------------------------------------


def commands(run: Run, rounds: int) -> dict[str, Any]:
    """The bare interpreter, --help, admit and the hook, alternating, ``rounds`` times each."""
    tag = "gate"
    config = gate_config(run, tag)
    sock = config["global"]["gate"]["socket"]
    samples: dict[str, list[float]] = {k: [] for k in ("bare", "help", "admit", "create", "poststop")}
    with running(run, config, tag) as daemon:
        wait_for_socket(sock, daemon)
        gate = ["--socket", sock]

        def admit() -> float:
            name = run.name("admit")
            took = run.timed([*run.nodeguard, "admit", "--name", name, *gate])
            release(sock, name)
            return took

        def hook(status: str, name: str) -> float:
            state = {"ociVersion": "1.0.2", "id": name.replace("-", "") * 2, "pid": os.getpid(), "bundle": "/b",
                     "status": status, "annotations": {"nodeguard.io/gate": "true", "nodeguard.io/name": name}}  # fmt: skip
            return run.timed([*run.nodeguard, "oci-hook", *gate], json.dumps(state).encode())

        steps: dict[str, Callable[[], float]] = {
            "bare": lambda: run.timed(run.bare),
            "help": lambda: run.timed([*run.nodeguard, "--help"]),
            "admit": admit,
        }
        for step in steps.values():  # compile and cache bytecode, warm the page cache
            step()
        for _ in range(rounds):
            for key, step in steps.items():
                samples[key].append(step())
            name = run.name("oci")
            samples["create"].append(hook("creating", name))
            samples["poststop"].append(hook("stopped", name))
    bare = statistics.median(samples["bare"])

    def figure(key: str) -> float:
        return round(statistics.median(samples[key]), 1)

    create = {"p50": round(percentile(samples["create"], 0.5), 1), "p99": round(percentile(samples["create"], 0.99), 1)}
    return {
        "bare_ms": round(bare, 1),
        "cli_help_ms": figure("help"),
        "cli_help_ms_ratio": round(statistics.median(samples["help"]) / bare, 2),
        "gate_client_ms": figure("admit"),
        "gate_client_ms_ratio": round(statistics.median(samples["admit"]) / bare, 2),
        "hook_create_ms": create,
        "hook_create_ms_ratio": {k: round(v / bare, 2) for k, v in create.items()},
        "hook_poststop_ms": figure("poststop"),
        "hook_poststop_ms_ratio": round(statistics.median(samples["poststop"]) / bare, 2),
    }


def first_ticks(run: Run, node: Any, runs: int, bare_ms: float) -> dict[str, Any]:
    elapsed, cpu = [], []
    for i in range(runs + 1):  # the first one compiles and caches bytecode
        with running(run, example_config(run, node, f"first-{i}"), f"first-{i}") as daemon:
            took = daemon.wait_ticks(1)
            used = daemon.cpu_ms()
        if i:
            elapsed.append(took)
            cpu.append(used)
    first = statistics.median(elapsed)
    return {
        "exec_to_first_tick_ms": round(first, 1),
        "exec_to_first_tick_ms_ratio": round(first / bare_ms, 2),
        "exec_to_first_tick_ms_range": [round(min(elapsed), 1), round(max(elapsed), 1)],
        "first_tick_cpu_ms": round(statistics.median(cpu), 1),
    }


def split_mb(pid: int) -> dict[str, float]:
    """VmRSS, and what of it is the process's own (RssAnon) and its share of shared pages too (Pss)."""
    rollup = Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines()
    pss = next(int(line.split()[1]) for line in rollup if line.startswith("Pss:")) / 1024
    return {"rss": status_mb(pid, "VmRSS"), "anon": status_mb(pid, "RssAnon"), "pss": pss}


def bare_split_mb(run: Run) -> dict[str, float]:
    """A bare interpreter's split_mb (medians of three)."""
    values = []
    for _ in range(3):
        proc = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE,
                                env=run.env, cwd=REPO)  # fmt: skip
        time.sleep(0.5)
        values.append(split_mb(proc.pid))
        assert proc.stdin is not None
        proc.stdin.close()
        proc.wait()
    return {key: statistics.median(v[key] for v in values) for key in values[0]}


def rss(run: Run, node: Any, ticks: int, tick: float, bare: dict[str, float]) -> dict[str, Any]:
    off = example_config(run, node, "rss-off", tick)
    off["global"].update({"gate": {"enabled": False}, "http": {"enabled": False}})
    on = example_config(run, node, "rss-on", tick)
    found: dict[str, dict[str, float]] = {}
    with running(run, off, "rss-off") as daemon:
        daemon.wait_ticks(ticks)
        found["off"] = split_mb(daemon.proc.pid)
    from bench.common import Broker

    broker = Broker(run.work).start()
    port = broker.port
    try:
        on["global"]["coordination"] = {
            "enabled": True, "cluster": "bench", "seeds": ["bench-node"], "semaphores": {"prepare": 8},
            "stateDir": str(run.work / "rss-on"), "broker": {"host": "127.0.0.1", "port": port},
        }  # fmt: skip
        with running(run, on, "rss-on") as daemon:
            daemon.wait_ticks(ticks)
            found["on"] = split_mb(daemon.proc.pid)
            coordinated = any(e.get("event") == "connected to the MQTT broker" for e in daemon.events())
    finally:
        broker.stop()
    return {
        "bare_rss_mb": round(bare["rss"], 1),
        "daemon_rss_mb": {k: round(v["rss"], 1) for k, v in found.items()},
        "daemon_rss_mb_ratio": {k: round(v["rss"] / bare["rss"], 2) for k, v in found.items()},
        # VmRSS counts the shared libraries' pages whole; these say what the daemon itself costs the node.
        "bare_anon_mb": round(bare["anon"], 1),
        "daemon_anon_mb": {k: round(v["anon"], 1) for k, v in found.items()},
        "bare_pss_mb": round(bare["pss"], 1),
        "daemon_pss_mb": {k: round(v["pss"], 1) for k, v in found.items()},
        "rss_after_ticks": ticks,
        "rss_features": {
            "off": "gate, HTTP, coordination, Kubernetes off",
            "on": "gate, HTTP, coordination (mosquitto) on; Kubernetes off (needs an API server)",
            "on_broker_connected": coordinated,
        },
    }


# --- under a CPU limit ---------------------------------------------------------------------


@contextlib.contextmanager
def limited_cgroup(cores: float) -> Iterator[tuple[list[Path], Path]]:
    """A scratch cgroup with a CFS quota of ``cores`` (period 100 ms): its directories, and the one with cpu.stat."""
    groups = plan_cgroups(["daemon"], "nodeguard-bench-startup")
    if isinstance(groups, str):
        raise SystemExit(f"--cpu-limit: {groups}")
    dirs = groups.dirs["daemon"]
    parents = sorted({d.parent for d in dirs})
    limit = CpuMax(int(cores * 100_000), 100_000)
    try:
        for parent in parents:
            parent.mkdir()
            if groups.version == "v2":
                (parent / "cgroup.subtree_control").write_text("+cpu")
        for directory in dirs:
            directory.mkdir()
        cpu = dirs[0]  # v1: the cpu hierarchy first
        if groups.version == "v2":
            (cpu / "cpu.max").write_text(limit.render_v2())
        else:
            (cpu / "cpu.cfs_period_us").write_text(str(limit.period_us))
            (cpu / "cpu.cfs_quota_us").write_text(str(limit.quota_us))
        yield dirs, cpu
    finally:
        for directory in dirs:
            remove_cgroup_dir(directory)
        for parent in parents:
            remove_cgroup_dir(parent)


def throttled(cpu: Path | None) -> tuple[int, float]:
    """(throttled periods, throttled ms) of the cgroup so far."""
    if cpu is None:
        return 0, 0.0
    stat = dict(line.split() for line in (cpu / "cpu.stat").read_text().splitlines())
    if "throttled_usec" in stat:
        return int(stat["nr_throttled"]), int(stat["throttled_usec"]) / 1000
    return int(stat["nr_throttled"]), int(stat["throttled_time"]) / 1e6


def storm(sock: str, count: int) -> float:
    """``count`` submits at once, one connection each, each waiting until admitted: ms until the last is."""
    names = [f"storm-{os.getpid()}-{time.monotonic_ns()}-{i}" for i in range(count)]
    clients = [BlockingGateClient.connect(sock, 5.0) for _ in names]
    barrier = threading.Barrier(count + 1)
    done: list[float] = []
    errors: list[str] = []

    def one(client: BlockingGateClient, name: str) -> None:
        barrier.wait()
        try:
            load = client.request("submit", name=name, detach=True)["load"]
            if load["state"] not in ("starting", "ready"):
                load = client.request("wait", name=name, until="starting")["load"]
            done.append(time.perf_counter())
        except Exception as exc:
            errors.append(repr(exc))

    threads = [threading.Thread(target=one, args=(c, n)) for c, n in zip(clients, names, strict=True)]
    for thread in threads:
        thread.start()
    barrier.wait()
    started = time.perf_counter()
    for thread in threads:
        thread.join()
    for client in clients:
        client.close()
    if errors:
        raise SystemExit(f"storm: {errors[:3]}")
    for name in names:
        release(sock, name)
    return (max(done) - started) * 1000


def reload_ms(daemon: Daemon, timeout: float = 60.0) -> float:
    """SIGHUP -> the daemon's "config reloaded" log line."""
    before = sum(1 for e in daemon.events() if e.get("event") == "config reloaded")
    started = time.perf_counter()
    daemon.proc.send_signal(signal.SIGHUP)
    deadline = time.monotonic() + timeout
    while sum(1 for e in daemon.events() if e.get("event") == "config reloaded") <= before:
        if time.monotonic() > deadline:
            raise SystemExit(f"no reload in {timeout}s; log:\n{daemon.log_tail()}")
        time.sleep(0.005)
    return (time.perf_counter() - started) * 1000


def cpu_limited(run: Run, node: Any, cores: float, runs: int, burst: int) -> dict[str, Any]:
    """Start-up, a storm of gate requests and a reload, with and without the quota, alternating."""
    results: dict[str, dict[str, list[float]]] = {
        kind: {"first_tick_ms": [], "first_tick_cpu_ms": [], "storm_ms": [], "reload_ms": [], "throttled_periods": [],
               "throttled_ms": []}
        for kind in ("limited", "unlimited")
    }  # fmt: skip
    with limited_cgroup(cores) as (dirs, cpu):
        for i in range(runs + 1):  # the first pair warms the bytecode cache and the page cache
            for kind in ("limited", "unlimited"):
                tag = f"limit-{kind}-{i}"
                config = example_config(run, node, tag)
                sock = config["global"]["gate"]["socket"]
                stat = cpu if kind == "limited" else None
                before = throttled(stat)
                with running(run, config, tag, dirs if kind == "limited" else []) as daemon:
                    first = daemon.wait_ticks(1)
                    used = daemon.cpu_ms()
                    wait_for_socket(sock, daemon)
                    stormed = storm(sock, burst)
                    reloaded = reload_ms(daemon)
                after = throttled(stat)
                if i:
                    figures = results[kind]
                    figures["first_tick_ms"].append(first)
                    figures["first_tick_cpu_ms"].append(used)
                    figures["storm_ms"].append(stormed)
                    figures["reload_ms"].append(reloaded)
                    figures["throttled_periods"].append(after[0] - before[0])
                    figures["throttled_ms"].append(after[1] - before[1])
    summary: dict[str, Any] = {"cores": cores, "period_ms": 100, "runs": runs, "burst_requests": burst}
    for kind, figures in results.items():
        summary[kind] = {key: round(statistics.median(values), 1) for key, values in figures.items()}
        summary[kind]["first_tick_ms_range"] = [round(min(figures["first_tick_ms"]), 1),
                                                round(max(figures["first_tick_ms"]), 1)]  # fmt: skip
    for key in ("first_tick_ms", "storm_ms", "reload_ms"):
        summary[f"{key}_slowdown"] = round(summary["limited"][key] / summary["unlimited"][key], 2)
    return summary


# --- main ----------------------------------------------------------------------------------


@contextlib.contextmanager
def kubelet_tree(pods: int) -> Iterator[Any]:
    """A kubelet-shaped tree in this host's cgroups (tests/support/node.py), or None (and why) without root."""
    from bench.common import kubelet_node, rc

    if rc.why_no_v1_cpu() is None:
        cpu, cpuacct = rc.v1_hierarchy("cpu"), rc.v1_hierarchy("cpuacct")
        assert cpu is not None and cpuacct is not None
        hierarchy = rc.Hierarchy("v1", [cpu] if cpu == cpuacct else [cpu, cpuacct])
    elif rc.why_no_v2() is None and "cpu" in (rc.CGROUP_ROOT / "cgroup.controllers").read_text().split():
        hierarchy = rc.v2_cpu_hierarchy()
    else:
        yield None
        return
    with kubelet_node(hierarchy, CpuMax(150_000, 100_000), CpuMax(50_000, 100_000), burners=pods) as node:
        yield node


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=100, help="rounds of the commands (bare, --help, admit, hook)")
    parser.add_argument("--daemon-runs", type=int, default=5, help="daemon starts measured")
    parser.add_argument("--ticks", type=int, default=60, help="ticks before the daemon's RSS is read")
    parser.add_argument("--tick-seconds", type=float, default=0.1, help="tickSeconds of the RSS daemons")
    parser.add_argument(
        "--pods", type=int, default=20, help="Burstable pods of the kubelet-shaped tree (+1 Guaranteed)"
    )
    parser.add_argument("--cpu-limit", type=float, metavar="CORES",
                        help="also start the daemon and burst under a CFS quota of CORES (e.g. 0.25)")  # fmt: skip
    parser.add_argument("--burst", type=int, default=200, help="gate requests at once, with --cpu-limit")
    args = parser.parse_args()

    work = Path(tempfile.mkdtemp(prefix="nodeguard-bench-startup-"))
    result: dict[str, Any] = {"load_before": load()}
    try:
        run = Run(work)
        result.update(entry=run.entry, runs=args.runs, daemon_runs=args.daemon_runs)
        result.update(commands(run, args.runs))
        print(f"commands: {json.dumps(result)}  load={load()}", flush=True)
        with kubelet_tree(args.pods) as node:
            result["tree"] = (
                f"kubelet-shaped, cgroup {node.hierarchy.version}: {args.pods} Burstable pods and a Guaranteed one"
                if node is not None else "this host's own cgroups (no root: no kubelet-shaped tree)"
            )  # fmt: skip
            result.update(first_ticks(run, node, args.daemon_runs, result["bare_ms"]))
            print(f"first tick: {json.dumps(result)}  load={load()}", flush=True)
            result.update(rss(run, node, args.ticks, args.tick_seconds, bare_split_mb(run)))
            if args.cpu_limit:
                result["cpu_limit"] = cpu_limited(run, node, args.cpu_limit, args.daemon_runs, args.burst)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    result["targets"] = {
        "hook_create_within_3x": result["hook_create_ms_ratio"]["p50"] <= 3,
        "gate_client_within_3x": result["gate_client_ms_ratio"] <= 3,
        "first_tick_within_5x": result["exec_to_first_tick_ms_ratio"] <= 5,
        "rss_off_under_35mb": result["daemon_rss_mb"]["off"] < 35,
    }
    result["load_after"] = load()
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    from bench.common import stop_cleanly_on_sigterm

    stop_cleanly_on_sigterm()
    raise SystemExit(main())
