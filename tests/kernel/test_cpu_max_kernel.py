"""cpu.max enforcement by a real cgroup v2 kernel, read back through nodeguard's parsers.

These run only inside the QEMU VM (see tests/kernel/vm.py); elsewhere the
``kernel`` marker makes them skip.
"""

from __future__ import annotations

import errno
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from nodeguard.sources.cgroupfs import parse_cpu_max, parse_cpu_stat, parse_psi

pytestmark = pytest.mark.kernel

CGROUP_ROOT = Path("/sys/fs/cgroup")


def _remove_cgroup(path: Path) -> None:
    # rmdir fails with EBUSY until the killed processes have really exited.
    kill = path / "cgroup.kill"
    if kill.exists():
        kill.write_text("1")
    deadline = time.monotonic() + 5
    while True:
        try:
            path.rmdir()
            return
        except OSError as error:
            if error.errno != errno.EBUSY or time.monotonic() > deadline:
                raise
            time.sleep(0.01)


@pytest.fixture
def cgroup() -> Iterator[Path]:
    """A fresh child of the root cgroup, emptied and removed afterwards."""
    path = CGROUP_ROOT / f"nodeguard-test-{uuid.uuid4().hex[:12]}"
    path.mkdir()
    try:
        yield path
    finally:
        _remove_cgroup(path)


@contextmanager
def _busy_loop_in(group: Path) -> Iterator[subprocess.Popen[bytes]]:
    proc = subprocess.Popen([sys.executable, "-c", "while True: pass"])
    try:
        (group / "cgroup.procs").write_text(str(proc.pid))
        yield proc
    finally:
        proc.kill()
        proc.wait()


def test_cpu_max_throttles_busy_process_to_quota(cgroup: Path) -> None:
    """A busy loop under cpu.max "20000 100000" gets ~0.20 cores, is throttled and shows CPU pressure."""
    (cgroup / "cpu.max").write_text("20000 100000")
    limit = parse_cpu_max((cgroup / "cpu.max").read_text())
    assert (limit.quota_us, limit.period_us) == (20_000, 100_000)

    with _busy_loop_in(cgroup):
        # Skip the child's start-up, which partly waits on reads over 9p.
        time.sleep(0.5)
        start = time.monotonic()
        stat0 = parse_cpu_stat((cgroup / "cpu.stat").read_text())
        psi0 = parse_psi((cgroup / "cpu.pressure").read_text())
        time.sleep(2)
        end = time.monotonic()
        stat1 = parse_cpu_stat((cgroup / "cpu.stat").read_text())
        psi1 = parse_psi((cgroup / "cpu.pressure").read_text())

    cores = (stat1.usage_usec - stat0.usage_usec) / ((end - start) * 1e6)
    assert cores == pytest.approx(0.20, abs=0.05)
    assert stat1.nr_throttled > stat0.nr_throttled
    assert stat1.throttled_usec > stat0.throttled_usec
    assert psi0.some is not None and psi1.some is not None
    assert psi1.some.total_usec > psi0.some.total_usec


def test_cpu_max_word_max_reads_back_as_unlimited(cgroup: Path) -> None:
    """Writing "max 100000" over a quota makes cpu.max read back as no quota, period 100000."""
    cpu_max = cgroup / "cpu.max"
    cpu_max.write_text("20000 100000")
    assert parse_cpu_max(cpu_max.read_text()).quota_us == 20_000
    cpu_max.write_text("max 100000")
    limit = parse_cpu_max(cpu_max.read_text())
    assert limit.quota_us is None
    assert limit.period_us == 100_000
