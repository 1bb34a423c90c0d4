"""What /status shows of the running daemon (``nodeguard status`` reads it), each lever's held groups included."""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any

from nodeguard import __version__
from nodeguard.actuators.ledger import Ledger
from nodeguard.actuators.levers.base import Lever
from nodeguard.daemon import Daemon
from nodeguard.history.query import respond
from nodeguard.history.reading import Named
from nodeguard.policy.trace import phase_seconds, plan_to_data
from nodeguard.surfaces.held import record_view


def held_view(ledger: Ledger, lever: Lever) -> dict[str, dict[str, Any]]:
    """One lever's records as /status shows them: the values as the ledger keeps them, and for people."""
    return {group: record_view(r, lever) for group, r in ledger.of(lever.name).items()}


def status_of(daemon: Daemon) -> dict[str, Any]:
    """What /status and ``nodeguard status`` show."""
    snapshot = daemon.last_snapshot
    return {
        "version": __version__,
        "node": daemon.labels.get("kubernetes.io/hostname"),
        "cgroup": daemon.sensor.layout.version,
        "dryRun": daemon.settings.actuation.dry_run,
        "ticks": daemon.stats.ticks,
        "tickErrors": daemon.stats.errors,
        "lastTickSeconds": daemon.stats.durations[-1] if daemon.stats.durations else None,
        "node_usage": None
        if snapshot is None
        else {
            "cpus": snapshot.node.cpus,
            "cores_used": snapshot.node.cores_used,
            "memory_used": snapshot.node.memory_used,
            "memory_total": None if snapshot.node.memory is None else snapshot.node.memory.total,
            "load1": None if snapshot.node.load is None else snapshot.node.load.load1,
        },
        "plan": None if daemon.last_plan is None else plan_to_data(daemon.last_plan, candidate_limit=10),
        "held": {name: held_view(daemon.ledger, lever) for name, lever in daemon.levers.items()},
        "protection": {
            "phase": str(daemon.state.protect.phase),
            "phaseSeconds": phase_seconds(daemon.state.protect, time.monotonic()),
        },
        "heldBack": {
            wid: {
                "error": h.error,
                "file": h.file,
                "detail": h.detail,
                "failures": h.failures,
                "retryInSeconds": max(0.0, h.until - time.monotonic()),
            }
            for wid, h in daemon.state.held_back.items()
            if h.until > time.monotonic()
        },
        "warnings": [{"setting": setting, "message": message} for setting, message in daemon.warnings.items()],
        "health": daemon.health(),
        "history": {
            "path": daemon.history.path,
            "written": daemon.history.counters.entries,
            "dropped": daemon.history.counters.dropped,
            "errors": daemon.history.counters.errors,
        },
        "gate": daemon.gate.status(),
        "coordination": daemon.coordination.status(),
        "kubernetes": None if daemon.kube is None else daemon.kube.status(),
    }


def history_of(daemon: Daemon, params: Mapping[str, list[str]]) -> tuple[int, dict[str, Any] | str]:
    """/history: what ``nodeguard why`` answers, the names of the pods running now resolved too. Called in a worker
    thread: it reads the daemon's last snapshot, which is immutable."""
    snapshot = daemon.last_snapshot
    live = [] if snapshot is None else [
        Named(wid, usage.workload.name, usage.workload.pod_uid) for wid, usage in snapshot.workloads.items()
    ]  # fmt: skip
    return respond(daemon.settings.history.path, params, live)
