"""Prometheus metrics from nodeguard's own registry.

Everything is collected at scrape time from the daemon's view (its last
snapshot, plan and counters: ``Daemon.view``, a custom collector), so a
workload that left the node leaves no stale series behind. Scrapes run in the
daemon's event loop, between ticks.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from nodeguard import __version__
from nodeguard.daemon import DaemonView

TICK_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)
WAIT_BUCKETS = (0.01, 0.05, 0.1, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)


class Metrics:
    """The daemon's registry: a collector for its state plus the histograms it observes."""

    def __init__(self, view: Callable[[], DaemonView]) -> None:
        self.registry = CollectorRegistry()
        self.tick_duration = Histogram(
            "nodeguard_tick_duration_seconds",
            "Time to sense, plan and act in one tick.",
            buckets=TICK_BUCKETS,
            registry=self.registry,
        )
        self.gate_wait = Histogram(
            "nodeguard_gate_wait_seconds",
            "Time a load waited from submit to admission.",
            buckets=WAIT_BUCKETS,
            registry=self.registry,
        )
        self.registry.register(DaemonCollector(view))


def _counter(name: str, doc: str, labels: list[str], values: dict[tuple[str, ...], float]) -> CounterMetricFamily:
    family = CounterMetricFamily(name, doc, labels=labels)
    for key, value in sorted(values.items()):
        family.add_metric(list(key), value)
    return family


def _gauge(name: str, doc: str, labels: list[str], values: dict[tuple[str, ...], float]) -> GaugeMetricFamily:
    family = GaugeMetricFamily(name, doc, labels=labels)
    for key, value in sorted(values.items()):
        family.add_metric(list(key), value)
    return family


class DaemonCollector(Collector):
    def __init__(self, view: Callable[[], DaemonView]) -> None:
        self.view = view

    def collect(self) -> Iterator[Metric]:
        daemon = self.view()
        yield _gauge("nodeguard_build_info", "nodeguard's version.", ["version"], {(__version__,): 1})
        yield from self._guard(daemon)
        yield from self._workloads(daemon)
        yield from self._actuation(daemon)
        yield from self._daemon(daemon)
        yield from self._gate(daemon.gate)
        coordination = daemon.coordination
        if coordination.get("enabled"):
            yield from self._coordination(coordination)

    def _guard(self, daemon: DaemonView) -> Iterator[Metric]:
        plan = daemon.last_plan
        if plan is None:
            return
        yield _gauge(
            "nodeguard_node_usage",
            "The node's value of each guard metric, in the metric's unit (cores, bytes, percent, load per core).",
            ["metric"],
            {(str(m),): v for m, v in plan.readings.items() if v is not None},
        )
        yield _gauge(
            "nodeguard_waterline",
            "The lowest threshold of each metric and action, in the metric's unit.",
            ["metric", "action"],
            {(str(line.metric), line.action): line.threshold for line in plan.waterlines.values()},
        )
        yield _gauge(
            "nodeguard_restore_waterline",
            "Below this (for restoreAfter ticks) throttles are released.",
            ["metric"],
            {
                (str(line.metric),): line.restore_below
                for line in plan.waterlines.values()
                if line.restore_below is not None
            },
        )
        gaps: dict[tuple[str, ...], float] = {}
        for direction, values in (
            ("down", plan.gaps.throttle_down),
            ("up", plan.gaps.throttle_up),
            ("evict", plan.gaps.evict),
        ):
            gaps.update({(str(m), direction): v for m, v in values.items()})
        yield _gauge(
            "nodeguard_gap", "How far each metric is past its waterline, by direction.", ["metric", "direction"], gaps
        )
        yield _gauge(
            "nodeguard_protected_cpu_stall_ratio",
            "A protected workload's CPU stall over the last tick (runnable, not running, its own throttling "
            "taken off), 0..1.",
            ["workload"],
            {(p.workload_id,): p.stall_pct / 100.0 for p in plan.protected if p.stall_pct is not None},
        )
        yield _gauge(
            "nodeguard_lever_held_groups",
            "Groups each lever holds back, from the ledger (every registered lever, 0 when it holds none).",
            ["lever"],
            {(lever,): count for lever, count in daemon.held.items()},
        )
        blocked: dict[tuple[str, ...], float] = {}
        for b in plan.blocked:
            key = (str(b.metric), str(b.direction), b.cause)
            blocked[key] = blocked.get(key, 0) + 1
        yield _gauge(
            "nodeguard_blocked",
            "Metrics the last plan did not (fully) act on, and why.",
            ["metric", "direction", "cause"],
            blocked,
        )

    def _workloads(self, daemon: DaemonView) -> Iterator[Metric]:
        snapshot = daemon.last_snapshot
        if snapshot is None:
            return
        labels = ["workload", "kind", "class"]
        cores: dict[tuple[str, ...], float] = {}
        memory: dict[tuple[str, ...], float] = {}
        quota: dict[tuple[str, ...], float] = {}
        for wid, usage in snapshot.workloads.items():
            key = (wid, usage.workload.kind, str(usage.workload.qos_class))
            if usage.cores is not None:
                cores[key] = usage.cores
            if usage.memory_bytes is not None:
                memory[key] = usage.memory_bytes
            if usage.cpu_max is not None and usage.cpu_max.cores is not None:
                quota[key] = usage.cpu_max.cores
        yield _gauge("nodeguard_workloads", "Workloads watched.", [], {(): len(snapshot.workloads)})
        yield _gauge("nodeguard_workload_cpu_usage_cores", "CPU used by a workload over the last tick.", labels, cores)
        yield _gauge("nodeguard_workload_memory_bytes", "Memory charged to a workload.", labels, memory)
        yield _gauge(
            "nodeguard_workload_cpu_quota_cores", "A workload's CPU limit (absent when unlimited).", labels, quota
        )
        yield from self._levers(daemon)

    def _levers(self, daemon: DaemonView) -> Iterator[Metric]:
        """Each lever's gauges, as its terms name them, from the values the ledger holds."""
        for lever in daemon.levers.values():
            terms = lever.terms
            records = daemon.records.get(terms.name, {})
            if terms.count_metric is not None:
                help_ = f"Groups whose {terms.noun} nodeguard holds lowered, from the ledger."
                yield _gauge(terms.count_metric, help_, [], {(): len(records)})
            if terms.value_metric is not None:
                values = {(group,): lever.number(r.holds) for group, r in records.items()}
                yield _gauge(
                    terms.value_metric,
                    f"The {terms.noun} nodeguard holds on a group, in {terms.unit}.",
                    ["workload"],
                    {key: value for key, value in values.items() if value is not None},
                )
            if terms.original_metric is not None:
                originals = {(group,): lever.number(r.original) for group, r in records.items()}
                yield _gauge(
                    terms.original_metric,
                    f"A held group's original {terms.noun}, in {terms.unit} (-1: no limit).",
                    ["workload"],
                    {key: -1.0 if value is None else value for key, value in originals.items()},
                )

    def _actuation(self, daemon: DaemonView) -> Iterator[Metric]:
        actions = daemon.actions
        yield _counter(
            "nodeguard_actions_total",
            "Throttles, restores and evictions carried out (or logged, in dry run).",
            ["action", "metric", "dry_run"],
            {(kind, metric, str(dry).lower()): n for (kind, metric, dry), n in actions.items()},
        )
        writes = daemon.writes
        yield _counter("nodeguard_cgroup_writes_total", "cgroup file writes made.", [], {(): writes.writes})
        yield _counter(
            "nodeguard_quota_drift_total",
            "Values nodeguard holds (any lever) found put back by someone else and re-asserted.",
            [],
            {(): writes.drift},
        )
        yield _counter(
            "nodeguard_lever_overwritten_total",
            "Values nodeguard holds that another owner (kubelet, the runtime, systemd) changed, by lever: re-asserted, "
            "or taken as a new original (an in-place resize).",
            ["lever"],
            {(name,): writes.overwritten[name] for name in daemon.levers},
        )
        yield _counter(
            "nodeguard_writes_refused_total",
            "Writes the single writer refused (path or file checks).",
            [],
            {(): writes.refused},
        )
        yield _counter(
            "nodeguard_write_errors_total",
            "cgroup writes the kernel refused, by errno.",
            ["errno"],
            {(name,): n for name, n in writes.errors.items()},
        )
        yield _counter(
            "nodeguard_action_failures_total",
            "Actions that failed (write refused, eviction not done).",
            [],
            {(): daemon.failed_actions},
        )
        yield _counter(
            "nodeguard_restore_failures_total",
            "Restores that failed (a quota raised or put back, a weight put back, refused by the kernel).",
            [],
            {(): daemon.failed_restores},
        )

    def _daemon(self, daemon: DaemonView) -> Iterator[Metric]:
        yield _counter("nodeguard_ticks_total", "Ticks completed.", [], {(): daemon.ticks})
        yield _counter(
            "nodeguard_tick_errors_total", "Ticks that failed with an unexpected error.", [], {(): daemon.tick_errors}
        )
        yield _counter(
            "nodeguard_workload_reads_skipped_total",
            "Workload reads that failed and were skipped.",
            [],
            {(): daemon.reads_skipped},
        )
        yield _counter(
            "nodeguard_config_reloads_total",
            "SIGHUP reloads by result.",
            ["result"],
            {(k,): v for k, v in daemon.reloads.items()},
        )

    def _gate(self, status: dict[str, Any]) -> Iterator[Metric]:
        counts = status.get("counts") or {}
        yield _gauge(
            "nodeguard_gate_loads",
            "Loads in the gate by state.",
            ["state"],
            {(str(state),): float(n) for state, n in counts.items()},
        )
        counters = status.get("counters") or {}
        yield _counter(
            "nodeguard_gate_events_total",
            "Gate events (admissions, failures, rejected requests ...).",
            ["event"],
            {(str(k),): float(v) for k, v in counters.items()},
        )

    def _coordination(self, status: dict[str, Any]) -> Iterator[Metric]:
        semaphores = status.get("semaphores") or {}
        yield _gauge(
            "nodeguard_semaphore_cap",
            "Cluster-wide cap of the semaphore.",
            ["semaphore"],
            {(name,): float(s.get("cap", 0)) for name, s in semaphores.items()},
        )
        for field in ("allotment", "held", "waiting"):
            yield _gauge(
                f"nodeguard_semaphore_{field}",
                f"Cluster semaphore {field} on this node.",
                ["semaphore"],
                {(name,): float(s.get(field, 0)) for name, s in semaphores.items()},
            )
        yield _counter(
            "nodeguard_semaphore_admissions_total",
            "Cluster slots granted to loads on this node.",
            ["semaphore"],
            {(name,): float(s.get("admitted", 0)) for name, s in semaphores.items()},
        )
        members = status.get("members") or {}
        yield _gauge("nodeguard_coordination_members", "Cluster members by state, as the bank's census shows them.",
                     ["state"], {(str(state),): float(n) for state, n in
                                 Counter(str(m.get("state")) for m in members.values()).items()})  # fmt: skip
        yield _gauge("nodeguard_coordination_member_allotment",
                     "Slots of a cluster semaphore in each member's allotment (the bank's census).",
                     ["member", "state", "semaphore"],
                     {(name, str(m.get("state")), sem): float(n)
                      for name, m in members.items() for sem, n in (m.get("allotment") or {}).items()})  # fmt: skip
        yield _gauge(
            "nodeguard_coordination_bank",
            "1 while this node holds the mint (routes slots, changes caps).",
            [],
            {(): 1.0 if status.get("bank") == status.get("node") else 0.0},
        )
        yield _gauge("nodeguard_semaphore_applied_cap", "Slots in existence (the cap the bank applied).",
                     ["semaphore"], {(name,): float(s["appliedCap"]) for name, s in semaphores.items()
                                     if s.get("appliedCap") is not None})  # fmt: skip
        yield _gauge(
            "nodeguard_coordination_admitting",
            "1 while this node may hand out cluster slots (lease valid).",
            [],
            {(): 1.0 if status.get("admitting") else 0.0},
        )
        yield _gauge(
            "nodeguard_mqtt_connected",
            "1 while connected to the MQTT broker.",
            [],
            {(): 1.0 if status.get("connected") else 0.0},
        )
        yield _counter(
            "nodeguard_mqtt_messages_rejected_total",
            "Malformed or unexpected MQTT messages ignored.",
            [],
            {(): float(sum(v for k, v in (status.get("counters") or {}).items() if k.startswith("ignored.")))},
        )
