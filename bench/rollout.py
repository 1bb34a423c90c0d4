"""Benchmark: does a DaemonSet rollout expose the node it guards?

On this host's cgroup v1 (cpu and cpuacct hierarchies), bench/protect.py's
kubelet-shaped node in its ``equal_weights`` scenario: six Burstable burners
that each want a whole core, beside a Guaranteed pod running the probe of
tests/workloads.py (4 ms of CPU released every 10 ms; its lateness per unit is
its service level). Per objective, a real ``nodeguard run`` at the daemon's
default 1 s tick guards it:

- waterline: node CPU (cpu_total_utilization) held at 70 % (protect.py's
  node_waterline objective);
- protect: the Guaranteed pod's stall (protected_cpu_stall, protect.py's).

Per strategy and objective, on fresh cgroups: the daemon's first tick, a
warm-up, the steady guarded phase (``--steady`` seconds, by default as long as
the rollout), then the rollout: ``--restarts`` restarts ``--spacing`` seconds
apart, each daemon on the same ledger as the one before, then an uninstall
(the last daemon stopped with no successor).

- surge: the new daemon first (it finds the node held and waits), then the old
  one stopped (SIGTERM) once the new one says it waits: what a DaemonSet with
  ``maxSurge: 1, maxUnavailable: 0`` does;
- unavailable: the old daemon stopped, and the new one started as soon as it
  exited: ``maxSurge: 0, maxUnavailable: 1``.

Per strategy and objective: ``p99_vs_steady`` (the probe's p99 lateness over the
rollout window over its p99 in the steady window just before), ``busy_pct``
(/proc/stat over each window), ``windows_over_waterline`` (the one-second
windows of each phase whose node CPU was over the 70 % waterline),
``handover_ms`` (from each old daemon's SIGTERM to its successor's first tick,
by that tick's log line), ``handed_over`` (successors that adopted their
predecessor's holds) and ``left_after_uninstall`` (pod, container and tier
limits and weights not at their originals after the uninstall, plus records
left in the ledger). Targets: with surge, ``p99_vs_steady`` <= 1.2 and no more
windows over the waterline than in the steady window; ``left_after_uninstall``
0 everywhere. On a shared host another nodeguard may take the node from under a
run (its daemon refused): that run is made again on fresh cgroups, up to
``--attempts`` times, and ``attempt`` says which one is reported. The last line
is one JSON object.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shlex
import signal
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

import psutil

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.common import (  # noqa: E402
    CPU_UNITS,
    DaemonProcess,
    p99,
    probe_lateness,
    rc,
    start_probe,
    stop_cleanly_on_sigterm,
    wait_for_the_node,
)
from bench.protect import (  # noqa: E402
    DAEMON_TICK,
    PROTECT_OBJECTIVE,
    WATERLINE_OBJECTIVE,
    WATERLINE_PCT,
    Node,
    cpu_times,
    daemon_config,
    host_v1,
    kubelet_node,
    load,
)
from nodeguard.actuators.ledger import Ledger  # noqa: E402
from nodeguard.model.samples import CpuMax  # noqa: E402

SCENARIO = "equal_weights"
OBJECTIVES = {"waterline": WATERLINE_OBJECTIVE, "protect": PROTECT_OBJECTIVE}
STRATEGIES = ("surge", "unavailable")
WAITING = "waiting to take the node over when the nodeguard that holds it stops"
ADOPTED = "adopted the predecessor's holds"
P99_TARGET = 1.2


class RunFailed(Exception):
    """A daemon of the run exited on its own (another nodeguard took this shared host's node, say)."""


@dataclass
class Phase:
    """One measured stretch: its monotonic bounds and /proc/stat at both ends."""

    since: float
    until: float = 0.0
    busy0: tuple[int, int] = (0, 0)
    busy1: tuple[int, int] = (0, 0)

    def begin(self) -> Phase:
        busy, total, _ = cpu_times()
        self.busy0 = (busy, total)
        return self

    def end(self) -> Phase:
        busy, total, _ = cpu_times()
        self.until, self.busy1 = time.monotonic(), (busy, total)
        return self

    def busy_pct(self) -> float:
        return round(100 * (self.busy1[0] - self.busy0[0]) / max(1, self.busy1[1] - self.busy0[1]), 1)


@dataclass
class BusySeconds:
    """The node's CPU busy share in each one-second window, by the window's start (monotonic)."""

    windows: list[tuple[float, float]] = field(default_factory=list)
    _stop: threading.Event = field(default_factory=threading.Event)

    def run(self) -> None:
        at, (busy0, total0, _) = time.monotonic(), cpu_times()
        while not self._stop.wait(max(0.0, at + 1.0 - time.monotonic())):
            now, (busy1, total1, _) = time.monotonic(), cpu_times()
            self.windows.append((at, 100 * (busy1 - busy0) / max(1, total1 - total0)))
            at, busy0, total0 = now, busy1, total1

    @contextlib.contextmanager
    def sampling(self) -> Iterator[BusySeconds]:
        thread = threading.Thread(target=self.run, daemon=True)
        thread.start()
        try:
            yield self
        finally:
            self._stop.set()
            thread.join(5)

    def over(self, phase: Phase, threshold: float) -> tuple[int, int]:
        """(windows over ``threshold`` %, windows) among those that lie wholly in ``phase``."""
        inside = [pct for at, pct in self.windows if phase.since <= at and at + 1.0 <= phase.until + 0.05]
        return sum(pct > threshold for pct in inside), len(inside)


def first_tick_wall(daemon: DaemonProcess) -> float | None:
    """Wall-clock seconds of the daemon's first tick line, or None before it."""
    for event in daemon.events():
        if event.get("event") == "tick":
            return datetime.fromisoformat(str(event["timestamp"])).timestamp()
    return None


def logged(daemon: DaemonProcess, event: str) -> bool:
    return any(e.get("event") == event for e in daemon.events())


def until(daemon: DaemonProcess, predicate: Any, timeout: float, what: str) -> None:
    """Poll ``predicate`` every 50 ms; RunFailed if the daemon exits or ``timeout`` passes first."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if daemon.proc is not None and daemon.proc.poll() is not None:
            raise RunFailed(f"{what}: the daemon exited {daemon.proc.returncode}: {tail(daemon)}")
        if time.monotonic() > deadline:
            raise RunFailed(f"{what}: not within {timeout:.0f} s: {tail(daemon)}")
        time.sleep(0.05)


def tail(daemon: DaemonProcess) -> str:
    return " | ".join(str(e.get("error") or e.get("event")) for e in daemon.events()[-3:])


def record_originals(node: Node) -> dict[str, tuple[object, int]]:
    """Every pod's, container's and tier's limit and weight before any daemon ran."""
    rels = {rel for pod in [*node.burners, node.protected] for rel in (pod.pod, pod.container)}
    rels |= {*node.batch_tiers(), f"{node.parent}/kubepods"}
    return {rel: (node.hierarchy.limit(rel), node.hierarchy.weight(rel)) for rel in sorted(rels)}


def changed(node: Node, originals: dict[str, tuple[object, int]]) -> list[str]:
    return [rel for rel, was in originals.items() if (node.hierarchy.limit(rel), node.hierarchy.weight(rel)) != was]


@dataclass
class Rollout:
    """One strategy's rollout on one objective's node."""

    node: Node
    objective: dict[str, Any]
    workdir: Path
    args: argparse.Namespace
    wrapper: list[str] = field(default_factory=list)  # how each daemon is exec'd: into its pod's cgroup
    handovers_ms: list[float] = field(default_factory=list)
    adopted: int = 0
    began: list[float] = field(default_factory=list)  # monotonic: each restart's first step
    start_cpu_s: list[float] = field(default_factory=list)  # each new daemon's CPU from exec to its first tick

    def first(self) -> DaemonProcess:
        config = daemon_config(self.node, self.objective, self.workdir, "127.0.0.1:0", self.args.tick)
        config["global"]["http"] = {"enabled": False}
        daemon = DaemonProcess(config, self.workdir, wrapper=self.wrapper).start()
        until(daemon, lambda: first_tick_wall(daemon) is not None, 60, "the first daemon's first tick")
        return daemon

    def restart(self, strategy: str, old: DaemonProcess) -> DaemonProcess:
        """The next daemon in, the old one out, by ``strategy``; the handover time recorded."""
        new = old.successor()
        self.began.append(time.monotonic())
        if strategy == "surge":
            new.start()
            until(new, lambda: logged(new, WAITING), 60, "the successor waiting")
            stopped = time.time()
            old.signal(signal.SIGTERM)
            if old.wait(60) != 0:
                raise RunFailed(f"the old daemon exited {old.proc.returncode if old.proc else None}: {tail(old)}")
        else:
            stopped = time.time()
            old.signal(signal.SIGTERM)
            if old.wait(60) != 0:
                raise RunFailed(f"the old daemon exited {old.proc.returncode if old.proc else None}: {tail(old)}")
            new.start()
        until(new, lambda: first_tick_wall(new) is not None, 60, "the successor's first tick")
        tick = first_tick_wall(new)
        assert tick is not None and new.proc is not None
        self.handovers_ms.append(round(1000 * (tick - stopped), 1))
        with contextlib.suppress(psutil.Error):
            self.start_cpu_s.append(round(sum(psutil.Process(new.proc.pid).cpu_times()[:2]), 2))
        self.adopted += logged(new, ADOPTED)
        return new


def confined(dirs: list[Path]) -> list[str]:
    """A wrapper that moves itself into ``dirs`` and execs the daemon there, as a container starts in its pod."""
    moves = "".join(f"echo $$ > {shlex.quote(str(d / 'cgroup.procs'))}; " for d in dirs)
    return ["sh", "-c", moves + 'exec "$@"', "sh"]


@contextlib.contextmanager
def nodeguard_pod(node: Node, unconfined: bool) -> Iterator[list[str]]:
    """The daemons' cgroup, as the DaemonSet's Guaranteed pod has it (500m: cpu.shares 512, a 50 ms quota per
    100 ms), beside the node's kubepods so that discovery does not take it for a workload; the wrapper that puts
    each daemon in it. ``unconfined``: no group, the daemons run in the bench's own cgroup."""
    if unconfined:
        yield []
        return
    rel = f"{node.parent}/nodeguard"
    with node.hierarchy.groups(rel):
        node.hierarchy.set_shares(rel, 512)
        node.hierarchy.set_limit(rel, CpuMax(50000, 100000))
        yield confined(node.hierarchy.dirs(rel))


def run_one(node: Node, objective: str, strategy: str, workdir: Path, args: argparse.Namespace) -> dict[str, Any]:
    """The steady phase, the rollout and the uninstall of one strategy on one objective's node."""
    with nodeguard_pod(node, args.unconfined) as wrapper:
        return guarded_run(node, objective, strategy, workdir, args, wrapper=wrapper)


def guarded_run(
    node: Node, objective: str, strategy: str, workdir: Path, args: argparse.Namespace, *, wrapper: list[str]
) -> dict[str, Any]:
    originals = record_originals(node)
    node.start_burners()
    time.sleep(1.0)  # the burners reach their share before anything acts
    probe_out = workdir / "probe.txt"
    probe = start_probe(probe_out, CPU_UNITS, *node.hierarchy.dirs(node.protected.inner))
    rollout = Rollout(node, OBJECTIVES[objective], workdir, args, wrapper)
    seconds = BusySeconds()
    daemon: DaemonProcess | None = None
    try:
        with seconds.sampling():
            daemon = rollout.first()
            time.sleep(args.warmup)
            steady = Phase(time.monotonic()).begin()
            time.sleep(args.steady)
            steady.end()
            rolling = Phase(time.monotonic()).begin()
            for i in range(args.restarts):
                daemon = rollout.restart(strategy, daemon)
                time.sleep(max(0.0, rolling.since + (i + 1) * args.spacing - time.monotonic()))
            rolling.end()
            daemon.signal(signal.SIGTERM)  # the uninstall: no successor waits
            uninstall_exit = daemon.wait(60)
    finally:
        if daemon is not None:
            daemon.kill()
        probe.send_signal(signal.SIGTERM)
        with contextlib.suppress(Exception):
            probe.wait(5)
        if probe.poll() is None:
            rc.stop(probe)
    left = changed(node, originals)
    ledger = Ledger.load(str(workdir / "run/ledger.json"))
    text = probe_out.read_text()
    p99s = {name: p99(probe_lateness(text, round(phase.since * 1e6), round(phase.until * 1e6)))
            for name, phase in (("steady", steady), ("rollout", rolling))}  # fmt: skip
    over = {name: seconds.over(phase, WATERLINE_PCT) for name, phase in (("steady", steady), ("rollout", rolling))}
    handovers = rollout.handovers_ms
    return {
        "p99_vs_steady": None if not p99s["steady"] or p99s["rollout"] is None
        else round(p99s["rollout"] / p99s["steady"], 2),
        "p99_ms": {name: None if v is None else round(v, 2) for name, v in p99s.items()},
        "busy_pct": {"steady": steady.busy_pct(), "rollout": rolling.busy_pct()},
        "windows_over_waterline": {name: n for name, (n, _) in over.items()},
        "windows": {name: total for name, (_, total) in over.items()},
        "handover_ms": {"median": round(statistics.median(handovers), 1), "max": max(handovers),
                        "each": handovers},
        "handed_over": f"{rollout.adopted}/{len(handovers)}",
        "left_after_uninstall": len(left) + len(list(ledger)),
        **({"left": left} if left else {}),
        "uninstall_exit": uninstall_exit,
        **where_in_the_restarts(rollout, seconds, text, p99s["steady"], args.spacing),
    }  # fmt: skip


def where_in_the_restarts(
    rollout: Rollout, seconds: BusySeconds, text: str, steady_p99: float | None, spacing: float
) -> dict[str, Any]:
    """Where in each restart's slot the rollout's exposure falls: the windows over the waterline by their start,
    seconds after the restart's first step, and per second of the slot the probe's units later than the steady
    p99 (summed over the restarts); beside them each new daemon's CPU from exec to its first tick."""
    offsets = []
    for at, pct in seconds.windows:
        before = [b for b in rollout.began if b <= at < b + spacing]
        if before and pct > WATERLINE_PCT:
            offsets.append(round(at - before[-1], 1))
    late = [0] * max(1, round(spacing))
    for began in rollout.began:
        for k in range(len(late)):
            units = probe_lateness(text, round((began + k) * 1e6), round((began + k + 1) * 1e6))
            late[k] += sum(steady_p99 is not None and u > steady_p99 for u in units)
    return {
        "over_waterline_s_into_restart": sorted(offsets),
        "late_units_by_second_of_restart": late,
        "new_daemon_start_cpu_s": statistics.median(rollout.start_cpu_s) if rollout.start_cpu_s else None,
    }


def measured(
    hierarchy: rc.Hierarchy, objective: str, strategy: str, home: Path, args: argparse.Namespace
) -> dict[str, Any]:
    """One strategy on one objective, on fresh cgroups; run again (up to ``args.attempts`` times in all) when
    another nodeguard on this shared host took the node from under the run."""
    found: dict[str, Any] = {}
    for attempt in range(1, args.attempts + 1):
        wait_for_the_node(hierarchy.writable)  # another run's daemon would refuse ours
        workdir = home / f"attempt-{attempt}"
        workdir.mkdir(parents=True)
        with kubelet_node(SCENARIO, hierarchy, os.cpu_count() or 1) as node:
            try:
                return {**run_one(node, objective, strategy, workdir, args), "attempt": attempt}
            except RunFailed as failed:
                found = {"error": str(failed), "attempt": attempt}
        if "another nodeguard acts on this node" not in found["error"]:
            break
    return found


def targets(result: dict[str, Any]) -> dict[str, bool]:
    """Whether each of the issue's targets was met in this run."""
    met = {}
    for objective, found in result.get("surge", {}).items():
        if "error" in found:
            continue
        ratio = found["p99_vs_steady"]
        met[f"surge.{objective}.p99_vs_steady<={P99_TARGET}"] = ratio is not None and ratio <= P99_TARGET
        over = found["windows_over_waterline"]
        met[f"surge.{objective}.windows_over_waterline<=steady"] = over["rollout"] <= over["steady"]
    for strategy in STRATEGIES:
        for objective, found in result.get(strategy, {}).items():
            if "error" not in found:
                met[f"{strategy}.{objective}.left_after_uninstall==0"] = found["left_after_uninstall"] == 0
    return met


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--restarts", type=int, default=12)
    parser.add_argument("--spacing", type=float, default=5.0, help="seconds from one restart to the next")
    parser.add_argument(
        "--steady", type=float, default=None, help="the steady window, seconds (default: as long as the rollout)"
    )
    parser.add_argument("--warmup", type=float, default=10.0, help="seconds from the first tick to the steady window")
    parser.add_argument("--tick", type=float, default=DAEMON_TICK, help="the daemons' tickSeconds (default 1 s)")
    parser.add_argument("--keep", metavar="DIR", help="keep the daemons' logs, ledgers and probe output in DIR")
    parser.add_argument(
        "--unconfined",
        action="store_true",
        help="run the daemons in this script's cgroup, not in a 500m group as the DaemonSet's pod",
    )
    parser.add_argument("--objective", action="append", choices=list(OBJECTIVES), help="default: both")
    parser.add_argument("--strategy", action="append", choices=list(STRATEGIES), help="default: both")
    parser.add_argument(
        "--attempts",
        type=int,
        default=3,
        help="runs of a strategy in all when another nodeguard on the host takes the node (default 3)",
    )
    args = parser.parse_args()
    if args.steady is None:
        args.steady = args.restarts * args.spacing
    hierarchy = host_v1()
    if isinstance(hierarchy, str):
        print(json.dumps({"error": hierarchy}))
        return 1
    result: dict[str, Any] = {"cgroup": "v1", "scenario": SCENARIO, "daemon_tick_s": args.tick,
                              "restarts": args.restarts, "spacing_s": args.spacing, "steady_s": args.steady,
                              "load_before": load()}  # fmt: skip
    started = time.monotonic()
    with contextlib.ExitStack() as stack:
        tmp = args.keep or stack.enter_context(tempfile.TemporaryDirectory(prefix="ngrollout-"))
        for strategy in args.strategy or STRATEGIES:
            for objective in args.objective or list(OBJECTIVES):
                found = measured(hierarchy, objective, strategy, Path(tmp) / f"{strategy}-{objective}", args)
                result.setdefault(strategy, {})[objective] = found
                print(f"{strategy:12} {objective:10} {json.dumps(found)}  load={load()}", flush=True)
    result["targets_met"] = targets(result)
    result["load_after"] = load()
    result["seconds"] = round(time.monotonic() - started)
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    stop_cleanly_on_sigterm()
    raise SystemExit(main())
