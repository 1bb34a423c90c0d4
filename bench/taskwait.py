"""Benchmark: two ways to read how long a workload's threads waited to run, per thread read.

- schedstat: ``/proc/<tid>/schedstat`` through a kept-open descriptor (what
  ``nodeguard.sources.taskwait`` does), one ``os.pread`` and a split;
- taskstats: the kernel's per-task delay accounting over netlink
  (``TASKSTATS_CMD_GET`` for one pid), through pyroute2's ``TaskStats``,
  ``cpu_delay_total`` from the reply.

Both give the run-queue delay in nanoseconds; the cheaper one is what the
sensor uses. Runs on the host against the benchmark's own threads. Last line:
``{"threads": N, "schedstat_us_per_thread": ..., "taskstats_us_per_thread": ..., "ratio": ...}``.
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
    print(f"schedstat (kept-open pread): {schedstat:.2f} µs/thread; taskstats (netlink via pyroute2): {taskstats:.2f} µs/thread")
    print(json.dumps({
        "threads": len(tids),
        "schedstat_us_per_thread": round(schedstat, 2),
        "taskstats_us_per_thread": round(taskstats, 2),
        "ratio": round(taskstats / schedstat, 1),
    }))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
