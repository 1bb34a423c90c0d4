"""Quota writes, drift and restore on real kernels: v1 cpu on this host, v2 cpu.max in the VM."""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from structlog.testing import capture_logs

from nodeguard.actuators.cgroup_writer import CgroupWriter
from nodeguard.actuators.ledger import Ledger
from nodeguard.actuators.levers.cpu_quota import QuotaLever
from nodeguard.actuators.restore import Outcome, restore_all
from nodeguard.model.samples import CpuMax
from nodeguard.sources.readers import V1Reader, V2Reader
from tests.actuators.records import quota_record
from tests.support import cgroups as rc


@dataclass
class QuotaEnv:
    version: str
    root: Path  # the hierarchy the writer owns
    name: str
    dirs: list[Path]  # every directory of the workload (one per v1 hierarchy)

    def quota_file(self) -> str:
        path = self.root / self.name / ("cpu.max" if self.version == "v2" else "cpu.cfs_quota_us")
        return path.read_text().strip()

    def behind_the_back(self, limit: CpuMax) -> None:
        if self.version == "v2":
            (self.root / self.name / "cpu.max").write_text(limit.render_v2())
        else:
            (self.root / self.name / "cpu.cfs_quota_us").write_text(str(limit.quota_us or -1))

    def cores(self, seconds: float) -> float:
        if self.version == "v2":
            reader: V1Reader | V2Reader = V2Reader(str(self.root / self.name))
        else:
            cpuacct = rc.v1_hierarchy("cpuacct")
            assert cpuacct is not None
            reader = V1Reader(str(self.root / self.name), str(cpuacct / self.name), None, None)
        try:
            before, t0 = reader.sample()[0].usage_usec, time.monotonic()
            time.sleep(seconds)
            after, t1 = reader.sample()[0].usage_usec, time.monotonic()
        finally:
            reader.close()
        return (after - before) / 1e6 / (t1 - t0)


def _v1_env() -> Iterator[QuotaEnv]:
    with rc.v1_cpu_group() as group:
        yield QuotaEnv("v1", group.cpu.parent, group.name, group.dirs)


def _v2_env() -> Iterator[QuotaEnv]:
    mount = rc.v2_mount()
    assert mount is not None
    name = rc.unique_name()
    with rc.cgroups(mount / name) as dirs:
        yield QuotaEnv("v2", mount, name, dirs)


@pytest.fixture(params=["v1", pytest.param("v2", marks=pytest.mark.kernel)])
def env(request: pytest.FixtureRequest) -> Iterator[QuotaEnv]:
    yield from (_v1_env() if request.param == "v1" else _v2_env())


def test_apply_enforces_and_skips_unchanged(env: QuotaEnv) -> None:
    """A written quota really limits a busy process; writing the same value again writes nothing."""
    quota = QuotaLever(CgroupWriter(str(env.root)), env.version)
    assert quota.limit(env.name) == CpuMax(None, 100000)
    busy = rc.start_busy(*env.dirs)
    try:
        assert quota.apply(env.name, CpuMax(25000, 100000)) is True
        assert quota.apply(env.name, CpuMax(25000, 100000)) is False
        assert quota.writer.counters.skipped_unchanged == 1
        assert quota.limit(env.name) == CpuMax(25000, 100000)
        assert env.cores(1.0) == pytest.approx(0.25, abs=0.05)
    finally:
        rc.stop(busy)


def test_drift_is_counted_and_reasserted(env: QuotaEnv) -> None:
    """A quota changed behind nodeguard's back is drift: counted, and nodeguard's value written again."""
    quota = QuotaLever(CgroupWriter(str(env.root)), env.version)
    mine = CpuMax(30000, 100000)
    quota.apply(env.name, mine)
    env.behind_the_back(CpuMax(None, 100000))
    assert quota.apply(env.name, mine, last_applied=mine) is True
    assert quota.writer.counters.drift == 1
    assert quota.limit(env.name) == mine


def test_drift_found_by_a_planned_change_is_reported_too(env: QuotaEnv) -> None:
    """A throttle that lands on a quota someone reset reports the drift, as the tick's re-assertion would have."""
    quota = QuotaLever(CgroupWriter(str(env.root)), env.version)
    mine, deeper = CpuMax(30000, 100000), CpuMax(20000, 100000)
    quota.apply(env.name, mine)
    env.behind_the_back(CpuMax(None, 100000))
    with capture_logs() as logs:
        assert quota.apply(env.name, deeper, last_applied=mine, action="throttle") is True
    drift = [e for e in logs if e["event"] == "quota drift re-asserted"]
    assert drift == [{"event": "quota drift re-asserted", "group": env.name, "found": "max 100000",
                      "by": "throttle", "log_level": "warning"}]  # fmt: skip
    assert quota.writer.counters.drift == 1
    assert quota.limit(env.name) == deeper


def test_restore_all_puts_originals_back_and_keeps_others_changes(env: QuotaEnv, tmp_path: Path) -> None:
    """restore_all writes the exact original where nodeguard's value is still there, and leaves a changed one."""
    quota = QuotaLever(CgroupWriter(str(env.root)), env.version)
    original = CpuMax(70000, 100000)
    env.behind_the_back(original)
    applied = CpuMax(20000, 100000)
    quota.apply(env.name, applied)
    ledger = Ledger(str(tmp_path / "ledger.json"))
    ledger.record(quota_record(env.name, env.version, original, applied, "test"))
    ledger.record(quota_record(env.name + "-left", env.version, original, applied, "test"))
    outcomes = restore_all(ledger, {"cpu.max": quota})
    assert outcomes == {Outcome.RESTORED: [env.name], Outcome.GONE: [env.name + "-left"]}
    assert quota.limit(env.name) == original
    assert not ledger and not Ledger.load(ledger.path)

    quota.apply(env.name, applied)
    ledger.record(quota_record(env.name, env.version, original, applied, "test"))
    env.behind_the_back(CpuMax(90000, 100000))  # e.g. the kubelet resized the pod
    assert restore_all(ledger, {"cpu.max": quota}) == {Outcome.CHANGED: [env.name]}
    assert quota.limit(env.name) == CpuMax(90000, 100000)
