"""Benchmark: does a strategy protect the important workload's own service level without wasting the node?

Runs on this host's cgroup v1 (cpu and cpuacct hierarchies), or with ``--vm``
inside the QEMU VM on a pure cgroup v2 kernel (tests/kernel/vm.py: 2 vCPUs, the
host's .venv, Python 15-25x slower under emulation; ``--seconds``, ``--warmup``,
``--scenario``, ``--strategy`` and ``--fixed-work`` pass through). Pods are laid
out and weighted as kubelet does under a unique parent: one Guaranteed pod (limit
0.5 core at the pod and its container, ``cpu.shares`` 512) runs the probe of
tests/support/workloads.py (a 4 ms unit of work released every 10 ms; its lateness,
finish - release, per unit is its service level) beside six burners that each
want a whole core and have no CPU limit:

- kubelet_weights: 3 BestEffort pods (pod and tier ``cpu.shares`` 2) and 3
  Burstable pods requesting 0.1 core (pod shares 102, tier = sum of requests);
- equal_weights: 6 Burstable pods requesting what the protected pod does
  (pod shares 512, tier = sum of requests).

Strategies, each on fresh cgroups, measured after a warm-up:

- none: nothing acts;
- node_waterline: the real daemon holding node CPU (cpu_total_utilization) at 70 %;
- tier_suppress: koordlet's BE suppression: every 0.5 s one quota on each
  candidate tier (kubepods/besteffort, kubepods/burstable) so that the tiers
  together get node x 70 % - the protected pod's usage;
- protect: the real daemon with a ``protected_cpu_stall`` objective (skipped,
  with the reason, where this daemon's check-config refuses it);
- hold: protect with ``weightHoldSeconds`` 4, far shorter than the run: the
  burners never stop, so ``restores_under_contention`` (weights the daemon put
  back while they ran) must be 0;
- static_lever: the lever protect pulls (the batch tiers' weight at the least
  kubelet can still write over: v1 ``cpu.shares`` 2, v2 ``cpu.weight`` 1) held
  with no daemon running.

The daemons tick at ``--tick`` seconds, by default the daemon's own default (1 s).

Per scenario, ``daemon_tail_ratio`` is protect's p99 over static_lever's: what
the running daemon and its loop add to the tail beyond the lever itself
(target <= 1.2). Both are measured ``--tail-pairs`` times (default 2),
interleaved (protect, hold, static_lever, then protect, static_lever again), and
each side's windows are pooled before its p99 is taken: one 20 s window's p99 is
its 20th-latest unit, and the static lever alone read 0.88-1.40x from one run to
the next. Each window's p99 is reported too (``daemon_tail_windows``), and each
side's units later than 1.2x the p99 alone per 1,000 (``daemon_tail_late_per_1000``):
on this host about 1 % of units are that late with no daemon at all, so the p99
(the 1 %-latest unit) flips on one or two units where that count does not. A run
where the probe's own 0.5-core limit throttled it for ``SELF_THROTTLED_MS`` or
more in any of those windows is reported as such (``daemon_tail_note``) instead.

On v2 the same weights are written as kubelet converts them, ``cpu.weight`` =
1 + (shares - 2) * 9999 // 262142, limits as ``cpu.max``, and the daemon runs
with ``cgroupVersion`` "v2"; in the VM each daemon strategy's warm-up starts at
the daemon's first tick (daemon_start_s), since the emulated daemon takes
seconds to start.

Per strategy: protected_p99_ratio (p99 lateness / p99 alone, same run; in the
VM, or with ``--paired``, against an alone run just before that strategy, as the
emulated VM's speed drifts up to 2x within minutes),
worst_15s_p99_ratio (the worst p99 of any 15 s stretch of the window, 5 s apart),
node_busy_pct (/proc/stat over the window), batch_cores (v1: cpuacct.usage,
v2: cpu.stat usage_usec of the batch tiers over the window), the protected
pod's own throttled time (v1 cpu.stat throttled_time, v2 throttled_usec), steal_ms
(/proc/stat steal over the window, all CPUs: time a hypervisor ran none of the
node's work, which no strategy can help) and,
for protect, ticks_to_target. The last line is one JSON object.

``--levers`` (v1 on the host, v2 with ``--vm``) instead measures static settings on the burner pods: per-pod
quotas that sum to 1.5, 1.2 and 1.0 cores at CFS periods of 100, 10 and 5 ms;
``cpu.shares`` 2 on the pods alone, on the tiers alone (what nodeguard's weight
lever does) and on both; ``cpu.idle``
on the batch tiers.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.common import (  # noqa: E402
    CPU_UNITS,
    IN_VM,
    DaemonProcess,
    free_port,
    p99,
    p99_windows,
    probe_iterations,
    probe_lateness,
    rc,
    run_in_vm,
    start_probe,
    stop_cleanly_on_sigterm,
    vm_available,
)
from nodeguard.model.samples import CpuMax  # noqa: E402
from nodeguard.sources.procfs import parse_proc_stat_cpu  # noqa: E402

TICK = 0.5  # tier_suppress's loop (koordlet's suppression interval)
DAEMON_TICK = 1.0  # the daemon's tickSeconds: its default (--tick)
WATERLINE_PCT = 70.0
PROTECTED_MILLI = 500
PROTECTED_LIMIT = CpuMax(50000, 100000)
DEFAULT_PERIOD_US = 100000
FLOOR_CORES = 0.05
TIERS = ("besteffort", "burstable")
PROTECT_OBJECTIVE = {"metric": "protected_cpu_stall", "threshold": "5%", "restoreBelow": "1%", "action": "throttle"}
HOLD_S = 4.0  # the hold run's weightHoldSeconds: far shorter than its window, so a timer-driven restore would show
HOLD_WINDOW_S = 15.0  # the span of the sub-windows whose worst p99 is reported
LATE_MARGIN = 1.2  # daemon_tail_late_per_1000 counts units later than this times the p99 alone (the ratio's target)
SELF_THROTTLED_MS = 20  # the probe held this long by its own 0.5-core limit: its tail is its own, not the daemon's
WATERLINE_OBJECTIVE = {"metric": "cpu_total_utilization", "action": "throttle", "threshold": WATERLINE_PCT,
                       "restoreBelow": WATERLINE_PCT - 10}  # fmt: skip


def milli_to_shares(milli: int) -> int:
    """kubelet's MilliCPUToShares: a request in millicores as cpu.shares (at least 2)."""
    return max(2, milli * 1024 // 1000)


# Per scenario: the burners as (tier, request in millicores; 0 = BestEffort).
SCENARIOS: dict[str, list[tuple[str, int]]] = {
    "kubelet_weights": [("besteffort", 0)] * 3 + [("burstable", 100)] * 3,
    "equal_weights": [("burstable", PROTECTED_MILLI)] * 6,
}


@dataclass
class Node:
    """One scenario's kubelet-shaped cgroups and the processes in them."""

    hierarchy: rc.Hierarchy
    parent: str
    protected: rc.KubeletPod
    burners: list[rc.KubeletPod]
    procs: list[subprocess.Popen[bytes]] = field(default_factory=list)

    @property
    def cpu(self) -> Path:
        return self.hierarchy.writable

    @property
    def cpuacct(self) -> Path:
        return self.hierarchy.roots[-1]

    def tier(self, name: str) -> str:
        return f"{self.parent}/kubepods/{name}"

    def batch_tiers(self) -> list[str]:
        return [self.tier(t) for t in TIERS if (self.cpu / self.tier(t)).is_dir()]

    def cpu_stat(self, rel: str, key: str) -> int:
        for line in (self.cpu / rel / "cpu.stat").read_text().splitlines():
            if line.startswith(key + " "):
                return int(line.split()[1])
        return 0

    def usage_ns(self, rels: list[str]) -> int:
        if self.hierarchy.version == "v2":
            return sum(self.cpu_stat(rel, "usage_usec") * 1000 for rel in rels)
        return sum(int((self.cpuacct / rel / "cpuacct.usage").read_text()) for rel in rels)

    def throttled_ns(self) -> int:
        """CFS throttled time of the protected pod (its own limit)."""
        if self.hierarchy.version == "v2":
            return self.cpu_stat(self.protected.pod, "throttled_usec") * 1000
        return self.cpu_stat(self.protected.pod, "throttled_time")

    def pressure_ns(self) -> int | None:
        """The protected pod's cpu.pressure ``some`` total (v2; v1 has no per-cgroup PSI)."""
        if self.hierarchy.version != "v2":
            return None
        some = (self.cpu / self.protected.pod / "cpu.pressure").read_text().splitlines()[0]
        return int(some.rsplit("total=", 1)[1]) * 1000

    def start_burners(self) -> None:
        self.procs += [pod.start_busy() for pod in self.burners]


def write(path: Path, value: object) -> None:
    path.write_text(str(value))


@contextlib.contextmanager
def kubelet_node(scenario: str, hierarchy: rc.Hierarchy, cpus: int) -> Iterator[Node]:
    """The pods of a scenario, with the weights kubelet writes at the node, tier, pod and container level
    (cpu.shares on v1, cpu.weight converted from them on v2)."""
    parent = rc.unique_name("ngprotect")
    with contextlib.ExitStack() as stack:
        burners = []
        for tier, milli in SCENARIOS[scenario]:
            pod = stack.enter_context(rc.kubelet_pod(hierarchy, parent, tier, None))
            for rel in (pod.pod, pod.container):
                hierarchy.set_shares(rel, milli_to_shares(milli))
            burners.append(pod)
        protected = stack.enter_context(rc.kubelet_pod(hierarchy, parent, None, PROTECTED_LIMIT))
        for rel in (protected.pod, protected.container):
            hierarchy.set_shares(rel, milli_to_shares(PROTECTED_MILLI))
        # kubelet's kubepods sits at the root with shares = allocatable; the unique parent stands in for the root
        # and carries that weight there too (each process outside has 1024; v2: the root's processes weigh 100).
        for rel in (parent, f"{parent}/kubepods"):
            hierarchy.set_shares(rel, milli_to_shares(cpus * 1000))
        for tier in TIERS:
            requests = sum(m for t, m in SCENARIOS[scenario] if t == tier)
            if (hierarchy.writable / parent / "kubepods" / tier).is_dir():
                hierarchy.set_shares(f"{parent}/kubepods/{tier}", milli_to_shares(requests))
        node = Node(hierarchy, parent, protected, burners)
        try:
            yield node
        finally:
            for proc in node.procs:
                if proc.poll() is None:
                    rc.stop(proc)


def cpu_times() -> tuple[int, int, int]:
    """(busy, total, steal) jiffies of the node from /proc/stat, as the sensor reads them (idle and iowait count as
    not busy; steal is time a hypervisor ran none of this machine's CPUs' work, which no strategy here can help)."""
    text = Path("/proc/stat").read_text()
    cpu = parse_proc_stat_cpu(text)
    steal = int(text.split(maxsplit=9)[8])  # the aggregate line comes first: "cpu" and then its fields
    return cpu.total - cpu.idle, cpu.total, steal


@dataclass
class Window:
    lateness_ms: list[float]
    node_busy_pct: float
    batch_cores: float
    seconds: float
    protected_throttled_ms: int
    protected_stall_pct: float | None  # v2: cpu.pressure some minus its own throttling, as the daemon reads it
    probe_text: str = ""
    since_us: int = 0
    until_us: int = 0
    steal_ms: int = 0  # summed over the node's CPUs

    def p99_per(self, span: float, step: float) -> list[float]:
        """The p99 lateness of every ``span``-second sub-window, ``step`` seconds apart."""
        return p99_windows(self.probe_text, self.since_us, self.until_us, span, step)


def measure(node: Node, probe_out: Path, iterations: int, warmup: float, seconds: float) -> Window:
    """Run the probe in the protected pod through a warm-up and a measured window."""
    probe = start_probe(probe_out, iterations, *node.hierarchy.dirs(node.protected.inner))
    try:
        time.sleep(warmup)
        tiers = node.batch_tiers()
        since, (busy0, total0, steal0), usage0 = time.monotonic(), cpu_times(), node.usage_ns(tiers)
        throttled0, pressure0 = node.throttled_ns(), node.pressure_ns()
        time.sleep(seconds)
        until, (busy1, total1, steal1), usage1 = time.monotonic(), cpu_times(), node.usage_ns(tiers)
        throttled1, pressure1 = node.throttled_ns(), node.pressure_ns()
    finally:
        probe.send_signal(signal.SIGTERM)
        try:
            probe.wait(5)
        except subprocess.TimeoutExpired:
            rc.stop(probe)
    text = probe_out.read_text()
    lateness = probe_lateness(text, round(since * 1e6), round(until * 1e6))
    return Window(
        lateness,
        round(100 * (busy1 - busy0) / max(1, total1 - total0), 1),
        round((usage1 - usage0) / 1e9 / (until - since), 2),
        until - since,
        round((throttled1 - throttled0) / 1e6),
        None if pressure0 is None or pressure1 is None
        else round(100 * max(0, pressure1 - pressure0 - (throttled1 - throttled0)) / 1e9 / (until - since), 2),
        text, round(since * 1e6), round(until * 1e6),
        round((steal1 - steal0) * 1000 / os.sysconf("SC_CLK_TCK")),
    )  # fmt: skip


def figures(window: Window, alone_p99: float) -> dict[str, Any]:
    worst = p99(window.lateness_ms)
    windows = window.p99_per(HOLD_WINDOW_S, 5.0)
    return {
        **({"worst_15s_p99_ratio": round(max(windows) / alone_p99, 2)} if windows else {}),
        "protected_p99_ratio": None if worst is None else round(worst / alone_p99, 2),
        "protected_p99_ms": None if worst is None else round(worst, 2),
        "units": len(window.lateness_ms),
        "node_busy_pct": window.node_busy_pct,
        "batch_cores": window.batch_cores,
        "protected_throttled_ms": window.protected_throttled_ms,  # its own quota, which no strategy can fix
        "steal_ms": window.steal_ms,
        **({} if window.protected_stall_pct is None else {"protected_stall_pct": window.protected_stall_pct}),
    }


# --- strategies: each a context manager that acts while the window runs -------------------------------


def daemon_config(
    node: Node, objective: dict[str, Any], workdir: Path, listen: str, tick: float, **guard: Any
) -> dict[str, Any]:
    """The e2e's config shape: discovery finds the pods under this run's kubepods."""
    version = node.hierarchy.version
    root = rc.v2_mount() if version == "v2" else rc.CGROUP_ROOT
    return {"global": {
        "sensing": {"cgroupRoot": str(root), "cgroupVersion": version, "tickSeconds": tick,
                    "kubepodsPaths": [f"{node.parent}/kubepods"]},
        # No API server: the pods have no metadata, and the config says they may be acted on anyway.
        "guard": {"objectives": [objective], **guard,
                  "candidates": {"classes": ["BestEffort", "Burstable"], "podsWithoutMetadata": True}},
        "actuation": {"ledgerPath": str(workdir / "run/ledger.json")},
        "http": {"listen": listen},
        "gate": {"enabled": False},
    }}  # fmt: skip


def refused(config: dict[str, Any], workdir: Path) -> str | None:
    """Why this daemon's check-config refuses the config, or None."""
    path = workdir / "check.json"
    path.write_text(json.dumps(config))
    done = subprocess.run([sys.executable, "-m", "nodeguard", "check-config", str(path)], cwd=REPO,
                          capture_output=True, text=True, timeout=600)  # fmt: skip
    if done.returncode == 0:
        return None
    said = " ".join((done.stdout + done.stderr).replace(f"{path}:", "").split())
    return f"check-config exit {done.returncode}: {said[:400]}"


@dataclass
class Acting:
    """What a strategy leaves for the report after its window."""

    extra: dict[str, Any] = field(default_factory=dict)


@contextlib.contextmanager
def run_daemon(node: Node, objective: dict[str, Any], workdir: Path, tick: float, **guard: Any) -> Iterator[Acting]:
    config = daemon_config(node, objective, workdir, f"127.0.0.1:{free_port()}", tick, **guard)
    reason = refused(config, workdir)
    if reason:
        raise Skipped(reason)
    daemon = DaemonProcess(config, workdir).start()
    acting = Acting()
    try:
        if IN_VM:
            # Under emulation the daemon takes many seconds to import and start: the warm-up begins at its first
            # tick, not while it is still starting.
            started = daemon.wait_for(lambda: any(e.get("event") == "tick" for e in daemon.events()), 600,
                                      "the daemon's first tick")  # fmt: skip
            acting.extra["daemon_start_s"] = round(started, 1)
        assert daemon.proc is not None
        own = psutil.Process(daemon.proc.pid)
        cpu0, since = sum(own.cpu_times()[:2]), time.monotonic()
        yield acting
        # The guard's own CPU over the warm-up and window: work beside the protected pod that no lever touches.
        acting.extra["daemon_cores"] = round((sum(own.cpu_times()[:2]) - cpu0) / (time.monotonic() - since), 3)
        acting.extra["throttled_workloads"] = len(
            {e.get("workload") for e in daemon.events() if e.get("event") == "throttle"}
        )
        if objective["metric"] == "protected_cpu_stall":
            acting.extra.update(ticks_to_target(daemon, config["global"]["http"]["listen"]))
            # The burners run for the daemon's whole life: any weight put back is a restore under contention.
            restores = [e for e in daemon.events() if e.get("event") == "reweigh" and e.get("restored")]
            acting.extra["restores_under_contention"] = len(restores)
            if restores:
                acting.extra["restore_reasons"] = sorted({str(e.get("reason")) for e in restores})
        daemon.signal(signal.SIGTERM)
        acting.extra["daemon_exit"] = daemon.wait(120 if IN_VM else 15)
    finally:
        daemon.kill()


def ticks_to_target(daemon: DaemonProcess, listen: str) -> dict[str, Any]:
    """Ticks from the daemon's start until the protected stall read under 5 %: from its debug log's tick
    readings; null with a reason when the daemon does not log the reading."""
    readings = [
        (e.get("readings") or {}).get("protected_cpu_stall") for e in daemon.events() if e.get("event") == "tick"
    ]
    status: Any = None
    with (
        contextlib.suppress(OSError, ValueError),
        urllib.request.urlopen(f"http://{listen}/status", timeout=30) as response,
    ):
        status = json.loads(response.read())
    found = {"protect_status": status.get("protected") if isinstance(status, dict) else None}
    if not any(r is not None for r in readings):
        return {**found, "ticks_to_target": None,
                "ticks_to_target_reason": "the daemon's tick log has no protected_cpu_stall reading"}  # fmt: skip
    # The reading in percent (threshold "5%"): a ratio reading (<= 1) is scaled.
    scale = 100.0 if all(r is None or r <= 1 for r in readings) else 1.0
    ticks = next((i + 1 for i, r in enumerate(readings) if r is not None and r * scale < 5.0), None)
    return {**found, "ticks_to_target": ticks, "stall_readings_pct": [None if r is None else round(r * scale, 1)
                                                                     for r in readings[:40]]}  # fmt: skip


class Skipped(Exception):
    pass


@contextlib.contextmanager
def tier_suppress(node: Node, workdir: Path) -> Iterator[Acting]:
    """koordlet's BE suppression on every candidate tier: one quota per tier, the originals put back after."""
    cpus = os.cpu_count() or 1
    tiers = node.batch_tiers()
    originals = {t: node.hierarchy.limit(t) for t in tiers}
    stop = threading.Event()
    quotas: list[float] = []

    def loop() -> None:
        def sample() -> tuple[int, dict[str, int], float]:
            return node.usage_ns([node.protected.pod]), {t: node.usage_ns([t]) for t in tiers}, time.monotonic()

        rest0, tier0, at0 = sample()
        while not stop.wait(TICK):
            rest1, tier1, at1 = sample()
            rest = (rest1 - rest0) / 1e9 / (at1 - at0)
            used = {t: (tier1[t] - tier0[t]) / 1e9 / (at1 - at0) for t in tiers}
            room = max(FLOOR_CORES * len(tiers), cpus * WATERLINE_PCT / 100 - rest)
            total = sum(used.values())
            quotas.append(room)
            for t in tiers:
                # The room split as the tiers used the CPU in the last tick (koordlet suppresses one BE tier).
                share = used[t] / total if total > 0 else 1 / len(tiers)
                cores = max(FLOOR_CORES, room * share)
                node.hierarchy.set_limit(t, CpuMax(round(cores * DEFAULT_PERIOD_US), DEFAULT_PERIOD_US))
            rest0, tier0, at0 = rest1, tier1, at1

    thread = threading.Thread(target=loop, daemon=True)
    thread.start()
    acting = Acting()
    try:
        yield acting
    finally:
        stop.set()
        thread.join(5)
        for t, limit in originals.items():
            node.hierarchy.set_limit(t, limit)
        if quotas:
            acting.extra["tier_quota_cores_mean"] = round(sum(quotas) / len(quotas), 2)


@contextlib.contextmanager
def nothing(node: Node, workdir: Path) -> Iterator[Acting]:
    yield Acting()


# Each strategy on (node, working directory, the daemon's tick in seconds).
STRATEGIES: dict[str, Callable[[Node, Path, float], contextlib.AbstractContextManager[Acting]]] = {
    "none": lambda node, workdir, tick: nothing(node, workdir),
    "node_waterline": lambda node, workdir, tick: run_daemon(node, WATERLINE_OBJECTIVE, workdir, tick),
    "tier_suppress": lambda node, workdir, tick: tier_suppress(node, workdir),
    "protect": lambda node, workdir, tick: run_daemon(node, PROTECT_OBJECTIVE, workdir, tick),
    # protect with a hold far shorter than the run: the weights must stay down while the burners run.
    "hold": lambda node, workdir, tick: run_daemon(node, PROTECT_OBJECTIVE, workdir, tick, weightHoldSeconds=HOLD_S),
    # The lever protect uses (the batch tiers' weight at the least), held with no daemon: protect's tail baseline.
    "static_lever": lambda node, workdir, tick: static_lever(node),
}


@contextlib.contextmanager
def static_lever(node: Node) -> Iterator[Acting]:
    with applied(node, STATIC_LEVER):
        yield Acting({"lever": STATIC_LEVER.name})


def daemon_tail(windows: dict[str, list[Window]], late_ms: float) -> dict[str, Any]:
    """protect's p99 over the same lever's held statically, each side's windows pooled, or why not: a run whose
    probe its own limit held is reported as such, not compared. Beside it, each side's units later than
    ``late_ms`` per 1,000: the p99 is the 1 %-latest unit, and where about 1 % of units are late with no daemon at
    all, it flips on one or two of them; the late count does not."""
    sides = {name: windows.get(name, []) for name in ("protect", "static_lever")}
    each = {f"{name}_p99_ms": [round(w, 2) if (w := p99(window.lateness_ms)) is not None else None for window in side]
            for name, side in sides.items()}  # fmt: skip
    pooled = {name: [u for window in side for u in window.lateness_ms] for name, side in sides.items()}
    worst = {name: p99(units) for name, units in pooled.items()}
    if not worst["protect"] or not worst["static_lever"]:
        return {"daemon_tail_ratio": None, "daemon_tail_note": "protect or static_lever not run"}
    late = {"over_ms": round(late_ms, 2), **{name: round(1000 * sum(u > late_ms for u in units) / len(units), 1)
                                             for name, units in pooled.items()}}  # fmt: skip
    held = [f"{name} {window.protected_throttled_ms} ms" for name, side in sides.items() for window in side
            if window.protected_throttled_ms >= SELF_THROTTLED_MS]  # fmt: skip
    if held:
        return {"daemon_tail_ratio": None, "daemon_tail_note": f"probe throttled by its own limit: {', '.join(held)}",
                "daemon_tail_windows": each, "daemon_tail_late_per_1000": late}  # fmt: skip
    return {
        "daemon_tail_ratio": round(worst["protect"] / worst["static_lever"], 2),
        "daemon_tail_windows": each,
        "daemon_tail_late_per_1000": late,
    }


# --- levers: static settings on the burner pods --------------------------------------------------------


@dataclass(frozen=True)
class Lever:
    name: str
    batch_cores: float | None = None  # split evenly as per-pod quotas
    period_us: int = DEFAULT_PERIOD_US
    shares: int | None = None
    shares_on_tiers: bool = False
    shares_on_pods: bool = True
    idle_tiers: bool = False


LEVERS = [
    Lever("none"),
    *[Lever(f"quota_{cores}c_{period // 1000}ms", cores, period)
      for period in (100000, 10000, 5000) for cores in (1.5, 1.2, 1.0)],
    Lever("shares2_pods", shares=2),
    Lever("shares2_pods_tiers", shares=2, shares_on_tiers=True),
    Lever("shares2_tiers", shares=2, shares_on_tiers=True, shares_on_pods=False),
    Lever("idle_tiers", idle_tiers=True),
]  # fmt: skip
STATIC_LEVER = next(lv for lv in LEVERS if lv.name == "shares2_tiers")  # what the weight lever writes (v2: weight 1)


@contextlib.contextmanager
def applied(node: Node, lever: Lever) -> Iterator[None]:
    """The lever's files written, every original put back afterwards (quota before period, as v1 needs)."""
    files: dict[Path, str] = {}
    v2 = node.hierarchy.version == "v2"

    def set_file(path: Path, value: object) -> None:
        files.setdefault(path, path.read_text().strip())
        try:
            write(path, value)
        except OSError as error:
            raise OSError(error.errno, f"{error.strerror} writing {value} to {path.name}") from error

    def set_shares(group: Path, shares: int) -> None:
        set_file(group / node.hierarchy.weight_file, node.hierarchy.kubelet_weight(shares))

    try:
        for pod in node.burners:
            group = node.cpu / pod.pod
            if lever.batch_cores is not None:
                quota = round(lever.batch_cores / len(node.burners) * lever.period_us)
                if v2:
                    set_file(group / "cpu.max", f"{quota} {lever.period_us}")
                else:
                    set_file(group / "cpu.cfs_quota_us", -1)
                    set_file(group / "cpu.cfs_period_us", lever.period_us)
                    set_file(group / "cpu.cfs_quota_us", quota)
            if lever.shares is not None and lever.shares_on_pods:
                set_shares(group, lever.shares)
        for tier in node.batch_tiers():
            if lever.shares is not None and lever.shares_on_tiers:
                set_shares(node.cpu / tier, lever.shares)
            if lever.idle_tiers:
                # Unsetting cpu.idle leaves cpu.shares at 1024 (seen on 6.18, v1), not what it was: record the
                # weight first so it is written back after cpu.idle.
                weight = node.cpu / tier / node.hierarchy.weight_file
                files.setdefault(weight, weight.read_text().strip())
                set_file(node.cpu / tier / "cpu.idle", 1)
        yield
    finally:
        # Reverse order of first writes: a quota goes back to -1 before its period changes.
        for path, original in reversed(list(files.items())):
            write(path, original)


# --- runs ----------------------------------------------------------------------------------------------


@dataclass
class Bench:
    hierarchy: rc.Hierarchy
    cpus: int
    workdir: Path
    warmup: float
    seconds: float
    iterations: int = 0
    alone_p99: float = 0.0
    paired: bool = False  # each strategy's ratio against an alone run just before it
    tick: float = DAEMON_TICK  # the daemons' tickSeconds
    keep_logs: Path | None = None  # where each strategy's daemon logs are copied (--keep-logs)
    runs: int = 0
    windows: dict[tuple[str, str], list[Window]] = field(default_factory=dict)  # (scenario, strategy): measured

    def probe_file(self) -> Path:
        self.runs += 1
        return self.workdir / f"probe-{self.runs}.txt"

    def alone(self) -> dict[str, Any]:
        if self.iterations == CPU_UNITS:
            with kubelet_node("kubelet_weights", self.hierarchy, self.cpus) as node:
                window = measure(node, self.probe_file(), CPU_UNITS, self.warmup, self.seconds)
            worst = p99(window.lateness_ms)
            if worst is None:
                raise RuntimeError("the probe reported no unit alone")
            self.alone_p99 = self.alone_p99 or worst
            return {"alone_p99_ms": round(worst, 2), "probe_unit": "4 ms of CPU",
                    "alone_node_busy_pct": window.node_busy_pct,
                    "alone_throttled_ms": window.protected_throttled_ms,
                    **({} if window.protected_stall_pct is None
                       else {"alone_stall_pct": window.protected_stall_pct})}  # fmt: skip
        return self.calibrated_alone()

    def calibrated_alone(self) -> dict[str, Any]:
        """The probe measured alone, in the protected pod's cgroup shape, no burners (calibrated the first time)."""
        with kubelet_node("kubelet_weights", self.hierarchy, self.cpus) as node:
            out = self.probe_file()
            window = measure(node, out, self.iterations, self.warmup, self.seconds)
        iterations = self.iterations or probe_iterations(out.read_text())
        worst = p99(window.lateness_ms)
        if iterations is None or worst is None:
            raise RuntimeError(f"the probe calibrated nothing; its output: {out.read_text()[:300]!r}")
        if not self.iterations:
            self.iterations, self.alone_p99 = iterations, worst
        return {"alone_p99_ms": round(worst, 2), "probe_iterations": iterations,
                "alone_node_busy_pct": window.node_busy_pct,
                "alone_throttled_ms": window.protected_throttled_ms}  # fmt: skip

    def strategy(self, scenario: str, name: str) -> dict[str, Any]:
        if self.paired:
            # The baseline measured just before: the emulated VM's speed drifts (its alone p99 moved 4.9 -> 12.6 ms
            # between runs and up to 2x within one), which a single baseline would put in every ratio.
            alone = self.alone()
            before = {"alone_p99_ms": alone["alone_p99_ms"], "alone_throttled_ms": alone["alone_throttled_ms"]}
            found = self._strategy(scenario, name, alone["alone_p99_ms"])
            return found if "skipped" in found else {**found, **before}
        return self._strategy(scenario, name, self.alone_p99)

    def _strategy(self, scenario: str, name: str, alone_p99: float) -> dict[str, Any]:
        with kubelet_node(scenario, self.hierarchy, self.cpus) as node, \
                tempfile.TemporaryDirectory(dir=self.workdir) as tmp:  # fmt: skip
            node.start_burners()
            time.sleep(1.0)  # the burners reach their share before anything acts
            try:
                with STRATEGIES[name](node, Path(tmp), self.tick) as acting:
                    window = measure(node, self.probe_file(), self.iterations, self.warmup, self.seconds)
            except Skipped as why:
                return {"skipped": str(why)}
            self.windows.setdefault((scenario, name), []).append(window)
            self._keep(Path(tmp), f"{scenario}-{name}-{len(self.windows[(scenario, name)])}")
            return {**figures(window, alone_p99), **acting.extra}

    def _keep(self, workdir: Path, stem: str) -> None:
        """A copy of the daemon's log of one window (each tick's readings and actions), to read a run that missed."""
        if self.keep_logs is None:
            return
        for number, log in enumerate(sorted(workdir.glob("daemon-*.log"))):
            shutil.copyfile(log, self.keep_logs / f"{stem}{'' if number == 0 else f'.{number}'}.log")

    def levers(self, scenario: str, levers: list[Lever]) -> dict[str, Any]:
        results = {}
        with kubelet_node(scenario, self.hierarchy, self.cpus) as node:
            node.start_burners()
            for lever in levers:
                try:
                    with applied(node, lever):
                        window = measure(node, self.probe_file(), self.iterations, self.warmup, self.seconds)
                    results[lever.name] = figures(window, self.alone_p99)
                except OSError as error:  # e.g. v1 refuses a quota under 1 ms
                    results[lever.name] = {"error": str(error.strerror)}
                print(f"{scenario:16} {lever.name:22} {json.dumps(results[lever.name])}  load={load()}", flush=True)
        return results


def load() -> str:
    return " ".join(Path("/proc/loadavg").read_text().split()[:3])


def host_v1() -> rc.Hierarchy | str:
    """This host's cgroup v1 cpu and cpuacct hierarchies, or why there are none."""
    reason = rc.why_no_v1_cpu()
    if reason:
        return reason
    cpu, cpuacct = rc.v1_hierarchy("cpu"), rc.v1_hierarchy("cpuacct")
    assert cpu is not None and cpuacct is not None
    return rc.Hierarchy("v1", [cpu] if cpu == cpuacct else [cpu, cpuacct])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seconds", type=float, default=20.0, help="measured window per strategy (levers: 12)")
    parser.add_argument(
        "--warmup",
        type=float,
        default=None,
        help="seconds before each window (default 10: a strategy's start and the work queued while "
        "harmed settle first; levers: 3)",
    )
    parser.add_argument("--scenario", action="append", choices=list(SCENARIOS), help="default: all")
    parser.add_argument("--strategy", action="append", choices=list(STRATEGIES), help="default: all")
    parser.add_argument(
        "--fixed-work",
        action="store_true",
        help="units of a fixed count of iterations calibrated alone (default: 4 ms of CPU each)",
    )
    parser.add_argument("--levers", action="store_true", help="measure static levers on the burners instead")
    parser.add_argument("--lever", action="append", choices=[lv.name for lv in LEVERS], help="with --levers: a subset")
    parser.add_argument(
        "--vm",
        action="store_true",
        help="run the strategies in the QEMU VM on a pure cgroup v2 kernel (tests/kernel/vm.py; "
        "2 vCPUs, Python 15-25x slower under emulation) instead of on this host's cgroup v1",
    )
    parser.add_argument(
        "--paired",
        action="store_true",
        help="each strategy's ratio against an alone run just before it (always so in the VM)",
    )
    parser.add_argument(
        "--tick",
        type=float,
        default=DAEMON_TICK,
        help="the daemon's tickSeconds (default: the daemon's own default, 1 s)",
    )
    parser.add_argument(
        "--tail-pairs",
        type=int,
        default=2,
        help="how many times protect and static_lever are measured, interleaved, for daemon_tail_ratio (default 2)",
    )
    parser.add_argument(
        "--keep-logs",
        type=Path,
        default=None,
        metavar="DIR",
        help="copy each strategy's daemon log (its debug tick lines) into DIR as <scenario>-<strategy>-<n>.log "
        "(on this host; not with --vm)",
    )
    parser.add_argument("--in-vm", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.keep_logs is not None:
        args.keep_logs.mkdir(parents=True, exist_ok=True)
    if args.vm:
        return run_vm(args)
    if args.in_vm:
        reason = rc.why_no_v2()
        if reason is None and "cpu" not in (rc.CGROUP_ROOT / "cgroup.controllers").read_text().split():
            reason = "no pure cgroup v2 cpu controller at /sys/fs/cgroup"
        if reason:
            print(json.dumps({"error": reason}))
            return 1
        hierarchy = rc.v2_cpu_hierarchy()
    else:
        found = host_v1()
        if isinstance(found, str):
            print(json.dumps({"error": found}))
            return 1
        hierarchy = found
    result = run(args, hierarchy)
    if args.levers:
        print_table(result)
    if args.in_vm:
        Path(os.environ["NODEGUARD_VM_OUT"], "protect.json").write_text(json.dumps(result))
    print(json.dumps(result))
    return 0


def run(args: argparse.Namespace, hierarchy: rc.Hierarchy) -> dict[str, Any]:
    seconds = args.seconds if not args.levers or "--seconds" in sys.argv else 12.0
    warmup = args.warmup if args.warmup is not None else (3.0 if args.levers else 10.0)
    scenarios = args.scenario or list(SCENARIOS)
    with tempfile.TemporaryDirectory(prefix="ngprotect-") as tmp:
        bench = Bench(hierarchy, os.cpu_count() or 1, Path(tmp), warmup, seconds,
                      0 if args.fixed_work else CPU_UNITS, paired=args.paired or args.in_vm, tick=args.tick,
                      keep_logs=args.keep_logs)  # fmt: skip
        result: dict[str, Any] = bench.alone()
        print(f"alone: {json.dumps(result)}  load={load()}", flush=True)
        result["cgroup"] = hierarchy.version
        result["daemon_tick_s"] = bench.tick
        result["load_before"] = load()
        result["scenarios"] = {}
        for scenario in scenarios:
            if args.levers:
                chosen = [lv for lv in LEVERS if not args.lever or lv.name in args.lever]
                result["scenarios"][scenario] = bench.levers(scenario, chosen)
                continue
            per: dict[str, Any] = {}
            names = args.strategy or list(STRATEGIES)
            for name in names:
                per[name] = bench.strategy(scenario, name)
                print(f"{scenario:16} {name:15} {json.dumps(per[name])}  load={load()}", flush=True)
            pair = [name for name in ("protect", "static_lever") if name in names]
            repeats = args.tail_pairs - 1 if len(pair) == 2 else 0  # the first of each was measured above
            for again in range(2, 2 + repeats):
                for name in pair:
                    found = bench.strategy(scenario, name)
                    print(f"{scenario:16} {f'{name} #{again}':15} {json.dumps(found)}  load={load()}", flush=True)
            tail = daemon_tail(
                {name: bench.windows.get((scenario, name), []) for name in pair}, LATE_MARGIN * bench.alone_p99
            )
            result["scenarios"][scenario] = {**per, **tail}
        # The alone baseline again at the end: how far the machine's other work moved it during the run.
        result["alone_p99_ms_at_end"] = bench.alone()["alone_p99_ms"]
        result["load_after"] = load()
    return result


def run_vm(args: argparse.Namespace) -> int:
    """This script with --in-vm in a fresh VM; its progress on the console, its result JSON as the last line."""
    reason = vm_available() or rc.why_no_v2()
    if reason:
        print(json.dumps({"error": reason}))
        return 1
    argv = [sys.executable, str(Path(__file__).resolve()), "--in-vm", "--seconds", str(args.seconds)]
    argv += ["--warmup", str(args.warmup)] if args.warmup is not None else []
    argv += [f"--scenario={s}" for s in args.scenario or []] + [f"--strategy={s}" for s in args.strategy or []]
    argv += ["--fixed-work"] if args.fixed_work else []
    argv += ["--tick", str(args.tick), "--tail-pairs", str(args.tail_pairs)]
    argv += ["--levers", *[f"--lever={lv}" for lv in args.lever or []]] if args.levers else []
    # Each strategy paired with an alone run, the tail pair's repeats too, and alone at the start and the end.
    runs = 2 * len(args.scenario or SCENARIOS) * (len(args.strategy or STRATEGIES) + 2 * (args.tail_pairs - 1)) + 2
    # Generous: each run's window and warm-up, plus the emulated daemon's start, check-config and exit.
    timeout = 900 + runs * ((args.warmup if args.warmup is not None else 10.0) + args.seconds + 300)
    host_load = load()
    with tempfile.TemporaryDirectory(prefix="ngprotect-vm-") as out:
        result = run_in_vm(argv, cwd=str(REPO), out_dir=Path(out), timeout=timeout, echo=sys.stdout.buffer)
        found = Path(out) / "protect.json"
        if result.exit_code != 0 or not found.exists():
            print(json.dumps({"error": f"VM run failed with exit code {result.exit_code}"}))
            return 1
        figures = json.loads(found.read_text())
    print(json.dumps({**figures, "host_load_before": host_load, "host_load_after": load()}))
    return 0


def print_table(result: dict[str, Any]) -> None:
    print(f"{'scenario':16} {'lever':22} {'p99 ratio':>9} {'p99 ms':>7} {'busy %':>7} {'batch':>6}")
    for scenario, levers in result["scenarios"].items():
        for name, f in levers.items():
            if "error" in f:
                print(f"{scenario:16} {name:22} {f['error']}")
                continue
            print(f"{scenario:16} {name:22} {f['protected_p99_ratio']!s:>9} {f['protected_p99_ms']!s:>7} "
                  f"{f['node_busy_pct']:>7} {f['batch_cores']:>6}")  # fmt: skip


if __name__ == "__main__":
    stop_cleanly_on_sigterm()
    raise SystemExit(main())
