"""nodeguard's own place on the CPU: a control loop whose wake-ups do not cut into the workloads it guards.

Every tick starts with a wake-up, and CFS lets a thread that wakes from sleep
preempt the one running on its CPU: on a busy node, often the very workload the
guard protects, whose burst then waits for the tick. SCHED_BATCH keeps the
daemon's share of the CPU (its nice value and its cgroup's weight are
unchanged) and drops that wake-up preemption only: the tick waits for the
running task's slice instead, a few milliseconds a tick of a second does not
notice. A policy other than SCHED_OTHER was chosen by the operator (systemd's
``CPUSchedulingPolicy=``, ``chrt``) and is kept.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path

from nodeguard.log import get_logger

log = get_logger("nodeguard.own_scheduling")

POLICY_NAMES = {os.SCHED_OTHER: "other", os.SCHED_BATCH: "batch", os.SCHED_IDLE: "idle",
                os.SCHED_FIFO: "fifo", os.SCHED_RR: "rr"}  # fmt: skip


@dataclass
class Scheduling:
    """What ``run_as_batch`` did: the threads it moved, those under a chosen policy, and those it could not move."""

    moved: int = 0
    kept: dict[int, str] = field(default_factory=dict)  # thread id: its policy, which the operator chose
    failed: dict[int, str] = field(default_factory=dict)  # thread id: why


def run_as_batch(tasks: Path = Path("/proc/self/task")) -> Scheduling:
    """Every thread of this process from SCHED_OTHER to SCHED_BATCH (threads started later inherit it)."""
    done = Scheduling()
    for entry in tasks.iterdir():
        tid = int(entry.name)
        try:
            policy = os.sched_getscheduler(tid)
            if policy != os.SCHED_OTHER:
                done.kept[tid] = POLICY_NAMES.get(policy, str(policy))
                continue
            os.sched_setscheduler(tid, os.SCHED_BATCH, os.sched_param(0))
        except ProcessLookupError:
            continue  # the thread ended meanwhile
        except OSError as exc:
            done.failed[tid] = exc.strerror or str(exc)
        else:
            done.moved += 1
    if done.failed:
        log.warning("cannot run as SCHED_BATCH: its ticks may preempt the workloads", threads=done.failed)
    log.debug("scheduling", batch_threads=done.moved, kept=done.kept)
    return done
