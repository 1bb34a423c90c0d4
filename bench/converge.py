"""Benchmark: how three throttling strategies converge on a real cgroup v2 kernel, and the daemon's own cost.

Part 1 runs inside the QEMU VM (tests/kernel/vm.py: a stock kernel with cgroup v2
and cpu.max). One important duty-cycled workload (wants 0.5 core) shares the 2
vCPUs with six best-effort batch workloads that each want 0.3 core (2.3 cores
asked of 2); the waterline is 70 % of the node.
The same mix is run under three strategies, each with fresh cgroups:

- nodeguard: the precise planner (nodeguard.policy.planner.plan);
- throttle_all: every candidate down to the quota floor at once (crane's
  behaviour when a metric is not quantified);
- fixed_step: every candidate's quota lowered by 10 % per tick while over the
  waterline (crane's step).

Per strategy: ticks until node CPU is under the waterline, workloads touched,
capacity lost below the waterline (% of the node, mean of the last ticks), and
the important workload's CPU share (cores it got / cores it wanted).

Part 2 runs on the host: the real daemon (`nodeguard run`) watching 200
cgroups for 20 s at 1 s ticks; its CPU time per tick as % of one core, and its
peak RSS, beside a bare Python interpreter's RSS measured in the same run.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from nodeguard.actuators.cgroup_writer import CgroupWriter  # noqa: E402
from nodeguard.actuators.cpu_quota import QuotaWriter  # noqa: E402
from nodeguard.config import Settings  # noqa: E402
from nodeguard.daemon import Daemon  # noqa: E402
from nodeguard.model.samples import CpuMax  # noqa: E402
from nodeguard.model.snapshot import Snapshot  # noqa: E402
from nodeguard.sources.sensor import Sensor  # noqa: E402
from tests import realcgroups as rc  # noqa: E402
from tests.workloads import start_duty_cycle  # noqa: E402

TICK = 0.5
TICKS = 14
BURNERS = 6
BURNER_WANTS = 0.3
IMPORTANT_WANTS = 0.5
WATERLINE_PCT = 70.0
FLOOR_CORES = 0.05
STEP = 0.10
UNLIMITED = CpuMax(None, 100000)

Strategy = Callable[[Snapshot, dict[str, CpuMax], float], dict[str, CpuMax]]


def settings_for(parent: str) -> Settings:
    return Settings.model_validate({
        "sensing": {"cgroupRoot": "/sys/fs/cgroup", "tickSeconds": TICK, "kubepods": False, "discoverySeconds": 3600},
        "workloads": {"groups": [
            {"match": f"{parent}/be-*", "class": "BestEffort"},
            {"match": f"{parent}/important", "class": "Guaranteed", "priority": 1000, "protected": True},
        ]},
        "guard": {"objectives": [{"metric": "cpu_total_utilization", "action": "throttle", "triggerAfter": 1,
                                  "threshold": WATERLINE_PCT, "restoreBelow": WATERLINE_PCT - 20}],
                  "minQuotaCores": FLOOR_CORES},
    })


def candidates(snapshot: Snapshot) -> list[str]:
    return sorted(wid for wid in snapshot.workloads if "/be-" in wid)


def throttle_all(snapshot: Snapshot, quotas: dict[str, CpuMax], waterline: float) -> dict[str, CpuMax]:
    if (snapshot.node.cores_used or 0) <= waterline:
        return {}
    return {wid: CpuMax(round(FLOOR_CORES * 100000), 100000) for wid in candidates(snapshot)}


def fixed_step(snapshot: Snapshot, quotas: dict[str, CpuMax], waterline: float) -> dict[str, CpuMax]:
    if (snapshot.node.cores_used or 0) <= waterline:
        return {}
    changes = {}
    for wid in candidates(snapshot):
        usage = snapshot.workloads[wid]
        current = quotas.get(wid)
        base = current.cores if current is not None and current.cores is not None else (usage.cores or 0.0)
        changes[wid] = CpuMax(max(1000, round(max(FLOOR_CORES, base * (1 - STEP)) * 100000)), 100000)
    return changes


def run_strategy(name: str) -> dict[str, Any]:
    mount = rc.v2_mount()
    assert mount is not None
    parent = rc.unique_name("ngbench")
    names = ["important", *[f"be-{i}" for i in range(BURNERS)]]
    with rc.cgroups(mount / parent):
        (mount / parent / "cgroup.subtree_control").write_text("+cpu")
        with rc.cgroups(*[mount / parent / n for n in names]):
            procs = [start_duty_cycle(IMPORTANT_WANTS, mount / parent / "important")]
            procs += [start_duty_cycle(BURNER_WANTS, mount / parent / n) for n in names[1:]]
            settings = settings_for(parent)
            # nodeguard runs as the daemon does (its tick: sense, plan, act, rebase);
            # the other strategies get the same sensor and quota writer.
            with tempfile.TemporaryDirectory() as run_dir:
                settings = settings.model_copy(update={"actuation": settings.actuation.model_copy(
                    update={"ledger_path": f"{run_dir}/ledger.json"})})
                daemon = Daemon(settings) if name == "nodeguard" else None
                sensor = daemon.sensor if daemon is not None else Sensor(settings)
                quota = QuotaWriter(CgroupWriter(str(mount)), "v2")
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
                            touched |= set(daemon.state.throttles)
                        else:
                            snapshot = sensor.sense()
                            changes = (throttle_all if name == "throttle_all" else fixed_step)(
                                snapshot, quotas, waterline)
                            for wid, limit in changes.items():
                                quota.apply(wid, limit)
                                quotas[wid] = limit
                                touched.add(wid)
                        node_cores.append(snapshot.node.cores_used or 0.0)
                        important.append(snapshot.workloads[f"{parent}/important"].cores or 0.0)
                finally:
                    if daemon is not None:
                        daemon.stop()
                    else:
                        sensor.close()
                    for proc in procs:
                        rc.stop(proc)
    first_action = 0
    under = next((i - first_action for i, cores in enumerate(node_cores) if i > 0 and cores < waterline), None)
    tail = node_cores[-4:]
    lost = statistics.mean(max(0.0, waterline - c) for c in tail) / cpus * 100
    return {
        "ticks_to_waterline": under,
        "workloads_touched": len(touched),
        "capacity_lost_pct": round(lost, 1),
        "important_cpu_share": round(statistics.mean(important[-4:]) / IMPORTANT_WANTS, 2),
        "node_cores_per_tick": [round(c, 2) for c in node_cores],
    }


def in_vm() -> dict[str, Any]:
    return {name: run_strategy(name) for name in ("nodeguard", "throttle_all", "fixed_step")}


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
        config.write_text(json.dumps({"global": {
            "sensing": {"cgroupRoot": str(mount), "cgroupVersion": "v2", "tickSeconds": 1.0, "kubepods": False},
            "workloads": {"groups": [{"match": f"{parent}/*", "class": "BestEffort"}]},
            "guard": {"objectives": [{"metric": "cpu_total_usage", "action": "throttle", "threshold": "99%",
                                      "restoreBelow": "90%"}]},
            "actuation": {"ledgerPath": f"{tmp}/run/ledger.json"},
            "http": {"listen": "127.0.0.1:0"},
            "gate": {"socket": f"{tmp}/run/gate.sock"},
        }}))
        bare = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(3)"])
        daemon = subprocess.Popen([sys.executable, "-m", "nodeguard", "run", "--config", str(config)],
                                  stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=REPO)
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
    if "--in-vm" in sys.argv:
        result = in_vm()
        Path(os.environ["NODEGUARD_VM_OUT"], "converge.json").write_text(json.dumps(result))
        print(json.dumps(result))
        return 0
    from tests.kernel.vm import run_in_vm, vm_available

    reason = vm_available() or rc.why_no_v2()
    if reason:
        print(json.dumps({"error": reason}))
        return 1
    with tempfile.TemporaryDirectory() as out:
        result = run_in_vm([sys.executable, str(Path(__file__).resolve()), "--in-vm"], cwd=str(REPO),
                           out_dir=Path(out), timeout=900)
        if result.exit_code != 0:
            print(result.console[-3000:])
            print(json.dumps({"error": f"VM run failed with {result.exit_code}"}))
            return 1
        strategies = json.loads((Path(out) / "converge.json").read_text())
    for name, figures in strategies.items():
        print(f"{name:13} {figures}")
    cost = daemon_cost()
    print(f"daemon with {cost['daemon_workloads']} workloads: {cost}")
    summary = {"strategies": {n: {k: v for k, v in f.items() if k != "node_cores_per_tick"} for n, f in strategies.items()},
               **{k: v for k, v in cost.items() if k != "daemon_workloads"}}
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
