"""Benchmark: what the decision history costs a tick, and on disk.

A node of 200 pods (cgroup v2-shaped plain files in a tmpfs, /dev/shm, as
the ledger's /run is: the daemon's executor, levers and ledger write them as
they write cgroups) past and under a cpu_total_usage waterline in turn, so
that every tick throttles or gives back: the worst case for the history,
whose cost is per action. Each tick is what the daemon does after sensing:
``settle`` (plan, apply with the ledger saved first, fold), and with the
history on also ``record`` and ``flush`` (the entries built and encoded,
handed to the writer's thread, which writes them to a disk-backed
directory). Two such nodes, one with the history off and one with it on,
tick in alternation in the same run: ``tick_ms_off`` is the baseline. Logs
at warning level: the executor's line per change costs what its sink makes
it cost, the same with the history or without. A calm tick (two fresh
nodes, nothing to do) is timed both ways too.

Then ``bytes_per_action``: the history's bytes over the entries written in
the run; a QoS tier's weight change lists every pod under it and is measured
apart (``bytes_per_tier_weight``, 200 pods under the tier). And
``why_ms_full``: ``nodeguard why``'s read and answer for one pod on a
history filled to its default bound (32 MiB). Medians. Prints one JSON object
last.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import tempfile
import time
from collections import Counter
from collections.abc import Coroutine
from dataclasses import replace
from pathlib import Path
from types import MappingProxyType
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from nodeguard.actuators import levers
from nodeguard.actuators.cgroup_writer import CgroupWriter
from nodeguard.actuators.executor import Executor
from nodeguard.actuators.ledger import Ledger
from nodeguard.guard_tick import settle
from nodeguard.history.query import Question, answer, read
from nodeguard.history.reading import directory_bytes, scan
from nodeguard.history.recorder import Recorder
from nodeguard.history.segments import history_files
from nodeguard.history.settings import HistorySettings
from nodeguard.log import configure
from nodeguard.model.samples import CpuMax, CpuStat, LoadAverage, MemInfo, ProcStatCpu
from nodeguard.model.snapshot import NodeUsage, Snapshot, WorkloadUsage
from nodeguard.model.workloads import QosClass, Workload
from nodeguard.policy.settings import GuardSettings
from nodeguard.policy.state import GuardState

PODS = 200
CPUS = 32
ROUNDS = 60  # each: a tick of each node, off then on, then on then off
GIB = 1 << 30
FILES = {"cpu.max": "max 100000", "cpu.weight": "100", "cpu.idle": "0", "memory.high": "max"}


class PlainFiles(CgroupWriter):
    """The daemon's writer on plain files: a write replaces the file's value, as a cgroup file's does."""

    def write(self, workload_id: str, filename: str, value: str, **context: object) -> bool:
        os.truncate(self.path_of(workload_id, filename), 0)
        return super().write(workload_id, filename, value, **context)


class NoEvictions:
    async def evict(self, workload_id: str, **context: object) -> bool:
        return True


def spawn(coro: Coroutine[Any, Any, None], name: str) -> None:
    coro.close()


def pods() -> list[WorkloadUsage]:
    found = []
    for i in range(PODS):
        tier = "burstable" if i % 2 else "besteffort"
        workload = Workload(
            id=f"kubepods.slice/kubepods-{tier}.slice/kubepods-{tier}-pod{i:08x}_0d4b_4c1e_9f60_2b7d5c8e1a42.slice",
            name=f"batch/job-{i}",
            kind="pod",
            qos_class=QosClass.BURSTABLE if i % 2 else QosClass.BEST_EFFORT,
            pod_uid=f"{i:08x}-0d4b-4c1e-9f60-2b7d5c8e1a42",
            started_at=1_700_000_000.0 + i,
        )
        fields = dict.fromkeys(WorkloadUsage._fields)
        fields.update(workload=workload, cpu=CpuStat(0), cpu_max=CpuMax(None), memory_bytes=256 << 20,
                      cores=0.05 + (i % 7) * 0.02)  # fmt: skip
        found.append(WorkloadUsage(**fields))
    return found


def snapshot(usages: list[WorkloadUsage], cores_used: float, tick: int) -> Snapshot:
    node = NodeUsage(cpus=CPUS, cpu=ProcStatCpu(0, 0), cores_used=cores_used, cpu_utilization=100 * cores_used / CPUS,
                     load=LoadAverage(4.0, 4.0, 4.0, 5, 900), memory=MemInfo(128 * GIB, 100 * GIB),
                     cpu_pressure=None, memory_pressure=None, io_pressure=None)  # fmt: skip
    return Snapshot(monotonic=1000.0 + tick, wall_time=time.time(), interval=1.0, cgroup_version="v2", node=node,
                    workloads=MappingProxyType({u.workload.id: u for u in usages}))  # fmt: skip


GUARD = GuardSettings.model_validate({
    "objectives": [{"metric": "cpu_total_usage", "action": "throttle", "threshold": 24, "restoreBelow": 20,
                    "triggerAfter": 1, "restoreAfter": 1, "name": "node-cpu"}],
    "restoreStepPercent": 3, "minChangePercent": 0,
})  # fmt: skip


class Node:
    """One node's files, ledger, executor and (with the history on) recorder."""

    def __init__(self, root: Path, usages: list[WorkloadUsage], history: bool, disk: Path) -> None:
        tree = root / "cgroup"
        for usage in usages:
            parts = usage.workload.id.split("/")
            for depth in range(1, len(parts) + 1):
                group = tree.joinpath(*parts[:depth])
                if not group.is_dir():
                    group.mkdir(parents=True)
                    for name, value in FILES.items():
                        (group / name).write_text(value + "\n")
        self.executor = Executor(levers.build(PlainFiles(str(tree)), "v2"), NoEvictions(),
                                 Ledger(str(root / "ledger.json")), spawn)  # fmt: skip
        self.recorder = Recorder(HistorySettings(path=str(disk / "history"))) if history else None
        if self.recorder is not None:
            self.recorder.start()
        self.state = GuardState()
        self.actions = 0

    def tick(self, found: Snapshot) -> float:
        """Seconds the tick took: settle, and with the history on, record and flush."""
        start = time.perf_counter()
        settled = settle(found, self.state, GUARD, self.executor)
        if self.recorder is not None:
            self.recorder.record(settled.plan, found, settled.done, GUARD.candidates)
            self.recorder.flush()
        took = time.perf_counter() - start
        self.state = settled.state
        self.actions += len(settled.done)
        return took


def ticks(shm: Path, disk: Path) -> dict[str, Any]:
    usages = pods()
    off, on = Node(shm / "off", usages, False, disk / "off"), Node(shm / "on", usages, True, disk / "on")
    acting: dict[bool, list[float]] = {False: [], True: []}
    for tick in range(2 * ROUNDS):
        found = snapshot(usages, 26.0 if tick % 2 == 0 else 18.0, tick)  # over, then under: throttle, give back
        order = (off, on) if tick % 4 < 2 else (on, off)
        for node in order:
            acting[node is on].append(node.tick(found))
    calm: dict[bool, list[float]] = {False: [], True: []}
    quiet_off, quiet_on = Node(shm / "calm-off", usages, False, disk / "calm-off"), Node(shm / "calm-on", usages,
                                                                                        True, disk / "calm-on")  # fmt: skip
    for tick in range(2 * ROUNDS):
        found = snapshot(usages, 10.0, 1000 + tick)  # under every line, nothing held: nothing to do
        for node in (quiet_off, quiet_on) if tick % 2 else (quiet_on, quiet_off):
            calm[node is quiet_on].append(node.tick(found))
    assert quiet_on.actions == 0 and quiet_on.recorder is not None
    quiet_on.recorder.close()
    assert on.recorder is not None and on.recorder.drain(60)
    on.recorder.close()
    entries = on.recorder.counters.entries
    history = str(disk / "on" / "history")
    tick_off, tick_on = statistics.median(acting[False]), statistics.median(acting[True])
    return {
        "pods": PODS,
        "actions_per_acting_tick": round(on.actions / (2 * ROUNDS), 1),
        "entries": entries,
        "bytes_per_action": round(directory_bytes(history) / entries),
        "tick_ms_off": round(tick_off * 1000, 3),
        "tick_ms_on": round(tick_on * 1000, 3),
        "ratio": round(tick_on / tick_off, 3),
        "calm_tick_ms_off": round(statistics.median(calm[False]) * 1000, 4),
        "calm_tick_ms_on": round(statistics.median(calm[True]) * 1000, 4),
    }


def tier_weight(root: Path) -> int:
    """Bytes of one entry that lowers the Burstable tier's weight for a protected pod, 100 pods under the tier."""
    usages = [u for u in pods() if u.workload.qos_class is QosClass.BURSTABLE]
    busy = [u._replace(cores=0.3, waiting_cores=0.7, starved_cores=0.7) for u in usages]
    important = replace(busy[0].workload, id="kubepods.slice/kubepods-podguaranteed.slice", name="prod/db",
                        qos_class=QosClass.GUARANTEED)  # fmt: skip
    protected = busy[0]._replace(workload=important, waiting_cores=0.4, starved_cores=0.0)
    node = Node(root / "tier", [*busy, protected], True, root / "tier")
    guard = GuardSettings.model_validate({"objectives": [
        {"metric": "protected_cpu_stall", "action": "throttle", "threshold": "5%", "restoreBelow": "1%",
         "triggerAfter": 1, "restoreAfter": 1}]})  # fmt: skip
    found = snapshot([*busy, protected], 31.0, 0)
    settled = settle(found, node.state, guard, node.executor)
    assert node.recorder is not None
    node.recorder.record(settled.plan, found, settled.done, guard.candidates)
    node.recorder.close()
    assert [d.change.kind for d in settled.done] == ["reweigh"], settled.done
    return directory_bytes(str(root / "tier" / "history"))


def why_full(root: Path, pod: str) -> dict[str, Any]:
    """``nodeguard why``'s read and answer for a pod on a history at its default bound, built of this run's lines."""
    source = root / "on" / "history"
    lines = b"".join(Path(p).read_bytes() for _, p in history_files(str(source)))
    full = root / "full"
    full.mkdir()
    bound = HistorySettings().max_bytes
    per_file = bound // HistorySettings().files
    copies = per_file // len(lines)
    for number in range(1, HistorySettings().files + 1):
        (full / f"history-{number:010d}.jsonl").write_bytes(lines * copies)
    took = []
    for _ in range(3):
        start = time.perf_counter()
        question = Question(pod)
        result = answer(read(str(full), question), question)
        took.append(time.perf_counter() - start)
    return {"why_full_bytes": directory_bytes(str(full)), "why_full_entries": result["history"]["entries"],
            "why_full_answered": len(result["entries"]), "why_ms_full": round(statistics.median(took) * 1000)}  # fmt: skip


def main() -> None:
    configure("warning")
    shm_parent = "/dev/shm" if os.path.isdir("/dev/shm") else None
    with (
        tempfile.TemporaryDirectory(prefix="nodeguard-bench-history-", dir=shm_parent) as shm,
        tempfile.TemporaryDirectory(prefix="nodeguard-bench-history-", dir="/var/tmp") as disk,
    ):
        result = ticks(Path(shm), Path(disk))
        result["bytes_per_tier_weight"] = tier_weight(Path(shm))
        busiest = Counter(r.workload.name for r in scan(str(Path(disk) / "on" / "history")).records if r.workload)
        result.update(why_full(Path(disk), busiest.most_common(1)[0][0]))
    print(json.dumps(result))


if __name__ == "__main__":
    main()
