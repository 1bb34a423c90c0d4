"""Benchmark: one guard plan for a node with 1000 workloads and three objectives.

The node is past all three waterlines (cpu_total_usage throttle, memory
evict, load_average throttle) with primed streaks, so every run sorts the
candidates and acts: the worst case of a tick. Also times a calm tick (no
gap: nothing to sort), and, as a baseline measured in the same run, a plain
``sorted()`` of the 1000 workloads by one key. Medians of repeated runs.
Prints one JSON object last.
"""

from __future__ import annotations

import json
import random
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from types import MappingProxyType

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from nodeguard.model.samples import CpuMax, CpuStat, LoadAverage, MemInfo, ProcStatCpu, Psi, PsiLine
from nodeguard.model.snapshot import NodeUsage, Snapshot, WorkloadUsage
from nodeguard.model.workloads import QosClass, Workload
from nodeguard.policy.planner import plan
from nodeguard.policy.settings import GuardSettings
from nodeguard.policy.state import GuardState

WORKLOADS = 1000
RUNS = 300
CPUS = 64
GIB = 1 << 30


def workloads(count: int, rnd: random.Random) -> list[WorkloadUsage]:
    usages = []
    for i in range(count):
        workload = Workload(
            id=f"kubepods.slice/kubepods-pod{i:04d}.slice",
            name=f"pod-{i}",
            kind="pod",
            qos_class=rnd.choice(list(QosClass)),
            priority=rnd.choice([0, 0, 0, 100, 1000]),
            started_at=1_700_000_000.0 + rnd.uniform(0, 86_400),
            cpu_request_cores=rnd.choice([None, 0.1, 0.25, 0.5]),
        )
        fields = dict.fromkeys(WorkloadUsage._fields)
        fields.update(
            workload=workload,
            cpu=CpuStat(0),
            cpu_max=CpuMax(None) if rnd.random() < 0.7 else CpuMax(200_000),
            memory_bytes=rnd.randrange(64 << 20, 512 << 20),
            cores=rnd.uniform(0.0, 0.12),
        )
        usages.append(WorkloadUsage(**fields))
    return usages


def node(cores_used: float, memory_used: int, load: float) -> NodeUsage:
    total = 256 * GIB
    return NodeUsage(
        cpus=CPUS,
        cpu=ProcStatCpu(0, 0),
        cores_used=cores_used,
        cpu_utilization=100.0 * cores_used / CPUS,
        load=LoadAverage(load, load, load, 10, 3000),
        memory=MemInfo(total, total - memory_used),
        cpu_pressure=Psi(PsiLine(5.0, 5.0, 5.0, 0), None),
        memory_pressure=None,
        io_pressure=None,
    )


def snapshot(usages: list[WorkloadUsage], node_usage: NodeUsage) -> Snapshot:
    return Snapshot(
        monotonic=1000.0,
        wall_time=1_700_100_000.0,
        interval=1.0,
        cgroup_version="v2",
        node=node_usage,
        workloads=MappingProxyType({u.workload.id: u for u in usages}),
    )


GUARD = GuardSettings.model_validate(
    {
        "objectives": [
            {"metric": "cpu_total_usage", "threshold": "80%", "restoreBelow": "70%", "action": "throttle"},
            {"metric": "memory_total_usage", "threshold": "85%", "action": "evict"},
            {"metric": "load_average", "threshold": 1.5, "restoreBelow": 1.0, "action": "throttle"},
        ],
        "evictions": {"maxPerTick": 3},
    }
)


def median_ms(fn: Callable[[], object], runs: int = RUNS) -> float:
    fn()  # warm-up
    times = []
    for _ in range(runs):
        start = time.perf_counter_ns()
        fn()
        times.append(time.perf_counter_ns() - start)
    return statistics.median(times) / 1e6


def main() -> int:
    rnd = random.Random(3)
    usages = workloads(WORKLOADS, rnd)
    # CPU 2 cores past 80 % (about 40 workloads' worth), memory 6 GiB past 85 %, PSI 45 % past 30 %.
    hot = snapshot(usages, node(0.8 * CPUS + 2.0, int(0.85 * 256 * GIB) + 6 * GIB, 2.0 * CPUS))
    calm = snapshot(usages, node(0.5 * CPUS, 100 * GIB, 0.5 * CPUS))
    state = GuardState.primed()

    result = plan(hot, state, GUARD)
    kinds = [a.kind for a in result.actions]
    assert kinds.count("throttle") > 2 and kinds.count("evict") > 0, kinds

    plan_ms = median_ms(lambda: plan(hot, state, GUARD))
    calm_ms = median_ms(lambda: plan(calm, state, GUARD))
    baseline_ms = median_ms(lambda: sorted(usages, key=lambda u: u.cores or 0.0))
    print(
        f"{WORKLOADS} workloads, 3 objectives: plan {plan_ms:.3f} ms "
        f"({kinds.count('throttle')} throttles, {kinds.count('evict')} evictions), calm tick {calm_ms:.3f} ms; "
        f"baseline sorted() by one key {baseline_ms:.3f} ms"
    )
    print(
        json.dumps(
            {
                "workloads": WORKLOADS,
                "plan_ms": round(plan_ms, 3),
                "calm_plan_ms": round(calm_ms, 3),
                "baseline_sorted_ms": round(baseline_ms, 3),
                "ratio": round(plan_ms / baseline_ms, 1),
                "actions": len(kinds),
                "target_ms": 5.0,
            }
        )
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
