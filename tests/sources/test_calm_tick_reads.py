"""What a calm tick's sense does per idle workload, counted on real cgroups: the files it reads and the parses it makes.

bench/sense.py times this against bare reads; these counts are its deterministic half: one more file read or one
more parse per workload a tick is what slowed sensing once (memory.pressure read and parsed afresh every tick).
"""

from __future__ import annotations

import os
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import pytest

from nodeguard.config import Settings
from nodeguard.model.snapshot import WorkloadUsage
from nodeguard.sources import readers
from nodeguard.sources.sensor import Sensor
from tests.support import cgroups as rc
from tests.support.poll import wait_until

# What a tick reads of each workload on cgroup v2 where the files exist (the controller is on).
CALM_FILES = ("cpu.stat", "cpu.max", "cpu.pressure", "memory.current")
MEMORY_FILES = ("memory.high", "memory.pressure")  # only while memory is followed
WORKLOAD_PARSERS = ("parse_cpu_stat", "parse_cpu_max", "parse_psi_totals", "parse_memory_high")


class SensePass:
    """One sense pass, counted: each workload file it reads and each parse of a workload file it makes."""

    def __init__(self, sensor: Sensor, monkeypatch: pytest.MonkeyPatch) -> None:
        self.reads: list[Path] = []
        self.parses: Counter[str] = Counter()
        real_pread = os.pread

        def pread(fd: int, size: int, offset: int) -> bytes:
            self.reads.append(Path(os.readlink(f"/proc/self/fd/{fd}")))
            return real_pread(fd, size, offset)

        with monkeypatch.context() as patch:
            patch.setattr(os, "pread", pread)
            for name in WORKLOAD_PARSERS:
                patch.setattr(readers, name, self._counted(name, getattr(readers, name)))
            self.snapshot = sensor.sense()

    def _counted(self, name: str, parse: Callable[..., object]) -> Callable[..., object]:
        def counted(*args: object) -> object:
            self.parses[name] += 1
            return parse(*args)

        return counted

    def read_in(self, group: Path) -> list[str]:
        return sorted(path.name for path in self.reads if path.parent == group)


def existing(group: Path, names: tuple[str, ...]) -> list[str]:
    return sorted(name for name in names if (group / name).exists())


def v2_workloads(kind: str) -> tuple[Path, str, Settings]:
    """The cgroup v2 mount of ``kind`` (the test skipped without one), a fresh parent's name under it, and the
    sensing settings that take its children as workloads and discover them once."""
    reason = rc.why_no_v2_of(kind)
    if reason:
        pytest.skip(reason)
    mount = rc.v2_mount()
    assert mount is not None
    parent = rc.unique_name()
    settings = Settings.model_validate(
        {
            "sensing": {"cgroupRoot": str(mount), "cgroupVersion": "v2", "discoverySeconds": 3600},
            "workloads": {"groups": [{"match": f"{parent}/*"}]},
        }
    )
    return mount, parent, settings


@pytest.mark.parametrize("kind", rc.V2_KINDS)
def test_a_calm_tick_reads_each_idle_workloads_files_once_and_parses_none(
    kind: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Idle workloads on a calm tick: each of their per-tick files is read once (memory.high and memory.pressure only
    while memory is followed) and none is parsed again, its bytes being those of the tick before; they read as idle."""
    mount, parent, settings = v2_workloads(kind)
    with rc.cgroups(*(mount / parent / name for name in ("a", "b", "c"))) as groups:
        calm_files = {group: existing(group, CALM_FILES) for group in groups}
        memory_files = {group: existing(group, CALM_FILES + MEMORY_FILES) for group in groups}
        sensor = Sensor(settings)
        try:
            sensor.follow_memory(False)  # the daemon's tick without a memory objective or a held memory.high
            sensor.sense()  # first sight
            sensor.sense()  # the first rates: idle, so their threads are not followed from here on
            calm = SensePass(sensor, monkeypatch)
            sensor.follow_memory(True)
            sensor.sense()  # the memory files' first reading
            followed = SensePass(sensor, monkeypatch)
        finally:
            sensor.close()
    assert len(calm.snapshot.workloads) == len(followed.snapshot.workloads) == len(groups)
    for group in groups:
        assert "cpu.stat" in calm_files[group]
        assert calm.read_in(group) == calm_files[group]
        assert followed.read_in(group) == memory_files[group]
    assert calm.parses == Counter() and followed.parses == Counter()
    for usage in [*calm.snapshot.workloads.values(), *followed.snapshot.workloads.values()]:
        assert len(usage) == len(WorkloadUsage._fields)  # the sensor builds it from a plain tuple: every field given
        assert (usage.cores, usage.throttled_cores, usage.throttled_fraction) == (0.0, 0.0, None)
        assert usage.cpu_stall_pct == (None if usage.cpu_pressure is None else 0.0)
    for usage in followed.snapshot.workloads.values():
        assert usage.memory_stall_pct == (None if usage.memory_pressure is None else 0.0)


@pytest.mark.parametrize("kind", rc.V2_KINDS)
def test_an_idle_workload_keeps_its_usage_while_its_files_read_the_same_and_a_busy_one_is_worked_out(
    kind: str,
) -> None:
    """A workload whose files read the same bytes as on the two ticks before is the last tick's usage again (nothing
    built); one that started using CPU is worked out afresh the next tick, and so is one whose read failed a tick."""
    mount, parent, settings = v2_workloads(kind)
    with rc.cgroups(*(mount / parent / name for name in ("busy", "idle"))) as (busy, idle):
        ids = {group.name: f"{parent}/{group.name}" for group in (busy, idle)}
        sensor = Sensor(settings)
        proc = None
        try:
            sensor.follow_memory(False)
            before = [sensor.sense() for _ in range(3)][-1]  # first sight, first rates, then the same bytes again
            again = sensor.sense()
            assert all(again.workloads[wid] is before.workloads[wid] for wid in ids.values()), "nothing built"
            assert (again.workloads[ids["idle"]].cores, again.workloads[ids["idle"]].throttled_cores) == (0.0, 0.0)

            proc = rc.start_busy(busy, announce=True)
            rc.wait_started([proc], 30)
            stat = busy / "cpu.stat"
            first = stat.read_bytes()
            wait_until(lambda: stat.read_bytes() != first, 10, "the busy group's cpu.stat to move")
            used = sensor.sense()
            assert used.workloads[ids["busy"]] is not again.workloads[ids["busy"]]
            assert (used.workloads[ids["busy"]].cores or 0.0) > 0.0, "its CPU use is seen"
            assert used.workloads[ids["idle"]] is again.workloads[ids["idle"]]

            reader = sensor._readers[ids["idle"]][1]
            real_pread = os.pread
            failing = True

            def pread(fd: int, size: int, offset: int) -> bytes:
                if failing and os.readlink(f"/proc/self/fd/{fd}") == str(idle / "cpu.stat"):
                    raise OSError(5, "Input/output error")
                return real_pread(fd, size, offset)

            with pytest.MonkeyPatch.context() as patch:
                patch.setattr(os, "pread", pread)
                skipped = sensor.sense()
                assert ids["idle"] not in skipped.workloads and sensor.skipped == 1
                failing = False
                back = sensor.sense()  # no usage the tick before: worked out without rates
                assert back.workloads[ids["idle"]].cores is None and not reader.steady
                after = sensor.sense()  # the same bytes as the tick before, whose usage had no rates: worked out
                assert after.workloads[ids["idle"]] is not back.workloads[ids["idle"]]
                assert after.workloads[ids["idle"]].cores == 0.0
        finally:
            if proc is not None:
                rc.stop(proc)
            sensor.close()
