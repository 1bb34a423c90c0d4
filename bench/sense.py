"""Benchmark: nodeguard's full sense pass against a bare pread floor on the same files.

Builds N real (idle) cgroups in this machine's cgroup2 mount, then times
- nodeguard: Sensor.sense() (reading, parsing, rates, the Snapshot), discovery
  excluded (it runs every discoverySeconds, timed on its own below), as the
  daemon's tick runs it without a memory objective: memory.high and
  memory.pressure not followed; at 1,000 cgroups once more with them followed;
- floor: a bare loop of os.pread on kept-open descriptors of the same files
  (a sense pass is counted making exactly the floor's reads, or the bench fails).

Then what the protected_cpu_stall signal adds to a tick. On v2 its stall is
the ``cpu.pressure`` the sense pass reads already; on v1 it is the threads'
run-queue waits, which the sensor follows for every active workload anyway
(elastic demand). What it adds on both is each active workload's containers'
own throttled time (their ``cpu.stat``, taken off the stall): from
bench/taskwait.py's kubelet-shaped pod on v1 (where this machine has the cpu
hierarchy), ``active_pod_follow_us`` (following one pod's threads and
containers a tick), ``stall_added_us_per_active_pod`` (its containers'
throttled time), and that against this run's per-cgroup sense cost
(``stall_added_in_cgroups``: how many idle cgroups' sensing it costs).
Prints one JSON object last.
"""

from __future__ import annotations

import importlib.util
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import rc, stop_cleanly_on_sigterm
from nodeguard.config import Settings
from nodeguard.sources.readers import V2Reader
from nodeguard.sources.sensor import Sensor

PER_TICK_FILES = ("cpu.stat", "cpu.max", "cpu.pressure", "memory.current")
MEMORY_FILES = ("memory.high", "memory.pressure")  # read each tick only while memory is followed
NODE_FILES = ("stat", "loadavg", "meminfo", "pressure/cpu", "pressure/memory", "pressure/io")
NODE_READ_SIZES = {"stat": 512, "meminfo": 16384}
PASSES = 30


def floor_pass(fds: list[int], node_fds: list[tuple[int, int]]) -> None:
    pread = os.pread
    for fd, size in node_fds:
        pread(fd, size, 0)
    for fd in fds:
        pread(fd, 4096, 0)


def files_read(sense: Callable[[], object]) -> list[str]:
    """The path of every file one sense pass reads (each os.pread call), sorted."""
    real = os.pread
    fds: list[int] = []

    def recording(fd: int, size: int, offset: int) -> bytes:
        fds.append(fd)
        return real(fd, size, offset)

    os.pread = recording
    try:
        sense()
    finally:
        os.pread = real
    return sorted(os.readlink(f"/proc/self/fd/{fd}") for fd in fds)


def measure(mount: Path, count: int, reuse_unchanged: bool = True, memory: bool = False) -> dict[str, float]:
    parent = mount / rc.unique_name("ngbench")
    groups = [parent / f"w{i:05d}" for i in range(count)]
    with rc.cgroups(*groups):
        settings = Settings.model_validate(
            {
                "sensing": {"cgroupRoot": str(mount), "cgroupVersion": "v2", "discoverySeconds": 3600},
                "workloads": {"groups": [{"match": f"{parent.name}/*"}]},
            }
        )
        sensor = Sensor(settings)
        sensor.follow_memory(memory)
        V2Reader.reuse_unchanged = reuse_unchanged
        start = time.perf_counter()
        sensor.rediscover()
        discovery = time.perf_counter() - start
        names = PER_TICK_FILES + MEMORY_FILES if memory else PER_TICK_FILES
        fds = [os.open(g / name, os.O_RDONLY) for g in groups for name in names if (g / name).exists()]
        node_fds = [
            (os.open(f"/proc/{n}", os.O_RDONLY), NODE_READ_SIZES.get(n, 4096))
            for n in NODE_FILES
            if os.path.exists(f"/proc/{n}")
        ]
        try:
            sensor.sense()  # first sight and the first rates: each workload's threads are looked at until it reads idle
            sensor.sense()
            floor_files = sorted(os.readlink(f"/proc/self/fd/{fd}") for fd in fds + [fd for fd, _ in node_fds])
            read = files_read(sensor.sense)
            differ = sorted(set(read) ^ set(floor_files))  # none: the same files, read more or fewer times
            assert read == floor_files, f"a sense pass reads other files than its floor ({len(differ)}: {differ[:3]})"
            ours, floor = [], []
            for _ in range(PASSES):  # interleaved, so both see the same machine state
                t0 = time.perf_counter()
                snapshot = sensor.sense()
                t1 = time.perf_counter()
                floor_pass(fds, node_fds)
                t2 = time.perf_counter()
                ours.append(t1 - t0)
                floor.append(t2 - t1)
            assert len(snapshot.workloads) == count, len(snapshot.workloads)
        finally:
            V2Reader.reuse_unchanged = True
            sensor.close()
            for fd, _ in node_fds:
                os.close(fd)
            for fd in fds:
                os.close(fd)
    files_per_cgroup = len(fds) / count
    ours_us = statistics.median(ours) / count * 1e6
    floor_us = statistics.median(floor) / count * 1e6
    return {
        "cgroups": count,
        "files_per_cgroup": files_per_cgroup,
        "nodeguard_us_per_cgroup": round(ours_us, 2),
        "floor_us_per_cgroup": round(floor_us, 2),
        "ratio": round(ours_us / floor_us, 2),
        "discovery_us_per_cgroup": round(discovery / count * 1e6, 2),
    }


def stall_costs(per_cgroup_us: float) -> dict[str, float]:
    """bench/taskwait.py's costs of following one active pod, beside this run's per-cgroup sense cost."""
    spec = importlib.util.spec_from_file_location("taskwait_bench", Path(__file__).with_name("taskwait.py"))
    assert spec is not None and spec.loader is not None
    taskwait = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(taskwait)
    found: dict[str, float] = taskwait.pod_costs()
    if not found:
        return {}
    return {
        "active_pod_follow_us": found["pod_sample_us"],
        "stall_added_us_per_active_pod": found["pod_descendants_throttled_us"],
        "stall_added_in_cgroups": round(found["pod_descendants_throttled_us"] / per_cgroup_us, 1),
    }


def main() -> int:
    reason = rc.why_no_v2()
    if reason:
        print(json.dumps({"error": reason}))
        return 1
    mount = rc.v2_mount()
    assert mount is not None
    results = [measure(mount, count) for count in (100, 1000)]
    # These cgroups are idle, so every file is unchanged between passes and the
    # reader reuses its last parse; measure the parse of every file too.
    parsed = measure(mount, 1000, reuse_unchanged=False)
    print(
        f" 1000 cgroups, parsing every file: nodeguard {parsed['nodeguard_us_per_cgroup']} us/cgroup, "
        f"floor {parsed['floor_us_per_cgroup']} us/cgroup, ratio {parsed['ratio']}"
    )
    # A memory objective or a held memory.high: memory.high and memory.pressure are read each tick too.
    memory = measure(mount, 1000, memory=True)
    print(
        f" 1000 cgroups, memory followed: nodeguard {memory['nodeguard_us_per_cgroup']} us/cgroup, "
        f"floor {memory['floor_us_per_cgroup']} us/cgroup, ratio {memory['ratio']} "
        f"({memory['files_per_cgroup']:.0f} files/cgroup)"
    )
    for result in results:
        print(
            f"{result['cgroups']:>5} cgroups: nodeguard {result['nodeguard_us_per_cgroup']} us/cgroup, "
            f"floor {result['floor_us_per_cgroup']} us/cgroup, ratio {result['ratio']} "
            f"({result['files_per_cgroup']:.0f} files/cgroup; discovery {result['discovery_us_per_cgroup']} us/cgroup)"
        )
    last = results[-1]
    stall = stall_costs(last["nodeguard_us_per_cgroup"])
    if stall:
        print(
            f"protected_cpu_stall adds {stall['stall_added_us_per_active_pod']} us a tick per active pod "
            f"(= {stall['stall_added_in_cgroups']} idle cgroups' sensing; following the pod: "
            f"{stall['active_pod_follow_us']} us)"
        )
    print(
        json.dumps(
            {
                **last,
                "ratio_parsing_every_file": parsed["ratio"],
                "nodeguard_us_per_cgroup_parsing_every_file": parsed["nodeguard_us_per_cgroup"],
                "ratio_memory_followed": memory["ratio"],
                "nodeguard_us_per_cgroup_memory_followed": memory["nodeguard_us_per_cgroup"],
                "at_100": results[0],
                **stall,
            }
        )
    )
    return 0


if __name__ == "__main__":
    stop_cleanly_on_sigterm()
    raise SystemExit(main())
