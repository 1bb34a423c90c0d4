"""Benchmark: two ways to read how long a workload's threads waited to run, per thread read.

- schedstat: ``/proc/<tid>/schedstat`` through a kept-open descriptor (what
  ``nodeguard.sources.taskwait`` does), one ``os.pread`` and a split;
- taskstats: the kernel's per-task delay accounting over netlink
  (``TASKSTATS_CMD_GET`` for one pid), through pyroute2's ``TaskStats``,
  ``cpu_delay_total`` from the reply.

Both give the run-queue delay in nanoseconds; the cheaper one is what the
sensor uses. Runs on the host against the benchmark's own threads.

Then what following one kubelet-shaped pod costs per tick where the machine
has the v1 cpu hierarchy (pod, container and crun's subgroup, a process of 4
threads in it): a whole ``TaskWait.sample()``, and within it the descendants'
own throttled time (their ``cpu.stat``), which the protected stall takes off.
Last line: ``{"threads": N, "schedstat_us_per_thread": ..., "taskstats_us_per_thread": ..., "ratio": ...,
"pod_sample_us": ..., "pod_descendants_throttled_us": ...}``.
Needs pyroute2 (``pip install pyroute2``; not a runtime dependency of nodeguard).
"""

from __future__ import annotations

import json
import os
import sys
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

THREADS = 64
ROUNDS = 200


def pod_costs() -> dict[str, float]:
    """Per-tick cost of following one kubelet-shaped pod on v1; {} where this machine has no v1 cpu hierarchy."""
    from bench.common import rc
    from nodeguard.sources.taskwait import TaskWait, subtree

    if rc.why_no_v1_cpu():
        return {}
    cpu, cpuacct = rc.v1_hierarchy("cpu"), rc.v1_hierarchy("cpuacct")
    assert cpu is not None and cpuacct is not None
    hierarchy = rc.Hierarchy("v1", [cpu] if cpu == cpuacct else [cpu, cpuacct])
    code = "import threading, time\nfor _ in range(3): threading.Thread(target=time.sleep, args=(60,)).start()\ntime.sleep(60)"
    with rc.kubelet_pod(hierarchy, rc.unique_name("ngbench"), "burstable", None) as pod:
        import subprocess

        proc = subprocess.Popen([sys.executable, "-c", code])
        try:
            for group in hierarchy.dirs(pod.inner):
                (group / "cgroup.procs").write_text(str(proc.pid))
            time.sleep(0.2)
            wait = TaskWait(subtree(str(hierarchy.writable / pod.pod)))
            wait.sample()
            start = time.perf_counter()
            for _ in range(ROUNDS):
                wait.sample()
            whole = (time.perf_counter() - start) / ROUNDS * 1e6
            start = time.perf_counter()
            for _ in range(ROUNDS):
                wait._descendants_throttled()
            descendants = (time.perf_counter() - start) / ROUNDS * 1e6
            wait.close()
        finally:
            rc.stop(proc)
    return {"pod_sample_us": round(whole, 1), "pod_descendants_throttled_us": round(descendants, 1)}


def main() -> int:
    try:
        from pyroute2 import TaskStats
    except ImportError:
        print(json.dumps({"error": "pyroute2 is not installed: pip install pyroute2"}))
        return 1
    stop = threading.Event()
    workers = [threading.Thread(target=stop.wait, daemon=True) for _ in range(THREADS - 1)]
    for worker in workers:
        worker.start()
    tids = [int(t) for t in os.listdir(f"/proc/{os.getpid()}/task")]

    # The per-thread read alone, as nodeguard.sources.taskwait does it.
    descriptors = {tid: os.open(f"/proc/{tid}/schedstat", os.O_RDONLY | os.O_CLOEXEC) for tid in tids}
    start = time.perf_counter()
    for _ in range(ROUNDS):
        for fd in descriptors.values():
            int(os.pread(fd, 128, 0).split()[1])
    schedstat = (time.perf_counter() - start) / (ROUNDS * len(tids)) * 1e6
    for fd in descriptors.values():
        os.close(fd)

    stats = TaskStats()
    stats.bind()
    start = time.perf_counter()
    rounds = ROUNDS // 10  # an order of magnitude slower: fewer rounds for the same wall time
    for _ in range(rounds):
        for tid in tids:
            reply = stats.get_pid_stat(tid)[0]
            aggregate = reply.get_attr("TASKSTATS_TYPE_AGGR_PID")
            aggregate.get_attr("TASKSTATS_TYPE_STATS")["cpu_delay_total"]
    taskstats = (time.perf_counter() - start) / (rounds * len(tids)) * 1e6
    stats.close()
    stop.set()
    print(
        f"schedstat (kept-open pread): {schedstat:.2f} µs/thread; taskstats (netlink via pyroute2): {taskstats:.2f} µs/thread"
    )
    pod = pod_costs()
    if pod:
        print(
            f"one kubelet-shaped pod (3 cgroups, 4 threads) per tick: {pod['pod_sample_us']} µs, of which the "
            f"descendants' throttled time {pod['pod_descendants_throttled_us']} µs"
        )
    print(
        json.dumps(
            {
                "threads": len(tids),
                "schedstat_us_per_thread": round(schedstat, 2),
                "taskstats_us_per_thread": round(taskstats, 2),
                "ratio": round(taskstats / schedstat, 1),
                **pod,
            }
        )
    )
    return 0


if __name__ == "__main__":
    from bench.common import stop_cleanly_on_sigterm

    stop_cleanly_on_sigterm()
    raise SystemExit(main())
