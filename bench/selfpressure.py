"""Measurement: how much node-level CPU pressure nodeguard's own throttles cause, on a real cgroup v2 kernel.

CFS bandwidth throttling leaves a throttled task runnable, so PSI counts its
wait as CPU pressure, in its cgroup and in every ancestor up to the node's
``/proc/pressure/cpu``. A throttle objective on node-level ``cpu_pressure``
would then feed on itself. Runs inside the QEMU VM (2 vCPUs, cgroup v2 only)
and reports, for each case, the node's PSI "some" share over a few seconds
(from the ``total`` counter, in % of the time) and node CPU use:

- idle: nothing added;
- one_busy: one busy loop, unthrottled (1 of 2 CPUs busy: nothing waits);
- one_busy_throttled: the same busy loop with cpu.max at 20 % of a core;
- two_busy_throttled: two busy loops, each in its own cgroup at 20 %.

The last JSON line: ``{"cases": {name: {"node_some_pct": ..., "node_cores": ...}}}``.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.common import rc, run_in_vm, stop_cleanly_on_sigterm, vm_available  # noqa: E402
from nodeguard.model.samples import CpuMax  # noqa: E402
from nodeguard.sources.procfs import parse_proc_stat_cpu  # noqa: E402
from nodeguard.sources.readers import count_cpus  # noqa: E402

SECONDS = 4.0
THROTTLED = CpuMax(20000, 100000)


def node_some_usec() -> int:
    for line in Path("/proc/pressure/cpu").read_text().splitlines():
        if line.startswith("some "):
            return int(line.rsplit("total=", 1)[1])
    raise RuntimeError("no 'some' line in /proc/pressure/cpu")


def busy_ticks() -> tuple[int, int]:
    cpu = parse_proc_stat_cpu(Path("/proc/stat").read_text())
    return cpu.busy, cpu.total


def measure() -> dict[str, float]:
    some0, (busy0, total0), t0 = node_some_usec(), busy_ticks(), time.monotonic()
    time.sleep(SECONDS)
    some1, (busy1, total1), t1 = node_some_usec(), busy_ticks(), time.monotonic()
    cpus = count_cpus(Path("/proc/stat").read_text())
    return {
        "node_some_pct": round(100.0 * (some1 - some0) / ((t1 - t0) * 1e6), 1),
        "node_cores": round((busy1 - busy0) / (total1 - total0) * cpus, 2),
    }


def case(busy: int, limit: CpuMax | None) -> dict[str, float]:
    hierarchy = rc.v2_cpu_hierarchy()
    parent = rc.unique_name("ngpsi")
    names = [f"{parent}/b{i}" for i in range(busy)]
    with hierarchy.groups(parent, *names) if names else hierarchy.groups(parent):
        procs = []
        try:
            for name in names:
                if limit is not None:
                    hierarchy.set_limit(name, limit)
                procs.append(rc.start_busy(*hierarchy.dirs(name)))
            time.sleep(1.0)
            return measure()
        finally:
            for proc in procs:
                rc.stop(proc)


def in_vm() -> dict[str, dict[str, float]]:
    return {
        "idle": case(0, None),
        "one_busy": case(1, None),
        "one_busy_throttled": case(1, THROTTLED),
        "two_busy_throttled": case(2, THROTTLED),
    }


def main() -> int:
    if "--in-vm" in sys.argv:
        Path(os.environ["NODEGUARD_VM_OUT"], "selfpressure.json").write_text(json.dumps(in_vm()))
        return 0
    if reason := vm_available():
        print(json.dumps({"error": reason}))
        return 1
    with tempfile.TemporaryDirectory() as out:
        result = run_in_vm(
            [sys.executable, str(Path(__file__).resolve()), "--in-vm"], cwd=str(REPO), out_dir=Path(out), timeout=600
        )
        if result.exit_code != 0:
            print(result.console[-3000:])
            print(json.dumps({"error": f"VM run failed with {result.exit_code}"}))
            return 1
        cases = json.loads((Path(out) / "selfpressure.json").read_text())
    for name, figures in cases.items():
        print(f"{name:20} {figures}")
    print(json.dumps({"cases": cases}))
    return 0


if __name__ == "__main__":
    stop_cleanly_on_sigterm()
    raise SystemExit(main())
