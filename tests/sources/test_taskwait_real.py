"""The run-queue wait of a cgroup's threads, read from /proc/<tid>/schedstat, against real contention."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Iterator

import pytest

from nodeguard.model.samples import CpuMax
from nodeguard.sources.taskwait import TaskWait, Waits, subtree
from tests.support import cgroups as rc
from tests.support.workloads import DUTY_CYCLE

# Each says it is pinned (one line) before it loops: in the emulated VM a Python start can outlast a fixed sleep, and
# a child measured before it pins itself runs on both CPUs.
PINNED_BUSY = "import os, sys; os.sched_setaffinity(0, {int(sys.argv[1])}); print(flush=True)\nwhile True: pass"
PINNED_DUTY = "import os, sys; os.sched_setaffinity(0, {int(sys.argv[2])}); print(flush=True)\n" + DUTY_CYCLE


@pytest.fixture(params=["v1", pytest.param("v2", marks=pytest.mark.kernel)])
def hierarchy(request: pytest.FixtureRequest) -> rc.Hierarchy:
    if os.cpu_count() is None or (os.cpu_count() or 0) < 2:
        pytest.skip("needs two CPUs")
    return rc.v1_cpu_hierarchy() if request.param == "v1" else rc.v2_cpu_hierarchy()


def start(code: str, args: list[str], hierarchy: rc.Hierarchy, rel: str) -> subprocess.Popen[bytes]:
    proc = subprocess.Popen([sys.executable, "-c", code, *args], stdout=subprocess.PIPE)
    for group in hierarchy.dirs(rel):
        (group / "cgroup.procs").write_text(str(proc.pid))
    assert proc.stdout is not None and proc.stdout.readline() == b"\n", "the child pinned itself"
    return proc


def usage_ns(hierarchy: rc.Hierarchy, rel: str) -> int:
    if hierarchy.version == "v2":
        line = next(
            x for x in (hierarchy.writable / rel / "cpu.stat").read_text().splitlines() if x.startswith("usage")
        )
        return int(line.split()[1]) * 1000
    return int((hierarchy.roots[-1] / rel / "cpuacct.usage").read_text())


def waits_of(hierarchy: rc.Hierarchy, rel: str) -> TaskWait:
    return TaskWait(
        subtree(str(hierarchy.writable / rel)), list_name="tasks" if hierarchy.version == "v1" else "cgroup.threads"
    )


def measure(wait: TaskWait, hierarchy: rc.Hierarchy, rel: str, seconds: float) -> tuple[Waits, float]:
    """(the waits, cores used) over ``seconds``."""
    assert wait.sample() is None, "the first sample is the baseline"
    used, start_at = usage_ns(hierarchy, rel), time.monotonic()
    time.sleep(seconds)  # the measured window
    found = wait.sample()
    assert found is not None
    return found, (usage_ns(hierarchy, rel) - used) / 1e9 / (time.monotonic() - start_at)


@pytest.fixture
def parent(hierarchy: rc.Hierarchy) -> Iterator[str]:
    name = rc.unique_name()
    with hierarchy.groups(f"{name}/shared/c", f"{name}/alone", f"{name}/sleepy"):
        yield name


def test_busy_threads_wait_for_what_they_do_not_get(hierarchy: rc.Hierarchy, parent: str) -> None:
    """An always-runnable thread is running or waiting: two pinned to one CPU wait 2 cores minus what they got
    (threads in a child cgroup counted), all of it starved demand."""
    procs = [start(PINNED_BUSY, ["0"], hierarchy, f"{parent}/shared/c") for _ in range(2)]
    try:
        wait = waits_of(hierarchy, f"{parent}/shared")
        try:
            found, used = measure(wait, hierarchy, f"{parent}/shared", 1.0)
        finally:
            wait.close()
        waited = found.waited_ns / found.interval_ns
        assert waited == pytest.approx(2.0 - used, abs=0.15)
        assert waited > 0.7
        assert found.starved_ns == pytest.approx(found.waited_ns, rel=0.05), "threads that never sleep: all unmet"
    finally:
        for proc in procs:
            rc.stop(proc)


def test_a_thread_that_sleeps_waits_but_is_not_starved(hierarchy: rc.Hierarchy, parent: str) -> None:
    """A duty-cycled thread sharing a CPU with a busy one waits (latency), but its wait is not unmet demand."""
    procs = [
        start(PINNED_BUSY, ["1"], hierarchy, f"{parent}/alone"),
        start(PINNED_DUTY, ["0.3", "1"], hierarchy, f"{parent}/sleepy"),
    ]
    try:
        wait = waits_of(hierarchy, f"{parent}/sleepy")
        try:
            found, _ = measure(wait, hierarchy, f"{parent}/sleepy", 1.0)
        finally:
            wait.close()
        assert found.waited_ns > 0.02 * found.interval_ns, "it did wait behind the busy thread"
        assert found.starved_ns == 0
    finally:
        for proc in procs:
            rc.stop(proc)


def test_threads_come_and_go_without_a_spike_or_a_leak(hierarchy: rc.Hierarchy, parent: str) -> None:
    """A thread first seen adds nothing to that sample; one that exits is forgotten with its descriptor."""
    wait = waits_of(hierarchy, f"{parent}/alone")
    try:
        assert wait.sample() is None
        kept = TaskWait.kept_open
        proc = start(PINNED_BUSY, ["0"], hierarchy, f"{parent}/alone")
        time.sleep(0.3)  # kept: the scenario, a thread that runs (and waits) a while before it is first seen
        found = wait.sample()
        assert found is not None and found.waited_ns == 0, "its wait before it was first seen is not this tick's"
        assert TaskWait.kept_open == kept + 1
        rc.stop(proc)
        wait.sample()
        assert TaskWait.kept_open == kept
        wait.pause()
        assert wait.sample() is None, "after a pause the next sample is a baseline again"
    finally:
        wait.close()


def test_a_containers_own_limit_counts_as_throttled_not_as_waiting_for_others(
    hierarchy: rc.Hierarchy, parent: str
) -> None:
    """A busy loop held to 0.2 core by its container's limit (the pod unlimited, as kubelet may leave it) shows
    that throttling in the waits, where the pod's own cpu.stat sees none of it."""
    hierarchy.set_limit(f"{parent}/shared/c", CpuMax(20000))
    proc = start(PINNED_BUSY, ["0"], hierarchy, f"{parent}/shared/c")
    try:
        found, cores = measure(waits_of(hierarchy, f"{parent}/shared"), hierarchy, f"{parent}/shared", 1.0)
    finally:
        rc.stop(proc)
    throttled = found.throttled_ns / found.interval_ns
    assert cores < 0.3, cores
    assert 0.6 < throttled <= 1.0, f"held back about 0.8 of each period, got {throttled:.2f}"
