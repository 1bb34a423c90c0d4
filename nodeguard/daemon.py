"""The daemon: wiring, the tick loop (sense -> plan -> act -> record), signals and reload.

Everything runs in one asyncio TaskGroup of named tasks. SIGTERM and SIGINT
stop it: it hands every hold over to a successor that waits for the node (a
rolling update), or else restores them (unless told to keep them). SIGHUP
reloads the config: a bad file keeps the old settings running and logs every
error. A daemon that finds its predecessor on the node waits for it, serving
HTTP (not ready), and takes over when it stops (actuators/succession.py).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import resource
import signal
import time
from collections.abc import Awaitable, Callable, Collection, Coroutine, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from nodeguard.actuators import levers
from nodeguard.actuators.cgroup_writer import CgroupWriter, WriteCounters
from nodeguard.actuators.changes import Done
from nodeguard.actuators.evictors import CgroupEvictor, Evictor
from nodeguard.actuators.executor import Executor
from nodeguard.actuators.ledger import Ledger, LeverRecord
from nodeguard.actuators.levers.base import Lever
from nodeguard.actuators.restore import Outcome
from nodeguard.actuators.succession import Succession
from nodeguard.config import Settings
from nodeguard.config_reload import kept_on_restart, read_settings
from nodeguard.coordination.switch import coordination_service
from nodeguard.early_signals import EARLY, STOPS
from nodeguard.gate.switch import gate_service
from nodeguard.guard_tick import sense, settle
from nodeguard.handover import StartRoom, hand_over, wait_for_node
from nodeguard.history.recorder import history_of
from nodeguard.log import get_logger, log_loop_error
from nodeguard.model.levers import MEMORY_HIGH
from nodeguard.model.snapshot import Snapshot
from nodeguard.node_identity import node_name
from nodeguard.own_scheduling import run_as_batch
from nodeguard.policy import outcome
from nodeguard.policy.metrics import CAPABILITIES, Metric, Resource
from nodeguard.policy.planner import Plan
from nodeguard.policy.state import GuardState
from nodeguard.sd_notify import Notifier
from nodeguard.sources.sensor import Sensor
from nodeguard.tick_schedule import next_tick

if TYPE_CHECKING:  # features that are off are not imported (the Kubernetes client's httpx, the MQTT client)
    from nodeguard.kubernetes.integration import Kubernetes

log = get_logger("nodeguard.daemon")

# The guard is unhealthy when its last good tick is older than this many ticks (and seconds).
STALE_TICKS, STALE_SECONDS = 10, 30.0
# Descriptors: the soft limit is raised to the hard one (systemd and container runtimes leave the soft one
# at 1024), up to this; client connections are capped far below it (gate.maxConnections, HTTP's cap).
WANTED_OPEN_FILES = 65_536


def raise_open_file_limit(wanted: int = WANTED_OPEN_FILES) -> tuple[int, int]:
    """Raise RLIMIT_NOFILE's soft limit towards the hard one; the (soft, hard) in force after."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = wanted if hard == resource.RLIM_INFINITY else min(wanted, hard)
    if soft != resource.RLIM_INFINITY and soft < target:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
        except (ValueError, OSError) as exc:
            log.warning("cannot raise the open file limit", soft=soft, hard=hard, error=str(exc))
        else:
            soft = target
    log.debug("open file limit", soft=soft, hard=hard)
    return soft, hard


def effective(settings: Settings, dry_run: bool) -> Settings:
    """``--dry-run`` (or actuation.dryRun) makes every action a logged one."""
    if not (dry_run or settings.actuation.dry_run):
        return settings
    return settings.model_copy(
        update={
            "actuation": settings.actuation.model_copy(update={"dry_run": True}),
            "guard": settings.guard.model_copy(update={"dry_run": True}),
        }
    )


def memory_objectives(settings: Settings) -> bool:
    """Whether an objective reads the workloads' memory.high or memory.pressure (memory throttling, memory stall)."""
    return any(
        o.metric == Metric.PROTECTED_MEMORY_STALL
        or (o.action == "throttle" and CAPABILITIES[o.metric].resource is Resource.MEMORY)
        for o in settings.guard.objectives
    )


def held_counts(ledger: Ledger) -> dict[str, int]:
    """How many groups each registered lever holds."""
    return {name: len(ledger.of(name)) for name in levers.NAMES}


def given_back(outcomes: Mapping[Outcome, list[str]]) -> list[str]:
    """The groups a restore of the whole ledger left without a value of nodeguard's (a failed one still has)."""
    return [group for result, groups in outcomes.items() if result is not Outcome.FAILED for group in groups]


def stale_ticks(last_success: float | None, tick_seconds: float) -> str | None:
    """The guard's problem, if any: no good tick yet, or none for STALE_TICKS ticks (and STALE_SECONDS)."""
    if last_success is None:
        return "no successful tick yet"
    age = time.monotonic() - last_success
    return f"no successful tick for {age:.0f}s" if age > max(STALE_TICKS * tick_seconds, STALE_SECONDS) else None


def say_memory_lever(settings: Settings, version: str, available: bool) -> None:
    """Where memory.high is not (cgroup v1), one line at start: memory throttling needs cgroup v2 (the plan blocks
    those objectives)."""
    if available:
        return
    wanted = [
        o.name or f"objectives[{i}]"
        for i, o in enumerate(settings.guard.objectives)
        if o.action == "throttle" and CAPABILITIES[o.metric].resource is Resource.MEMORY
    ]
    say = log.warning if wanted else log.info
    say(
        f"memory throttling needs cgroup v2 (memory.high); this node's cgroup {version} has none, so memory is only "
        "acted on by evict objectives",
        blocked_objectives=wanted,
    )


def without_metadata(settings: Settings, integration: bool, kubepods: bool) -> str | None:
    """What a node with kubelet's pod cgroups and no Kubernetes integration cannot do; None where that is not so."""
    if integration or not kubepods:
        return None
    what = (
        "kubelet's pod cgroups found, but kubernetes.enabled is false: without pod metadata nodeguard cannot honour "
        "system-critical pods, the nodeguard.io annotations, guard.exempt or PodDisruptionBudgets, "
    )
    if settings.guard.candidates.pods_without_metadata:
        return what + (
            "and guard.candidates.podsWithoutMetadata is true: pods are acted on by their cgroup's QoS class alone, "
            "a CNI agent or CoreDNS like batch work, and evicted by killing their cgroup"
        )
    return what + "so it acts on no pod (guard.candidates.podsWithoutMetadata is false)"


class Closable(Protocol):
    def close(self) -> None: ...


# Surfaces (HTTP, metrics) attach to the daemon from above; it never imports them.
Serve = Callable[[str], Awaitable[Closable]]


@dataclass(frozen=True, slots=True)
class DaemonView:
    """What the surfaces read of the running daemon: its last tick and its counters, taken at one moment."""

    last_plan: Plan | None
    last_snapshot: Snapshot | None
    state: GuardState
    actions: Mapping[tuple[str, str, bool], int]  # (kind, metric, dry_run) -> count
    failed_actions: int
    writes: WriteCounters
    reads_skipped: int
    ticks: int
    tick_errors: int
    reloads: Mapping[str, int]
    gate: dict[str, Any]
    coordination: dict[str, Any]
    held: Mapping[str, int]  # groups held back, by lever (every registered lever)
    levers: Mapping[str, Lever] = field(default_factory=dict)  # the levers this hierarchy has, by name
    records: Mapping[str, Mapping[str, LeverRecord]] = field(default_factory=dict)  # the ledger's, by lever, group
    failed_restores: int = 0  # of failed_actions: give-backs the kernel refused


@dataclass
class TickStats:
    ticks: int = 0
    errors: int = 0
    durations: list[float] = field(default_factory=list)  # the last few, seconds
    last_success: float | None = None  # monotonic


class Daemon:
    def __init__(
        self,
        settings: Settings,
        *,
        config_path: Path | None = None,
        labels: Mapping[str, str] | None = None,
        dry_run: bool = False,
        node: str | None = None,
        local_labels: Mapping[str, str] | None = None,
        explicit_labels: Collection[str] = (),
    ) -> None:
        self.config_path = config_path
        self.labels = dict(labels or {})
        # The labels known without the API (hostname, --node-label): a reload lays the API's over them again.
        self.local_labels = dict(local_labels if local_labels is not None else self.labels)
        self.explicit_labels = frozenset(explicit_labels)
        self.dry_run = dry_run
        self.settings = effective(settings, dry_run)
        self.sensor = Sensor(self.settings)
        self._memory_objectives = memory_objectives(self.settings)
        actuation = self.settings.actuation
        self.writer = CgroupWriter(self.sensor.layout.writable, dry_run=actuation.dry_run)
        self.levers = levers.build(self.writer, self.sensor.layout.version)
        self.evictor: Evictor = CgroupEvictor(
            self.writer, self.sensor.layout.version, actuation.eviction_grace_seconds, actuation.freeze_before_eviction
        )
        self.kube: Kubernetes | None = None
        if self.settings.kubernetes.enabled:
            from nodeguard.kubernetes.integration import Kubernetes

            self.kube = Kubernetes(self.settings.kubernetes, node or node_name(), dry_run=actuation.dry_run)
            # Even with evictVia cgroup: it refuses system-critical pods and pods without metadata.
            self.evictor = self.kube.evictor(self.evictor)
        # One nodeguard acts on a node at a time, whatever its paths: hold the node for life, or wait for the
        # daemon on this ledger that holds it (its successor: a rolling update's new pod). NodeBusy otherwise.
        # A dry run writes nothing and may watch beside the one that acts.
        self.succession: Succession | None = None
        holding = True
        if not actuation.dry_run:
            self.succession = Succession(self.writer.root, actuation.ledger_path, self.settings.sensing.proc_root)
            holding = self.succession.claim()
        # A successor reads the ledger once it holds the node: its predecessor saves it when it stops.
        self.ledger = Ledger.load(actuation.ledger_path) if holding else Ledger(actuation.ledger_path)
        self.executor = Executor(self.levers, self.evictor, self.ledger, self._spawn)
        self.coordination = coordination_service(self.settings.coordination, node or node_name())
        self.gate = gate_service(
            self.settings.gate, self.sensor.node.cpus, os.path.dirname(actuation.ledger_path), self.coordination
        )
        self.history = history_of(self.settings.history, actuation.dry_run)
        self.state = GuardState()
        self.changes: list[Done] = []  # the lever changes the last tick made
        self.last_plan: Plan | None = None
        self.last_snapshot: Snapshot | None = None
        self.stats = TickStats()
        self.on_tick: list[Callable[[float], None]] = []  # observers of each tick's duration, in seconds
        self.notifier = Notifier()
        self.stopping = asyncio.Event()
        self.reloads = {"ok": 0, "failed": 0}
        self.warnings: dict[str, str] = {}  # setting -> what it costs, while it does (/status)
        self._group: asyncio.TaskGroup | None = None
        self._last_status = ""
        self._extra_tasks: set[asyncio.Task[None]] = set()
        self._reloading = False
        self._reload_pending = False
        self.room = StartRoom(actuation.ledger_path, self.settings.sensing.proc_root)  # for a starting successor

    # --- lifecycle ----------------------------------------------------------------

    def start(self) -> None:
        """Reconcile the ledger (every lever's records) with the kernel before the first tick: a predecessor's
        handover is adopted, whatever onStart says (the records are still this node's guard's)."""
        say_memory_lever(self.settings, self.sensor.layout.version, MEMORY_HIGH.name in self.levers)
        handover = None if self.succession is None else self.succession.handover()
        if self.ledger.set_aside:
            log.error("ledger was corrupt; restoring only what can be proven", kept_as=self.ledger.set_aside)
        if self.ledger.rejected:
            log.error("ledger records failed their checks; the rest is restored", kept_as=self.ledger.rejected)
        self.history.start()
        if handover is not None:
            self.state = outcome.adopted(self.executor.adopt(), time.monotonic())
            log.info("adopted the predecessor's holds", predecessor=handover.pid, **held_counts(self.ledger))
            self.history.lifecycle("start", "handover", kept=(record.group for record in self.ledger))
            return
        on_start = self.settings.actuation.on_start
        if not self.ledger:
            self.history.lifecycle("start", on_start)
        elif on_start == "adopt":
            self.state = outcome.adopted(self.executor.adopt(), time.monotonic())
            log.info("re-adopted the ledger's records", **held_counts(self.ledger))
            self.history.lifecycle("start", on_start, kept=(record.group for record in self.ledger))
        else:
            outcomes = self.executor.restore_everything()
            log.info("restored the ledger's records", **{k.value: len(v) for k, v in outcomes.items()})
            self.history.lifecycle("start", on_start, restored=given_back(outcomes))

    def stop(self) -> None:
        """Hand every hold over to a successor that waits; else restore them (or keep them, as onExit says)."""
        if self._waits():
            self.close()
            log.info("stopped while waiting for the node; touched nothing")
            return
        self.notifier.notify("STOPPING=1", "STATUS=stopping")
        succession = self.succession
        if succession is not None and succession.successor_waits() and hand_over(self.ledger, succession, held_counts):
            self.close()
            return
        if self.settings.actuation.on_exit == "restore":
            outcomes = self.executor.restore_everything()
            log.info("restored every lever on exit", **{k.value: len(v) for k, v in outcomes.items()})
            self.history.lifecycle("stop", "restore", restored=given_back(outcomes))
        else:
            self.ledger.save()
            log.info("keeping every lever's values on exit", **held_counts(self.ledger))
            self.history.lifecycle("stop", "keep", kept=(record.group for record in self.ledger))
        self.close()

    def close(self) -> None:
        self.history.close()
        self.sensor.close()
        if self.succession is not None:
            self.room.tidy()
            self.succession.release()

    def _waits(self) -> bool:
        return self.succession is not None and self.succession.handovers and not self.succession.holding

    def waiting(self) -> str | None:
        """While this daemon waits for its predecessor to let the node go: what /readyz says; else None."""
        if self.succession is None or not self._waits():
            return None
        return f"waiting for the node lock: {self.succession.holder()} holds it"

    async def _wait_for_node(self, succession: Succession) -> int | None:
        """Wait until the predecessor lets the node go (None: held, the ledger read now), or the exit code."""
        code = await wait_for_node(succession, self.stopping, self.notifier)
        if code is None:
            self.ledger = Ledger.load(self.settings.actuation.ledger_path)
            self.executor = Executor(self.levers, self.evictor, self.ledger, self._spawn)
        return code

    # --- the tick -----------------------------------------------------------------

    def tick(self) -> Plan:
        """One tick (nodeguard.guard_tick): sense, then plan and act until settled; Events, stats, systemd."""
        started = time.monotonic()
        follow = self._memory_objectives or self.ledger.holds(MEMORY_HIGH.name)
        snapshot = sense(self.sensor, follow, None if self.kube is None else self.kube.enrich)
        snapshot = self.room.counted(snapshot, self.succession is not None and self.succession.holding)
        self._warn_without_metadata()
        self.gate.observe(snapshot.node)
        writes = self.writer.counters.writes
        settled = settle(snapshot, self.state, self.settings.guard, self.executor)
        plan, self.state, self.changes = settled.plan, settled.state, settled.done
        # Written after the tick: the plan's changes and the upkeep (drift put back, holds of workloads gone).
        self.history.record(plan, snapshot, settled.every_change, self.settings.guard.candidates)
        if self.kube is not None and self._group is not None:
            self.kube.emit(self.changes, snapshot, self._spawn)
        if self.writer.counters.writes != writes:
            # Start the next rate window after the writes: a window that began
            # before them would show part of the old usage and over-throttle.
            self.sensor.sense()
        self.room.answer(plan)
        if log.is_enabled_for(logging.DEBUG):  # the fields cost building every tick; only at debug level
            log.debug(
                "tick",
                readings={str(m): v for m, v in plan.readings.items() if v is not None},
                throttle_down={str(m): v for m, v in plan.gaps.throttle_down.items()},
                throttle_up={str(m): v for m, v in plan.gaps.throttle_up.items()},
                actions=len(plan.actions),
                blocked=[f"{b.metric}/{b.direction}: {b.cause}" for b in plan.blocked],
                protect_phase=str(self.state.protect.phase),
            )
        self.last_snapshot, self.last_plan = snapshot, plan
        self.stats.ticks += 1
        self.stats.last_success = time.monotonic()
        took = self.stats.last_success - started
        self.stats.durations = [*self.stats.durations[-59:], took]
        for observe in self.on_tick:
            observe(took)
        self._notify_tick(plan)
        return plan

    def _warn_without_metadata(self) -> None:
        """Once kubelet's pods are found (the first tick, at start) and again when what it means changes."""
        warning = without_metadata(self.settings, self.kube is not None, bool(self.sensor.kubepods.tops))
        if warning is None:
            self.warnings.pop("kubernetes.enabled", None)
        elif self.warnings.get("kubernetes.enabled") != warning:
            self.warnings["kubernetes.enabled"] = warning
            log.warning(warning, setting="kubernetes.enabled", kubepods=list(self.sensor.kubepods.tops))

    def _notify_tick(self, plan: Plan) -> None:
        """READY once after the first good tick, WATCHDOG every tick, STATUS as it changes."""
        lines = []
        if self.stats.ticks == 1:
            lines.append("READY=1")
        if self.notifier.watchdog_seconds is not None:
            lines.append("WATCHDOG=1")
        status = (
            f"STATUS={len(plan.actions)} action(s) last tick, {sum(held_counts(self.ledger).values())} held back,"
            f" {plan.workloads} workload(s)"
        )
        if status != self._last_status:
            lines.append(status)
            self._last_status = status
        if lines:
            self.notifier.notify(*lines)

    def view(self) -> DaemonView:
        counters = self.executor.counters
        return DaemonView(
            last_plan=self.last_plan,
            last_snapshot=self.last_snapshot,
            state=self.state,
            actions=dict(counters.actions),
            failed_actions=counters.failed,
            writes=self.writer.counters,
            reads_skipped=self.sensor.skipped,
            ticks=self.stats.ticks,
            tick_errors=self.stats.errors,
            reloads=dict(self.reloads),
            gate=self.gate.status(),
            coordination=self.coordination.status(),
            held=held_counts(self.ledger),
            levers=self.levers,
            records={name: self.ledger.of(name) for name in self.levers},
            failed_restores=counters.failed_restores,
        )

    def ready(self) -> bool:
        return self.stats.last_success is not None

    def health(self) -> dict[str, str | None]:
        """Each part's problem, None when it is fine: /readyz is ready only when every one is None."""
        guard = self.waiting() or stale_ticks(self.stats.last_success, self.settings.sensing.tick_seconds)
        return {"guard": guard, "gate": self.gate.problem(), "writer": self.writer.problem()}

    async def _tick_loop(self) -> None:
        grid = time.monotonic()
        while not self.stopping.is_set():
            try:
                self.tick()
            except Exception as exc:  # a bug in one tick must not take the node's guard down
                self.stats.errors += 1
                log.error("tick failed", error=str(exc), exc_info=True)
            self.history.flush()  # the tick's entries to the history's writer, once the tick is done
            now = time.monotonic()
            grid, due = next_tick(grid, now, self.settings.sensing.tick_seconds)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self.stopping.wait(), timeout=due - now)

    def _spawn(self, coro: Coroutine[Any, Any, None], name: str) -> None:
        assert self._group is not None
        task = self._group.create_task(coro, name=name)
        self._extra_tasks.add(task)
        task.add_done_callback(self._extra_tasks.discard)

    # --- reload -------------------------------------------------------------------

    def reload(self) -> bool:
        """Read, check and apply the config file now (in the caller's thread); False if it was rejected."""
        if self.config_path is None:
            log.info("reload: no config file; nothing to do")
            return True
        new = self._read_settings()
        if new is None:
            return False
        self._apply(new)
        return True

    def _read_settings(self) -> Settings | None:
        """The settings of the config file for this node, or None (rejected, and logged). Safe in a worker thread."""
        if self.config_path is None:
            log.info("reload: no config file; nothing to do")
            return None
        found = read_settings(self.config_path, self.labels, self.reloads)
        return None if found is None else effective(found, self.dry_run)

    def _apply(self, new: Settings) -> None:
        new = kept_on_restart(new, self.settings)
        self.settings = new
        self.sensor.reconfigure(new)
        self._memory_objectives = memory_objectives(new)
        self.gate.reconfigure(new.gate)
        self.coordination.reconfigure(new.coordination)
        if self.kube is not None:
            self.kube.reconfigure(new.kubernetes)
        self.reloads["ok"] += 1
        log.info("config reloaded", source=str(self.config_path))

    def _on_sighup(self) -> None:
        """Reload off the event loop: reading and checking a file must not hold up ticks, the gate or SIGTERM."""
        if self._group is None:  # still starting: reload once the tasks run
            self._reload_pending = True
        elif self._reloading:
            self._reload_pending = True  # once more after the one under way: the file may have changed since
        else:
            self._reloading = True
            self._spawn(self._reload(), "reload")

    async def _reload(self) -> None:
        try:
            while True:
                self._reload_pending = False
                log.info("reloading config", source=str(self.config_path))
                kube = self.kube
                if kube is not None and self.settings.kubernetes.node_labels_from_api:
                    await self._refresh_node_labels(kube)
                new = await asyncio.to_thread(self._read_settings)
                if new is not None:
                    self._apply(new)
                if not self._reload_pending:
                    return
        except Exception as exc:  # inside the TaskGroup: a bug must not stop the guard
            log.error("reload failed", error=str(exc), exc_info=True)
        finally:
            self._reloading = False

    async def _refresh_node_labels(self, kube: Kubernetes) -> None:
        from nodeguard.kubernetes.client import KubeError
        from nodeguard.kubernetes.nodes import merge_labels

        try:
            api = await kube.node_labels()
        except (KubeError, ValueError) as exc:
            log.warning("reload: cannot read this node's labels; using the last known ones", error=str(exc))
        else:
            self.labels = merge_labels(self.local_labels, api, self.explicit_labels)

    # --- run ----------------------------------------------------------------------

    async def run(self, serve: Serve | None = None) -> int:
        """Run until SIGTERM or SIGINT; ``serve`` starts the HTTP surface on ``http.listen``."""
        loop = asyncio.get_running_loop()
        loop.set_exception_handler(log_loop_error)  # asyncio's own errors as structured log lines
        raise_open_file_limit()
        run_as_batch()
        for signum in STOPS:
            loop.add_signal_handler(signum, self.stopping.set)
        loop.add_signal_handler(signal.SIGHUP, self._on_sighup)
        # What arrived before the loop could take the signals (nodeguard run installs EARLY first thing).
        if EARLY.stop is not None:
            log.info("stopping: a signal arrived while starting", signal=EARLY.stop.name)
            self.stop()
            log.info("nodeguard stopped")
            return 0
        self._reload_pending |= EARLY.reload
        http_server: Closable | None = None
        if self.settings.http.enabled and serve is not None:
            # Before anything is touched: a port in use stops the start cleanly.
            try:
                http_server = await serve(self.settings.http.listen)
            except OSError as exc:
                log.error("cannot serve HTTP", listen=self.settings.http.listen, error=str(exc))
                self.close()
                return 1
        if self.succession is not None and self._waits():
            code = await self._wait_for_node(self.succession)
            if code is not None:  # stopped while waiting (0), or the node went to another nodeguard (1)
                await self._shut_down(http_server)
                return code
        self.start()
        log.info(
            "nodeguard running",
            cgroup=self.sensor.layout.version,
            root=self.writer.root,
            tick_seconds=self.settings.sensing.tick_seconds,
            objectives=len(self.settings.guard.objectives),
            dry_run=self.settings.actuation.dry_run,
            http=self.settings.http.listen if http_server is not None else None,
        )
        try:
            async with asyncio.TaskGroup() as group:
                self._group = group
                group.create_task(self._tick_loop(), name="guard")
                services = [
                    group.create_task(self.gate.run(), name="gate"),
                    group.create_task(self.coordination.run(), name="coordination"),
                ]
                if self.kube is not None:
                    services.append(group.create_task(self.kube.run(), name="kubernetes"))
                if self._reload_pending:  # a SIGHUP while starting
                    self._on_sighup()
                await self.stopping.wait()
                for task in [*services, *self._extra_tasks]:
                    task.cancel()
        finally:
            self._group = None
            await self._shut_down(http_server)
        return 0

    async def _shut_down(self, http_server: Closable | None) -> None:
        """The Kubernetes client and HTTP closed, then ``stop``: hand over, give back or keep, as it may."""
        if self.kube is not None:
            await self.kube.aclose()
        if http_server is not None:
            http_server.close()
        self.stop()
        log.info("nodeguard stopped")
