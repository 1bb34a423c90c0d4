"""Empty and half-gone files: a reading that is missing costs only what needs it, never the tick."""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path

import pytest
from structlog.testing import capture_logs

from nodeguard.config import Settings
from nodeguard.errors import CgroupGone, WhatIfError
from nodeguard.policy.metrics import CAPABILITIES, Metric
from nodeguard.policy.planner import plan
from nodeguard.policy.state import GuardState
from nodeguard.policy.trace import plan_to_data
from nodeguard.policy.whatif import what_if
from nodeguard.sources.readers import V1Reader, V2Reader, read_details_v2
from nodeguard.sources.sensor import Sensor
from nodeguard.surfaces.render import render_snapshot
from tests.policy import builders
from tests.support import cgroups as rc

PSI = "some avg10=1.00 avg60=0.50 avg300=0.10 total=5000\nfull avg10=0.00 avg60=0.00 avg300=0.00 total=100\n"
MEMINFO = "MemTotal:       16000000 kB\nMemFree:         8000000 kB\nMemAvailable:   12000000 kB\n"


def proc_stat(busy: int, idle: int) -> str:
    return f"cpu  {busy} 0 0 {idle} 0 0 0 0 0 0\ncpu0 {busy} 0 0 {idle} 0 0 0 0 0 0\ncpu1 0 0 0 0 0 0 0 0 0 0\n"


def cpu_stat(usage_usec: int) -> str:
    return f"usage_usec {usage_usec}\nuser_usec 0\nsystem_usec 0\nnr_periods 0\nnr_throttled 0\nthrottled_usec 0\n"


def fake_node(tmp_path: Path) -> tuple[Path, Path]:
    """A cgroup v2 tree with one group ``batch`` and a proc tree, as plain files shaped like the kernel's."""
    cgroup, proc = tmp_path / "cgroup", tmp_path / "proc"
    (cgroup / "batch").mkdir(parents=True)
    (cgroup / "cgroup.controllers").write_text("cpu memory\n")
    (cgroup / "batch" / "cpu.stat").write_text(cpu_stat(1_000_000))
    (cgroup / "batch" / "cpu.max").write_text("max 100000\n")
    (cgroup / "batch" / "cpu.pressure").write_text(PSI)
    (cgroup / "batch" / "memory.current").write_text("4096\n")
    (proc / "self").mkdir(parents=True)
    (proc / "self" / "cgroup").write_text("0::/\n")
    (proc / "stat").write_text(proc_stat(100, 900))
    (proc / "loadavg").write_text("0.50 0.40 0.30 1/200 12345\n")
    (proc / "meminfo").write_text(MEMINFO)
    return cgroup, proc


class Clock:
    """Monotonic time the test sets, so rates are over exact intervals."""

    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def sensor_for(
    cgroup: Path, proc: Path, *objectives: dict[str, object], clock: Clock | None = None
) -> tuple[Sensor, Settings]:
    settings = Settings.model_validate(
        {
            "sensing": {"cgroupRoot": str(cgroup), "procRoot": str(proc), "cgroupVersion": "v2", "kubepods": False},
            "workloads": {"groups": [{"match": "batch", "class": "BestEffort"}]},
            "guard": {"objectives": list(objectives)},
        }
    )
    return Sensor(settings, clock or Clock()), settings


def test_empty_memory_current_keeps_the_cpu_sample(tmp_path: Path) -> None:
    """An empty memory.current (and cpu.pressure) leaves memory (and PSI) None for the tick; the CPU rate stands."""
    cgroup, proc = fake_node(tmp_path)
    clock = Clock()
    sensor, _ = sensor_for(cgroup, proc, clock=clock)
    try:
        sensor.sense()
        clock.now += 1.0
        (cgroup / "batch" / "cpu.stat").write_text(cpu_stat(1_500_000))
        (cgroup / "batch" / "memory.current").write_text("")
        (cgroup / "batch" / "cpu.pressure").write_text("")
        emptied = sensor.sense().workloads["batch"]
        clock.now += 1.0
        (cgroup / "batch" / "cpu.stat").write_text(cpu_stat(2_250_000))
        (cgroup / "batch" / "memory.current").write_text("8192\n")
        (cgroup / "batch" / "cpu.pressure").write_text(PSI)
        back = sensor.sense().workloads["batch"]
    finally:
        sensor.close()
    assert emptied.cores == pytest.approx(0.5) and emptied.memory_bytes is None and emptied.cpu_pressure is None
    assert back.cores == pytest.approx(0.75) and back.memory_bytes == 8192 and back.cpu_pressure is not None
    assert sensor.skipped == 0


def test_empty_v1_memory_usage_keeps_the_cpu_sample(tmp_path: Path) -> None:
    """v1: an empty memory.usage_in_bytes gives memory None and the CPU reading as usual."""
    cpu, cpuacct, memory = (tmp_path / name for name in ("cpu", "cpuacct", "memory"))
    for path in (cpu, cpuacct, memory):
        path.mkdir()
    (cpuacct / "cpuacct.usage").write_text("3000000\n")
    (cpu / "cpu.stat").write_text("nr_periods 4\nnr_throttled 1\nthrottled_time 2000\n")
    (memory / "memory.usage_in_bytes").write_text("")
    reader = V1Reader(str(cpu), str(cpuacct), str(memory), None)
    try:
        stat, _, _, used, *_ = reader.sample()
        (memory / "memory.usage_in_bytes").write_text("65536\n")
        again = reader.sample()
    finally:
        reader.close()
    assert (stat.usage_usec, stat.nr_throttled, used) == (3000, 1, None)
    assert again[3] == 65536


def test_v1_memory_group_removed_first_keeps_the_cpu_sample() -> None:
    """Real v1 cgroups: a workload's memory group removed before its cpu group gives memory None, not a lost workload."""
    if reason := rc.why_no_v1_cpu():
        pytest.skip(reason)
    memory_root = rc.v1_hierarchy("memory")
    if memory_root is None or not (memory_root / "memory.usage_in_bytes").exists():
        pytest.skip("this host has no cgroup v1 memory hierarchy")
    with rc.v1_cpu_group() as group, rc.cgroups(memory_root / group.name) as [memory]:
        reader = V1Reader(str(group.cpu), str(group.cpuacct), str(memory), None)
        try:
            assert reader.sample()[3] is not None
            memory.rmdir()
            stat, _, _, used, *_ = reader.sample()
        finally:
            reader.close()
    assert used is None and stat.usage_usec >= 0


def test_an_empty_detail_is_none_on_its_own(tmp_path: Path) -> None:
    """details(): each empty file gives its own detail None; the other details are still read."""
    (tmp_path / "cgroup.procs").write_text("11\n12\n")
    (tmp_path / "cpu.weight").write_text("")
    (tmp_path / "cpu.pressure").write_text(PSI)
    (tmp_path / "memory.max").write_text("\n")
    (tmp_path / "memory.events").write_text("low 0\nhigh 2\nmax 0\noom 0\noom_kill 0\n")
    (tmp_path / "memory.pressure").write_text("")
    (tmp_path / "cgroup.events").write_text("")
    details = read_details_v2(str(tmp_path))
    assert details.procs == (11, 12)
    assert details.cpu_weight is None and details.memory_max is None and details.memory_pressure is None
    assert details.events is None
    assert details.cpu_pressure is not None and details.cpu_pressure.some is not None
    assert details.memory_events is not None and details.memory_events["high"] == 2


@pytest.mark.parametrize("kind", rc.V2_KINDS)
def test_v2_cgroup_removed_mid_read_is_gone(kind: str) -> None:
    """A real cgroup2 group removed while its reader holds its files: sample() and details() say it is gone."""
    if reason := rc.why_no_v2_of(kind):
        pytest.skip(reason)
    mount = rc.v2_mount()
    assert mount is not None
    with rc.cgroups(mount / rc.unique_name()) as [group]:
        reader = V2Reader(str(group))
        try:
            cpu, _, _, memory, *_ = reader.sample()
            assert cpu.usage_usec >= 0
            assert reader.details().procs == ()
            if kind == "pure":  # the memory controller's files are there to read, and to lose
                assert memory is not None and reader.details().memory_events is not None
            group.rmdir()
            with pytest.raises(CgroupGone):
                reader.sample()
            with pytest.raises(CgroupGone):
                reader.details()
        finally:
            reader.close()


@dataclass(frozen=True)
class NodeFileCase:
    emptied: str  # the /proc file that reads empty
    missing: Metric  # the metric that needs it
    objective: dict[str, object]
    kept: Metric  # a metric that does not need it
    shown: str  # how the snapshot's rendering shows what is missing


NODE_FILE_CASES = [
    NodeFileCase("loadavg", Metric.LOAD_AVERAGE,
                 {"metric": "load_average", "threshold": 0.1, "restoreBelow": 0.05, "action": "throttle"},
                 Metric.CPU_TOTAL_USAGE, "load - (-/core)"),
    NodeFileCase("meminfo", Metric.MEMORY_TOTAL_UTILIZATION,
                 {"metric": "memory_total_utilization", "threshold": "10%", "action": "evict"},
                 Metric.LOAD_AVERAGE, "memory  - of - GiB (-%)"),
]  # fmt: skip


@pytest.mark.parametrize("case", NODE_FILE_CASES, ids=lambda case: case.emptied)
def test_unreadable_node_file_blocks_only_its_metrics(tmp_path: Path, case: NodeFileCase) -> None:
    """An empty /proc file: the tick still senses and plans; its metric is blocked as missing-sample, others read."""
    cgroup, proc = fake_node(tmp_path)
    cpu_objective = {"metric": "cpu_total_usage", "threshold": 0.1, "restoreBelow": 0.05, "action": "throttle"}
    sensor, settings = sensor_for(cgroup, proc, case.objective, cpu_objective)
    try:
        sensor.sense()
        (proc / "stat").write_text(proc_stat(600, 1400))
        (proc / case.emptied).write_text("")
        with capture_logs() as logs:
            snapshot = sensor.sense()
            sensor.sense()  # warned once, not every tick
    finally:
        sensor.close()
    assert "batch" in snapshot.workloads
    assert [e["file"] for e in logs if e["event"].startswith("node file unreadable")] == [f"{proc}/{case.emptied}"]
    result = plan(snapshot, GuardState(), settings.guard)
    assert result.readings[case.missing] is None and result.readings[case.kept] is not None
    assert result.readings[Metric.CPU_TOTAL_USAGE] == pytest.approx(1.0)  # half of 2 cores busy
    blocked = {(b.metric, b.cause) for b in result.blocked}
    assert (case.missing, "missing-sample") in blocked
    assert not any(metric == Metric.CPU_TOTAL_USAGE and cause == "missing-sample" for metric, cause in blocked)
    json.dumps(plan_to_data(result), allow_nan=False)  # the trace stays strict JSON
    assert case.shown in render_snapshot(snapshot)


def test_what_if_over_a_missing_reading() -> None:
    """A what-if of a metric whose /proc file is unreadable: load is set from the value, memory is a clear error."""
    node = replace(builders.node(cpus=4), load=None, memory=None)
    snap = replace(builders.snapshot(), node=node)
    assert CAPABILITIES[Metric.LOAD_AVERAGE].read(what_if(snap, {"load_average": 1.5}).node) == pytest.approx(1.5)
    with pytest.raises(WhatIfError, match="memory_total_usage='8Gi': no memory reading"):
        what_if(snap, {"memory_total_usage": "8Gi"})
