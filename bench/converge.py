"""Benchmark: how three throttling strategies converge on a real cgroup v2 kernel, and the daemon's own cost.

Part 1 runs inside the QEMU VM (tests/kernel/vm.py: a stock kernel with cgroup v2
and cpu.max), in two scenarios on 2 vCPUs with the waterline at 70 % of the node:

- duty_cycle: one important duty-cycled workload (wants 0.5 core) beside six
  best-effort batch workloads that each want 0.3 core (2.3 cores asked of 2);
- elastic: pods laid out as kubelet lays them out (CPU limits of 1.5 cores at
  the pod and the container level), six Burstable burners that each want a
  whole core (throttling some lets the others expand), and a Guaranteed pod
  that wants 0.5 core.

Each is run under three strategies, each with fresh cgroups:

- nodeguard: the precise planner (nodeguard.policy.planner.plan);
- throttle_all: every candidate down to the quota floor at once (crane's
  behaviour when a metric is not quantified);
- fixed_step: every candidate's quota lowered by 10 % per tick while over the
  waterline (crane's step).

Per strategy: ticks until node CPU is under the waterline, ticks back over it
after that (oscillation), workloads touched, capacity lost below the waterline
(% of the node, mean of the last ticks), and the important workload's CPU
share (cores it got / cores it wanted). ``--runs N`` (default 5) repeats the
whole set and reports the worst figure of each.

Part 2 runs on the host: the real daemon (`nodeguard run`) watching 200
cgroups for 20 s at 1 s ticks; its CPU time per tick as % of one core, and its
peak RSS, beside a bare Python interpreter's RSS measured in the same run.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.common import rc, run_in_vm, start_duty_cycle, stop_cleanly_on_sigterm, vm_available  # noqa: E402
from nodeguard.actuators.cgroup_writer import CgroupWriter  # noqa: E402
from nodeguard.actuators.levers.cpu_quota import QuotaLever  # noqa: E402
from nodeguard.config import Settings  # noqa: E402
from nodeguard.daemon import Daemon  # noqa: E402
from nodeguard.model.samples import CpuMax  # noqa: E402
from nodeguard.model.snapshot import Snapshot  # noqa: E402
from nodeguard.policy.holds import HeldThrottle  # noqa: E402
from nodeguard.sources.sensor import Sensor  # noqa: E402

TICK = 0.5
TICKS = 14
BURNERS = 6
BURNER_WANTS = 0.3
IMPORTANT_WANTS = 0.5
WATERLINE_PCT = 70.0
FLOOR_CORES = 0.05
STEP = 0.10
UNLIMITED = CpuMax(None, 100000)
POD_LIMIT = CpuMax(150000, 100000)  # kubelet's limit on each elastic pod and its container
GUARANTEED_LIMIT = CpuMax(100000, 100000)

Strategy = Callable[[Snapshot, dict[str, CpuMax], float], dict[str, CpuMax]]


@dataclass
class Scene:
    """The cgroups of one run: which are candidates, which one is important, and the settings to guard them."""

    candidates: list[str]
    important: str
    settings: Settings


def settings_for(sensing: dict[str, Any], groups: list[dict[str, Any]]) -> Settings:
    return Settings.model_validate(
        {
            "sensing": {"cgroupRoot": "/sys/fs/cgroup", "tickSeconds": TICK, "discoverySeconds": 3600, **sensing},
            "workloads": {"groups": groups},
            "guard": {
                "objectives": [
                    {
                        "metric": "cpu_total_utilization",
                        "action": "throttle",
                        "triggerAfter": 1,
                        "threshold": WATERLINE_PCT,
                        "restoreBelow": WATERLINE_PCT - 20,
                    }
                ],
                # Aim 2 % of the node under the waterline: the room one tick's noise needs in the VM.
                "minQuotaCores": FLOOR_CORES,
                "targetMarginPercent": 1,
                # No API server: kubelet-shaped pods have no metadata, and may be acted on anyway.
                "candidates": {"podsWithoutMetadata": True},
            },
        }
    )


@contextlib.contextmanager
def duty_cycle_scene(stack: contextlib.ExitStack, procs: list[subprocess.Popen[bytes]]) -> Iterator[Scene]:
    hierarchy = rc.v2_cpu_hierarchy()
    parent = rc.unique_name("ngbench")
    names = ["important", *[f"be-{i}" for i in range(BURNERS)]]
    stack.enter_context(hierarchy.groups(*[f"{parent}/{n}" for n in names]))
    procs.append(start_duty_cycle(IMPORTANT_WANTS, *hierarchy.dirs(f"{parent}/important")))
    procs += [start_duty_cycle(BURNER_WANTS, *hierarchy.dirs(f"{parent}/{n}")) for n in names[1:]]
    yield Scene(
        [f"{parent}/{n}" for n in names[1:]],
        f"{parent}/important",
        settings_for(
            {"kubepods": False},
            [
                {"match": f"{parent}/be-*", "class": "BestEffort"},
                {"match": f"{parent}/important", "class": "Guaranteed", "priority": 1000, "protected": True},
            ],
        ),
    )


@contextlib.contextmanager
def elastic_scene(stack: contextlib.ExitStack, procs: list[subprocess.Popen[bytes]]) -> Iterator[Scene]:
    hierarchy = rc.v2_cpu_hierarchy()
    parent = rc.unique_name("ngbench")
    burners = [stack.enter_context(rc.kubelet_pod(hierarchy, parent, "burstable", POD_LIMIT)) for _ in range(BURNERS)]
    guaranteed = stack.enter_context(rc.kubelet_pod(hierarchy, parent, None, GUARANTEED_LIMIT))
    procs.append(start_duty_cycle(IMPORTANT_WANTS, *hierarchy.dirs(guaranteed.inner)))
    procs += [pod.start_busy() for pod in burners]
    yield Scene(
        [pod.pod for pod in burners],
        guaranteed.pod,
        settings_for({"kubepodsPaths": [f"{parent}/kubepods"]}, []),
    )


SCENES = {"duty_cycle": duty_cycle_scene, "elastic": elastic_scene}


def throttle_all(scene: Scene, snapshot: Snapshot, quotas: dict[str, CpuMax], waterline: float) -> dict[str, CpuMax]:
    if (snapshot.node.cores_used or 0) <= waterline:
        return {}
    return {wid: CpuMax(round(FLOOR_CORES * 100000), 100000) for wid in scene.candidates}


def fixed_step(scene: Scene, snapshot: Snapshot, quotas: dict[str, CpuMax], waterline: float) -> dict[str, CpuMax]:
    if (snapshot.node.cores_used or 0) <= waterline:
        return {}
    changes = {}
    for wid in scene.candidates:
        usage = snapshot.workloads[wid]
        current = quotas.get(wid)
        base = current.cores if current is not None and current.cores is not None else (usage.cores or 0.0)
        changes[wid] = CpuMax(max(1000, round(max(FLOOR_CORES, base * (1 - STEP)) * 100000)), 100000)
    return changes


def run_strategy(scene_name: str, name: str) -> dict[str, Any]:
    procs: list[subprocess.Popen[bytes]] = []
    # nodeguard runs as the daemon does (its tick: sense, plan, act, rebase);
    # the other strategies get the same sensor and quota writer.
    with (
        contextlib.ExitStack() as stack,
        SCENES[scene_name](stack, procs) as scene,
        tempfile.TemporaryDirectory() as run_dir,
    ):
        settings = scene.settings.model_copy(
            update={"actuation": scene.settings.actuation.model_copy(update={"ledger_path": f"{run_dir}/ledger.json"})}
        )
        daemon = Daemon(settings) if name == "nodeguard" else None
        sensor = daemon.sensor if daemon is not None else Sensor(settings)
        quota = QuotaLever(CgroupWriter(sensor.layout.writable), "v2")
        waterline = WATERLINE_PCT / 100 * sensor.node.cpus
        cpus = sensor.node.cpus
        quotas: dict[str, CpuMax] = {}
        touched: set[str] = set()
        node_cores: list[float] = []
        important: list[float] = []
        try:
            sensor.sense()
            time.sleep(2.0)  # warm up: the burners reach their fair share
            if daemon is None:
                sensor.sense()
            for _ in range(TICKS):
                time.sleep(TICK)
                if daemon is not None:
                    daemon.tick()
                    snapshot = daemon.last_snapshot
                    assert snapshot is not None
                    touched |= set(daemon.state.held(HeldThrottle))
                else:
                    snapshot = sensor.sense()
                    strategy = throttle_all if name == "throttle_all" else fixed_step
                    for wid, limit in strategy(scene, snapshot, quotas, waterline).items():
                        quota.apply(wid, limit)
                        quotas[wid] = limit
                        touched.add(wid)
                node_cores.append(snapshot.node.cores_used or 0.0)
                important.append(snapshot.workloads[scene.important].cores or 0.0)
        finally:
            if daemon is not None:
                daemon.stop()
            else:
                sensor.close()
            for proc in procs:
                rc.stop(proc)
    under = next((i for i, cores in enumerate(node_cores) if i > 0 and cores < waterline), None)
    over_after = 0 if under is None else sum(1 for cores in node_cores[under:] if cores >= waterline)
    tail = node_cores[-4:]
    lost = statistics.mean(max(0.0, waterline - c) for c in tail) / cpus * 100
    return {
        "ticks_to_waterline": under,
        "ticks_over_after": over_after,
        "workloads_touched": len(touched),
        "capacity_lost_pct": round(lost, 1),
        "important_cpu_share": round(statistics.mean(important[-4:]) / IMPORTANT_WANTS, 2),
        "node_cores_per_tick": [round(c, 2) for c in node_cores],
    }


STRATEGIES = ("nodeguard", "throttle_all", "fixed_step")


def worst(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """The worst of each figure over the runs (None ticks: never got under, the worst of all)."""
    ticks = [r["ticks_to_waterline"] for r in runs]
    return {
        "ticks_to_waterline": None if None in ticks else max(ticks),
        "ticks_over_after": max(r["ticks_over_after"] for r in runs),
        "workloads_touched": max(r["workloads_touched"] for r in runs),
        "capacity_lost_pct": max(r["capacity_lost_pct"] for r in runs),
        "important_cpu_share": min(r["important_cpu_share"] for r in runs),
        "runs": len(runs),
    }


def in_vm(runs: int) -> dict[str, Any]:
    results: dict[str, Any] = {}
    for scene in SCENES:
        per_strategy: dict[str, list[dict[str, Any]]] = {name: [] for name in STRATEGIES}
        for _ in range(runs):
            for name in STRATEGIES:
                per_strategy[name].append(run_strategy(scene, name))
        results[scene] = per_strategy
    return results


def proc_cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def peak_rss_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    return 0.0


def daemon_cost(workloads: int = 200, seconds: float = 20.0) -> dict[str, float]:
    mount = rc.v2_mount()
    assert mount is not None
    parent = rc.unique_name("ngbench")
    with tempfile.TemporaryDirectory() as tmp, rc.cgroups(*[mount / parent / f"w{i:03d}" for i in range(workloads)]):
        config = Path(tmp) / "config.json"
        config.write_text(
            json.dumps(
                {
                    "global": {
                        "sensing": {
                            "cgroupRoot": str(mount),
                            "cgroupVersion": "v2",
                            "tickSeconds": 1.0,
                            "kubepods": False,
                        },
                        "workloads": {"groups": [{"match": f"{parent}/*", "class": "BestEffort"}]},
                        "guard": {
                            "objectives": [
                                {
                                    "metric": "cpu_total_usage",
                                    "action": "throttle",
                                    "threshold": "99%",
                                    "restoreBelow": "90%",
                                }
                            ]
                        },
                        "actuation": {"ledgerPath": f"{tmp}/run/ledger.json"},
                        "http": {"listen": "127.0.0.1:0"},
                        "gate": {"socket": f"{tmp}/run/gate.sock"},
                    }
                }
            )
        )
        bare = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(3)"])
        daemon = subprocess.Popen(
            [sys.executable, "-m", "nodeguard", "run", "--config", str(config)],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            cwd=REPO,
        )
        try:
            time.sleep(1.0)
            bare_rss = peak_rss_mb(bare.pid)
            time.sleep(2.0)  # past start-up and the first discovery
            cpu0, t0 = proc_cpu_seconds(daemon.pid), time.monotonic()
            time.sleep(seconds)
            cpu1, t1 = proc_cpu_seconds(daemon.pid), time.monotonic()
            rss = peak_rss_mb(daemon.pid)
        finally:
            daemon.terminate()
            daemon.wait(10)
            bare.wait()
    return {
        "daemon_cpu_pct_of_core": round((cpu1 - cpu0) / (t1 - t0) * 100, 2),
        "daemon_rss_mb": round(rss, 1),
        "bare_python_rss_mb": round(bare_rss, 1),
        "daemon_workloads": workloads,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=5, help="repeat each scenario and strategy; report the worst")
    parser.add_argument("--in-vm", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.in_vm:
        result = in_vm(args.runs)
        Path(os.environ["NODEGUARD_VM_OUT"], "converge.json").write_text(json.dumps(result))
        return 0
    reason = vm_available() or rc.why_no_v2()
    if reason:
        print(json.dumps({"error": reason}))
        return 1
    with tempfile.TemporaryDirectory() as out:
        result = run_in_vm(
            [sys.executable, str(Path(__file__).resolve()), "--in-vm", "--runs", str(args.runs)],
            cwd=str(REPO),
            out_dir=Path(out),
            timeout=600 + 300 * args.runs,
        )
        if result.exit_code != 0:
            print(result.console[-3000:])
            print(json.dumps({"error": f"VM run failed with {result.exit_code}"}))
            return 1
        scenes = json.loads((Path(out) / "converge.json").read_text())
    for scene, strategies in scenes.items():
        for name, runs in strategies.items():
            for run in runs:
                print(f"{scene:10} {name:13} {run}")
    cost = daemon_cost()
    print(f"daemon with {cost['daemon_workloads']} workloads: {cost}")
    summary = {
        "strategies": {n: worst(r) for n, r in scenes["duty_cycle"].items()},
        "strategies_elastic": {n: worst(r) for n, r in scenes["elastic"].items()},
        **{k: v for k, v in cost.items() if k != "daemon_workloads"},
    }
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    stop_cleanly_on_sigterm()
    raise SystemExit(main())
