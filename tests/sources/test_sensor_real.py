"""The sensor on this machine's real cgroup hierarchies, with real busy processes."""

from __future__ import annotations

import errno
import math
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from structlog.testing import capture_logs

from nodeguard.config import Settings
from nodeguard.model.samples import CpuMax
from nodeguard.model.snapshot import Snapshot
from nodeguard.sources import readers
from nodeguard.sources.sensor import Sensor
from tests.support import cgroups as rc

TOLERANCE = 0.08  # cores; CFS enforcement measured here within ±1 % of a core


def settings_for(root: Path, version: str, pattern: str) -> Settings:
    return Settings.model_validate(
        {
            "sensing": {"cgroupRoot": str(root), "cgroupVersion": version},
            "workloads": {"groups": [{"match": pattern, "class": "BestEffort"}]},
        }
    )


def sense_over(sensor: Sensor, seconds: float) -> Snapshot:
    sensor.sense()
    time.sleep(seconds)  # the window the rates are read over
    return sensor.sense()


@pytest.fixture
def v1_group() -> Iterator[tuple[str, Path, Path]]:
    with rc.v1_cpu_group() as group:
        yield group.name, group.cpu, group.cpuacct


def test_v1_reads_quota_usage_and_throttling(v1_group: tuple[str, Path, Path]) -> None:
    """On the v1 cpu hierarchy a busy process under a 0.3-core quota reads as ~0.3 cores and throttled."""
    name, cpu_dir, cpuacct_dir = v1_group
    (cpu_dir / "cpu.cfs_period_us").write_text("100000")
    (cpu_dir / "cpu.cfs_quota_us").write_text("30000")
    busy = rc.start_busy(cpu_dir, cpuacct_dir)
    sensor = Sensor(settings_for(rc.CGROUP_ROOT, "v1", name))
    try:
        assert sensor.layout.version == "v1"
        snapshot = sense_over(sensor, 1.5)
    finally:
        rc.stop(busy)
        sensor.close()
    usage = snapshot.workloads[name]
    assert usage.cpu_max is not None and usage.cpu_max.cores == pytest.approx(0.3)
    assert usage.cores == pytest.approx(0.3, abs=TOLERANCE)
    assert usage.throttled_fraction is not None and usage.throttled_fraction > 0.5
    assert usage.cpu.nr_throttled > 0 and usage.cpu.throttled_usec > 0
    assert snapshot.node.cores_used is not None and snapshot.node.cores_used >= 0.2


def test_v2_mount_reads_usage_and_pressure(hybrid_v2_mount: Path, v1_group: tuple[str, Path, Path]) -> None:
    """Hybrid host: in the cgroup2 mount a process limited to 0.4 cores (through v1) reads as ~0.4 cores with PSI."""
    mount = hybrid_v2_mount
    name, cpu_dir, cpuacct_dir = v1_group
    (cpu_dir / "cpu.cfs_quota_us").write_text("40000")
    with rc.cgroups(mount / name) as [v2_dir]:
        busy = rc.start_busy(cpu_dir, cpuacct_dir, v2_dir)
        sensor = Sensor(settings_for(mount, "v2", name))
        try:
            snapshot = sense_over(sensor, 1.5)
        finally:
            rc.stop(busy)
            sensor.close()
    usage = snapshot.workloads[name]
    assert snapshot.cgroup_version == "v2"
    assert usage.cores == pytest.approx(0.4, abs=TOLERANCE)
    assert usage.cpu_pressure is not None and usage.cpu_pressure.some_usec is not None
    # Throttled time is CPU pressure: the kernel counts it as "some" stall.
    assert usage.cpu_pressure.some_usec > 0
    assert usage.cpu_stall_pct is not None and usage.cpu_stall_pct > 10


def test_memory_pressure_is_read_only_while_followed(hybrid_v2_mount: Path, v1_group: tuple[str, Path, Path]) -> None:
    """Hybrid host: a workload's memory.pressure is in its samples while the sensor follows memory, and not after."""
    mount = hybrid_v2_mount
    name = v1_group[0]
    with rc.cgroups(mount / name):
        sensor = Sensor(settings_for(mount, "v2", name))
        try:
            followed = sensor.sense().workloads[name]
            sensor.follow_memory(False)
            unfollowed = sensor.sense().workloads[name]
            sensor.follow_memory(True)
            again = sensor.sense().workloads[name]
        finally:
            sensor.close()
    assert followed.memory_pressure is not None
    assert unfollowed.memory_pressure is None and unfollowed.memory_high is None
    assert again.memory_pressure is not None


def test_a_memory_file_that_cannot_be_opened_reads_as_missing_for_that_workload_only(
    hybrid_v2_mount: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Hybrid host: when a workload's memory.pressure cannot be opened as memory is followed again, that workload's
    reading is missing, the other workloads' memory files are followed and the sensor goes on."""
    parent = rc.unique_name()
    with rc.cgroups(hybrid_v2_mount / parent / "a", hybrid_v2_mount / parent / "b"):
        sensor = Sensor(settings_for(hybrid_v2_mount, "v2", f"{parent}/*"))
        try:
            sensor.sense()
            sensor.follow_memory(False)
            real_open = readers.open_optional

            def out_of_descriptors(path: str) -> int:
                if path.endswith(f"{parent}/a/memory.pressure"):
                    raise OSError(errno.EMFILE, "Too many open files", path)
                return real_open(path)

            monkeypatch.setattr(readers, "open_optional", out_of_descriptors)
            with capture_logs() as logs:
                sensor.follow_memory(True)
            monkeypatch.setattr(readers, "open_optional", real_open)
            first = sensor.sense().workloads
            time.sleep(0.1)  # the window the second reading's rates are over
            second = sensor.sense().workloads
        finally:
            sensor.close()
    a, b = f"{parent}/a", f"{parent}/b"
    assert first[a].memory_pressure is None and second[a].memory_pressure is None
    assert second[a].cores is not None and second[a].cpu_pressure is not None  # its other readings stand
    assert first[b].memory_pressure is not None and second[b].memory_pressure is not None
    assert [(e["event"], e["workload"]) for e in logs] == [("cannot open the workload's memory files", a)]


@pytest.mark.kernel
def test_pure_v2_reads_quota_usage_throttling_memory_and_pressure() -> None:
    """Pure cgroup v2: a process under a 0.4-core cpu.max reads as ~0.4 cores, throttled, with memory and PSI."""
    mount = rc.v2_mount()
    assert mount is not None
    name = rc.unique_name()
    with rc.cgroups(mount / name) as [group]:
        (group / "cpu.max").write_text("40000 100000")
        busy = rc.start_busy(group)
        sensor = Sensor(settings_for(mount, "v2", name))
        try:
            snapshot = sense_over(sensor, 1.5)
            sensor.follow_memory(False)  # no memory objective, nothing held: neither file is read
            unfollowed = sensor.sense().workloads[name]
        finally:
            rc.stop(busy)
            sensor.close()
    usage = snapshot.workloads[name]
    assert usage.cpu_max is not None and usage.cpu_max.cores == pytest.approx(0.4)
    assert usage.cores == pytest.approx(0.4, abs=TOLERANCE)
    assert usage.throttled_fraction is not None and usage.throttled_fraction > 0.5
    assert usage.memory_bytes is not None and usage.memory_bytes > 0
    assert usage.cpu_stall_pct is not None and usage.cpu_stall_pct > 10
    assert usage.memory_high == float("inf") and usage.memory_pressure is not None
    assert unfollowed.memory_high is None and unfollowed.memory_pressure is None
    assert unfollowed.memory_bytes is not None  # memory.current still is: evict objectives read it


@pytest.mark.parametrize("version", ["v1", pytest.param("v2", marks=pytest.mark.kernel)])
def test_a_containers_own_limit_is_throttling_but_not_its_pods_own(version: str) -> None:
    """A busy container held to 0.2 core by its own limit, its pod unlimited: the pod reads as throttled (its stall
    is not others' doing), but not by its own cpu.max, which a hold on the pod would raise for nothing."""
    hierarchy = rc.v1_cpu_hierarchy() if version == "v1" else rc.v2_cpu_hierarchy()
    pod = rc.unique_name() + "-pod"
    root = rc.CGROUP_ROOT if version == "v1" else hierarchy.writable
    with hierarchy.groups(pod, f"{pod}/c"):
        hierarchy.set_limit(f"{pod}/c", CpuMax(20000))
        busy = rc.start_busy(*hierarchy.dirs(f"{pod}/c"), announce=True)
        sensor = Sensor(settings_for(root, version, pod))
        try:
            rc.wait_started([busy], 30)
            snapshot = sense_over(sensor, 1.0)
        finally:
            rc.stop(busy)
            sensor.close()
    usage = snapshot.workloads[pod]
    assert usage.cores == pytest.approx(0.2, abs=TOLERANCE)
    assert usage.throttled_cores is not None and usage.throttled_cores > 0.5, usage
    assert usage.own_throttled_cores == 0.0, usage


@pytest.mark.parametrize("kind", rc.V2_KINDS)
def test_cgroup_removed_between_ticks_is_a_workload_that_left(kind: str) -> None:
    """A group removed after discovery drops out of the next snapshot without an error."""
    reason = rc.why_no_v2_of(kind)
    if reason:
        pytest.skip(reason)
    mount = rc.v2_mount()
    assert mount is not None
    name = rc.unique_name() + "-gone"
    with rc.cgroups(mount / name, mount / (name + "2")):
        sensor = Sensor(settings_for(mount, "v2", name + "*"))
        try:
            first = sensor.sense()
            assert {name, name + "2"} <= set(first.workloads)
            if kind == "pure":  # every per-tick file is held open there, memory.current too
                assert first.workloads[name].memory_bytes is not None
            (mount / name).rmdir()
            second = sensor.sense()
        finally:
            sensor.close()
    assert name not in second.workloads and name + "2" in second.workloads
    assert name not in sensor.workloads
    assert sensor.skipped == 0


def test_reader_reuses_unchanged_files_and_sees_changes(tmp_path: Path) -> None:
    """Unchanged file bytes reuse the last parsed value, memory files' too; any change is parsed afresh."""
    from nodeguard.sources.readers import V2Reader

    pressure = "some avg10=0.00 avg60=0.00 avg300=0.00 total={}\nfull avg10=0.00 avg60=0.00 avg300=0.00 total=1\n"
    (tmp_path / "cpu.stat").write_text("usage_usec 10\nnr_periods 1\nnr_throttled 0\nthrottled_usec 0\n")
    (tmp_path / "cpu.pressure").write_text(pressure.format(5))
    (tmp_path / "cpu.max").write_text("max 100000\n")
    (tmp_path / "memory.current").write_text("4096\n")
    (tmp_path / "memory.high").write_text("max\n")
    (tmp_path / "memory.pressure").write_text(pressure.format(8))
    reader = V2Reader(str(tmp_path))
    try:
        first = reader.sample()
        again = reader.sample()
        assert [again[i] is first[i] for i in (0, 1, 2, 6)] == [True] * 4
        assert again[3] == 4096 and again[5] == math.inf and again[6] is not None and again[6].some_usec == 8
        (tmp_path / "cpu.stat").write_text("usage_usec 99\nnr_periods 2\nnr_throttled 1\nthrottled_usec 7\n")
        (tmp_path / "cpu.max").write_text("5000 100000\n")
        (tmp_path / "memory.current").write_text("8192\n")
        (tmp_path / "memory.high").write_text("1048576\n")
        (tmp_path / "memory.pressure").write_text(pressure.format(9))
        changed = reader.sample()
        assert changed[0].usage_usec == 99 and changed[0].throttled_usec == 7
        assert changed[1] is not None and changed[1].quota_us == 5000
        assert changed[2] is first[2]
        assert changed[3] == 8192 and changed[5] == 1048576
        assert changed[6] is not None and changed[6].some_usec == 9
    finally:
        reader.close()
