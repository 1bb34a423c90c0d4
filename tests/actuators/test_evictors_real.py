"""Evictors on real cgroups: v2 freeze, SIGTERM, grace, cgroup.kill (this host's cgroup2 mount and, kernel-marked,
a pure v2 kernel); v1 signals."""

from __future__ import annotations

import select
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from nodeguard.actuators.cgroup_writer import CgroupWriter
from nodeguard.actuators.evictors import CgroupEvictor
from tests.support import cgroups as rc

# Each says "ready" once its SIGTERM handler is in place. The polite one exits
# on SIGTERM after writing a mark; the stubborn one ignores SIGTERM.
POLITE = (
    "import signal, sys, time\n"
    "signal.signal(signal.SIGTERM, lambda *_: (open(sys.argv[1], 'w').write('bye'), sys.exit(0)))\n"
    "print('ready', flush=True)\n"
    "while True: time.sleep(0.01)"
)
STUBBORN = (
    "import signal, time\n"
    "signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
    "print('ready', flush=True)\n"
    "while True: time.sleep(0.01)"
)
READY_TIMEOUT_S = 60.0  # Python starts ~20 times slower in the kernel VM


def spawn(code: str, group: Path, *args: str) -> subprocess.Popen[bytes]:
    """A child in ``group`` whose signal handler is installed (it said so) before anything signals it."""
    proc = subprocess.Popen([sys.executable, "-c", code, *args], stdout=subprocess.PIPE)
    assert proc.stdout is not None
    readable, _, _ = select.select([proc.stdout], [], [], READY_TIMEOUT_S)
    line = proc.stdout.readline() if readable else b""
    proc.stdout.close()
    if line != b"ready\n":
        proc.kill()
        proc.wait()
        raise AssertionError(f"child not ready within {READY_TIMEOUT_S} s: {line!r}")
    (group / "cgroup.procs").write_text(str(proc.pid))
    return proc


@pytest.fixture(params=["v1", *rc.V2_KINDS])
def setup(request: pytest.FixtureRequest) -> Iterator[tuple[CgroupEvictor, Path, str]]:
    version = "v1" if request.param == "v1" else "v2"
    reason = rc.why_no_v1_cpu() if version == "v1" else rc.why_no_v2_of(request.param)
    if reason:
        pytest.skip(reason)
    root = rc.v2_mount() if version == "v2" else rc.v1_hierarchy("cpu")
    assert root is not None
    name = rc.unique_name()
    with rc.cgroups(root / name):
        yield CgroupEvictor(CgroupWriter(str(root)), version, grace_seconds=1.0), root / name, name


async def test_polite_processes_exit_on_sigterm(setup: tuple[CgroupEvictor, Path, str], tmp_path: Path) -> None:
    """SIGTERM reaches every process (after a thaw on v2) and they exit within the grace period."""
    evictor, group, name = setup
    marks = [tmp_path / f"m{i}" for i in range(2)]
    procs = [spawn(POLITE, group, str(mark)) for mark in marks]
    started = time.monotonic()
    assert await evictor.evict(name, reason="test") is True
    assert time.monotonic() - started < 1.0
    assert all(mark.read_text() == "bye" for mark in marks)
    assert [p.wait(5) for p in procs] == [0, 0]
    assert evictor.pids(name) == []


async def test_stubborn_processes_are_killed_after_grace(setup: tuple[CgroupEvictor, Path, str]) -> None:
    """A process ignoring SIGTERM is killed (cgroup.kill on v2, SIGKILL on v1) once the grace period ends."""
    evictor, group, name = setup
    proc = spawn(STUBBORN, group)
    started = time.monotonic()
    assert await evictor.evict(name, reason="test") is True
    assert time.monotonic() - started >= 1.0
    assert proc.wait(5) == -9
    assert evictor.pids(name) == []


async def test_dry_run_evicts_nothing(setup: tuple[CgroupEvictor, Path, str]) -> None:
    """In dry run the eviction is only logged: the processes keep running."""
    evictor, group, name = setup
    dry = CgroupEvictor(CgroupWriter(evictor.writer.root, dry_run=True), evictor.version, grace_seconds=0.1)
    proc = spawn(STUBBORN, group)
    try:
        assert await dry.evict(name, reason="test") is True
        assert proc.poll() is None and dry.pids(name) == [proc.pid]
    finally:
        rc.stop(proc)
