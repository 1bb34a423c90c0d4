"""The real daemon's own threads run as SCHED_BATCH (its wake-ups do not preempt the workloads), unless the operator
chose a policy."""

from __future__ import annotations

import os
import signal
from pathlib import Path
from typing import Any

from nodeguard.own_scheduling import run_as_batch
from tests.support.daemon import DaemonProcess


def config(tmp_path: Path) -> dict[str, Any]:
    """A daemon with its gate and HTTP surface on: the threads those start are the ones to check too."""
    return {"global": {
        "sensing": {"kubepods": False, "tickSeconds": 0.3},
        "actuation": {"ledgerPath": str(tmp_path / "run/ledger.json")},
        "http": {"listen": "127.0.0.1:0"},
        "gate": {"socket": str(tmp_path / "run/gate.sock")},
    }}  # fmt: skip


def policies(pid: int) -> dict[int, int]:
    """Each thread of ``pid``: its scheduling policy."""
    return {int(tid): os.sched_getscheduler(int(tid)) for tid in os.listdir(f"/proc/{pid}/task")}


def running(tmp_path: Path, wrapper: tuple[str, ...] = ()) -> tuple[DaemonProcess, dict[int, int], int]:
    """The daemon started and ticking; its threads' policies and its nice value then."""
    daemon = DaemonProcess(config(tmp_path), tmp_path, wrapper=wrapper).start()
    daemon.wait_for(daemon.ticks, 30, "the first tick")
    assert daemon.proc is not None
    return daemon, policies(daemon.proc.pid), os.getpriority(os.PRIO_PROCESS, daemon.proc.pid)


def test_every_thread_of_the_daemon_runs_as_batch_at_its_nice_value(tmp_path: Path) -> None:
    """Once it ticks, every thread of ``nodeguard run`` is SCHED_BATCH and its nice value is the one it started at."""
    daemon, found, nice = running(tmp_path)
    try:
        assert found and set(found.values()) == {os.SCHED_BATCH}, found
        assert nice == os.getpriority(os.PRIO_PROCESS, 0), "its share of the CPU is unchanged"
        [logged] = [e for e in daemon.events() if e.get("event") == "scheduling"]
        assert logged["batch_threads"] >= 1 and logged["kept"] == {}
    finally:
        daemon.signal(signal.SIGTERM)
        assert daemon.wait() == 0


def test_a_policy_the_operator_chose_is_kept(tmp_path: Path) -> None:
    """Started under ``chrt --idle 0`` (as systemd's CPUSchedulingPolicy=idle would), the daemon stays SCHED_IDLE."""
    daemon, found, _ = running(tmp_path, wrapper=("chrt", "--idle", "0"))
    try:
        assert found and set(found.values()) == {os.SCHED_IDLE}, found
        [logged] = [e for e in daemon.events() if e.get("event") == "scheduling"]
        assert logged["batch_threads"] == 0 and set(logged["kept"].values()) == {"idle"}
    finally:
        daemon.signal(signal.SIGTERM)
        assert daemon.wait() == 0


def test_a_thread_that_ended_meanwhile_is_passed_over(tmp_path: Path) -> None:
    """A thread id listed but gone by the time it is moved is neither moved nor a failure."""
    (tmp_path / str(2**22 + 1)).mkdir()  # above the kernel's largest pid_max: no such thread
    done = run_as_batch(tmp_path)
    assert (done.moved, done.kept, done.failed) == (0, {}, {})
