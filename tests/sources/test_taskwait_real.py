"""The run-queue wait of a cgroup's threads, read from /proc/<tid>/schedstat, against real contention."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from nodeguard.sources.taskwait import TaskWait, subtree
from tests import realcgroups as rc

PINNED_BUSY = "import os, sys; os.sched_setaffinity(0, {int(sys.argv[1])})\nwhile True: pass"


def pinned(cpu: int, hierarchy: rc.Hierarchy, rel: str) -> subprocess.Popen[bytes]:
    proc = subprocess.Popen([sys.executable, "-c", PINNED_BUSY, str(cpu)])
    for group in hierarchy.dirs(rel):
        (group / "cgroup.procs").write_text(str(proc.pid))
    return proc


def usage_ns(hierarchy: rc.Hierarchy, rel: str) -> int:
    return int((hierarchy.roots[-1] / rel / "cpuacct.usage").read_text())


def measure(wait: TaskWait, hierarchy: rc.Hierarchy, rel: str, seconds: float) -> tuple[float, float]:
    """(cores waited, cores used) over ``seconds``."""
    wait.waited_ns()
    used, start = usage_ns(hierarchy, rel), time.monotonic()
    time.sleep(seconds)
    waited = wait.waited_ns()
    elapsed = time.monotonic() - start
    return waited / 1e9 / elapsed, (usage_ns(hierarchy, rel) - used) / 1e9 / elapsed


def test_busy_threads_wait_for_what_they_do_not_get() -> None:
    """An always-runnable thread is running or waiting: two pinned to one CPU wait 2 cores minus what they got,
    one alone on a CPU waits 1 core minus what it got (other work on the machine takes the rest)."""
    if os.cpu_count() is None or (os.cpu_count() or 0) < 2:
        pytest.skip("needs two CPUs")
    hierarchy = rc.v1_cpu_hierarchy()
    parent = rc.unique_name()
    with hierarchy.groups(f"{parent}/shared/c", f"{parent}/alone"):
        shared, alone = f"{parent}/shared", f"{parent}/alone"
        procs = [pinned(0, hierarchy, f"{shared}/c"), pinned(0, hierarchy, f"{shared}/c"), pinned(1, hierarchy, alone)]
        try:
            time.sleep(0.2)
            together = TaskWait(subtree(str(hierarchy.writable / shared)))
            single = TaskWait(subtree(str(hierarchy.writable / alone)))
            try:
                waited, used = measure(together, hierarchy, shared, 1.0)
                assert waited == pytest.approx(2.0 - used, abs=0.15), "threads below the pod's directory count too"
                assert waited > 0.7
                waited, used = measure(single, hierarchy, alone, 1.0)
                assert waited == pytest.approx(1.0 - used, abs=0.15)
            finally:
                together.close()
                single.close()
        finally:
            for proc in procs:
                rc.stop(proc)


def test_threads_come_and_go_without_a_spike_or_a_leak(tmp_path: Path) -> None:
    """A thread first seen adds nothing to that call; one that exits is forgotten with its descriptor."""
    hierarchy = rc.v1_cpu_hierarchy()
    parent = rc.unique_name()
    with hierarchy.groups(parent):
        wait = TaskWait([str(hierarchy.writable / parent)])
        try:
            assert wait.waited_ns() == 0
            kept = TaskWait.kept_open
            proc = pinned(0, hierarchy, parent)
            time.sleep(0.3)
            assert wait.waited_ns() == 0, "a thread's wait before it was first seen is not this tick's"
            assert TaskWait.kept_open == kept + 1
            rc.stop(proc)
            wait.waited_ns()
            assert TaskWait.kept_open == kept
        finally:
            wait.close()
