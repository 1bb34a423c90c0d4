"""The per-tick sense pass: read the node and every workload into one Snapshot."""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from types import MappingProxyType
from typing import Protocol

from nodeguard.errors import CgroupGone
from nodeguard.log import RateLimiter, get_logger
from nodeguard.model.rates import fraction
from nodeguard.model.snapshot import NodeUsage, Snapshot, WorkloadUsage
from nodeguard.model.workloads import Workload
from nodeguard.sources.discovery import KubepodsLocator, discover, own_cgroup_path, protect_self
from nodeguard.sources.paths import CgroupLayout, detect_layout
from nodeguard.sources.readers import CgroupReader, NodeReader, NodeSample, V1Reader, V2Reader
from nodeguard.sources.settings import SensingSettings, WorkloadSettings

log = get_logger("nodeguard.sensor")


class SensorSettings(Protocol):
    """The config sections the sensor reads (the node's whole Settings has them)."""

    @property
    def sensing(self) -> SensingSettings: ...

    @property
    def workloads(self) -> WorkloadSettings: ...


# A workload using less CPU than this has no threads worth following for their waits.
ACTIVE_CORES = 0.005


def open_reader(layout: CgroupLayout, workload_id: str, proc_root: str = "/proc", memory: bool = True) -> CgroupReader:
    if layout.version == "v2":
        return V2Reader(f"{layout.tree}/{workload_id}", proc_root, memory)
    assert layout.cpu is not None and layout.cpuacct is not None
    return V1Reader(
        f"{layout.cpu}/{workload_id}",
        f"{layout.cpuacct}/{workload_id}",
        f"{layout.memory}/{workload_id}" if layout.memory else None,
        f"{layout.unified}/{workload_id}" if layout.unified else None,
        proc_root,
    )


class Sensor:
    """Keeps readers of the discovered workloads open and builds a Snapshot per call."""

    def __init__(self, settings: SensorSettings, clock: Callable[[], float] = time.monotonic) -> None:
        self.settings = settings
        self.layout = detect_layout(settings.sensing.cgroup_root, settings.sensing.cgroup_version)
        self.node = NodeReader(settings.sensing.proc_root)
        self._clock = clock
        self._readers: dict[str, tuple[Workload, CgroupReader]] = {}
        self._next_discovery = float("-inf")
        self.kubepods = KubepodsLocator()  # .tops: where kubelet's pods are, as of the last discovery
        self._previous: Snapshot | None = None
        self._warnings = RateLimiter(60.0)
        self.skipped = 0  # workload reads that failed and were skipped, all ticks
        self.memory = True  # read each workload's memory.high and memory.pressure (v2); see follow_memory
        try:
            with open(f"{settings.sensing.proc_root}/self/cgroup", encoding="utf-8") as handle:
                self._own_path = own_cgroup_path(handle.read(), self.layout.version)
        except OSError:
            self._own_path = None

    def reconfigure(self, settings: SensorSettings) -> None:
        self.settings = settings
        self._next_discovery = float("-inf")

    def follow_memory(self, on: bool) -> None:
        """Whether samples carry memory.high and memory.pressure (memory objectives and held memory.high use them)."""
        if on != self.memory:
            self.memory = on
            for workload_id, (_, reader) in self._readers.items():
                try:
                    reader.follow_memory(on)
                except OSError as exc:  # e.g. out of descriptors: its memory reads as missing, the rest go on
                    self._warn(workload_id, "cannot open the workload's memory files", exc)

    def rediscover(self) -> None:
        sensing = self.settings.sensing
        tops = self.kubepods.locate(self.layout.tree, sensing.kubepods_paths) if sensing.kubepods else ()
        found = protect_self(
            discover(self.layout.tree, self.settings.workloads.groups, tops),
            self._own_path,
            os.environ.get("NODEGUARD_POD_UID") or None,
        )
        for workload_id in self._readers.keys() - found.keys():
            self._drop(workload_id)
        for workload_id, workload in found.items():
            held = self._readers.get(workload_id)
            if held is not None:
                if held[0] != workload:  # e.g. a container started in the pod: follow its threads too
                    self._readers[workload_id] = (workload, held[1])
                    held[1].rescan()
                continue
            try:
                self._readers[workload_id] = (
                    workload,
                    open_reader(self.layout, workload_id, sensing.proc_root, self.memory),
                )
            except CgroupGone:
                continue
            except (OSError, ValueError) as exc:
                self._warn(workload_id, "cannot open the workload's cgroup files", exc)
        self._next_discovery = self._clock() + sensing.discovery_seconds

    def _drop(self, workload_id: str) -> None:
        _, reader = self._readers.pop(workload_id)
        reader.close()
        self._warnings.forget({workload_id})

    def _warn(self, workload_id: str, event: str, exc: Exception) -> None:
        if self._warnings.allow(workload_id):
            log.warning(event, workload=workload_id, error=str(exc))

    @property
    def workloads(self) -> dict[str, Workload]:
        return {wid: held[0] for wid, held in self._readers.items()}

    def sense(self) -> Snapshot:
        now = self._clock()
        if now >= self._next_discovery:
            self.rediscover()
        node = self.node.sample()
        previous = self._previous
        interval = now - previous.monotonic if previous is not None else None
        before = previous.workloads if previous is not None else {}
        usages: dict[str, WorkloadUsage] = {}
        gone: list[str] = []
        # Hot loop: rates are computed inline (see model.rates for the rules).
        usec = interval * 1e6 if interval else 0.0
        before_get = before.get
        # Half the cost of WorkloadUsage(...); every field is given, in order (tests/sources/test_calm_tick_reads.py).
        make = tuple.__new__
        for workload_id, (workload, reader) in self._readers.items():
            old = before_get(workload_id)
            # Threads are followed only where there is CPU use to speak of (or none known yet).
            threads = old is None or old.cores is None or old.cores >= ACTIVE_CORES
            try:
                raw = reader.sample(threads)
            except CgroupGone:
                gone.append(workload_id)
                continue
            except (OSError, ValueError) as exc:
                self.skipped += 1
                self._warn(workload_id, "workload skipped this tick", exc)
                continue
            if reader.steady and old is not None and old.cores is not None and old.workload is workload and usec > 0:
                # The same bytes in every file as the last two ticks: the usage the last tick worked out, again.
                usages[workload_id] = old
                continue
            cpu, cpu_max, psi, memory, waits, high, memory_psi = raw
            cores = throttled = stall = waiting = starved = throttled_cores = own_throttled = memory_stall = None
            if old is not None and usec > 0:
                old_cpu = old.cpu
                if cpu is old_cpu:  # cpu.stat's bytes did not change (the reader reused its parse): nothing used
                    cores = throttled_cores = own_throttled = 0.0
                else:
                    used = cpu.usage_usec - old_cpu.usage_usec
                    if used >= 0:  # a reset counter gives no rate
                        cores = used / usec
                    held = cpu.throttled_usec - old_cpu.throttled_usec
                    if held >= 0:
                        throttled_cores = own_throttled = held / usec
                    periods = cpu.nr_periods - old_cpu.nr_periods
                    if periods > 0:
                        throttled = (cpu.nr_throttled - old_cpu.nr_throttled) / periods
                        throttled = 0.0 if throttled < 0 else 1.0 if throttled > 1 else throttled
                old_psi = old.cpu_pressure
                # Unchanged bytes, the same parse: no stall (old's stall known: there is a "some" total).
                if psi is old_psi and old.cpu_stall_pct is not None:
                    stall = 0.0
                elif psi is not None and old_psi is not None:
                    some, old_some = psi.some_usec, old_psi.some_usec
                    if some is not None and old_some is not None and some >= old_some:
                        stall = 100.0 * (some - old_some) / usec
                if memory_psi is not None and old.memory_pressure is not None:
                    some, old_some = memory_psi.some_usec, old.memory_pressure.some_usec
                    if some is not None and old_some is not None and some >= old_some:
                        memory_stall = 100.0 * (some - old_some) / usec
            if waits is not None and waits.interval_ns > 0:
                waiting = waits.waited_ns / waits.interval_ns
                starved = waits.starved_ns / waits.interval_ns
                # A container's own limit throttles it where the pod's cpu.stat does not see it.
                inner = waits.throttled_ns / waits.interval_ns
                if throttled_cores is None or inner > throttled_cores:
                    throttled_cores = inner
            usages[workload_id] = make(WorkloadUsage, (
                workload, cpu, cpu_max, psi, memory, cores, throttled, stall, waiting, starved, throttled_cores, high,
                memory_psi, memory_stall, own_throttled,
            ))  # fmt: skip
        for workload_id in gone:
            self._drop(workload_id)
        snapshot = Snapshot(
            monotonic=now,
            wall_time=time.time(),
            interval=interval,
            cgroup_version=self.layout.version,
            node=self._node_usage(node, previous),
            workloads=MappingProxyType(usages),
        )
        self._previous = snapshot
        return snapshot

    def _node_usage(self, sample: NodeSample, previous: Snapshot | None) -> NodeUsage:
        cpus = self.node.cpus
        utilization = None
        before = None if previous is None else previous.node.cpu
        if sample.cpu is not None and before is not None:
            busy = fraction(sample.cpu.busy - before.busy, sample.cpu.total - before.total)
            utilization = None if busy is None else 100.0 * busy
        return NodeUsage(
            cpus=cpus,
            cpu=sample.cpu,
            cores_used=None if utilization is None else utilization * cpus / 100.0,
            cpu_utilization=utilization,
            load=sample.load,
            memory=sample.memory,
            cpu_pressure=sample.cpu_pressure,
            memory_pressure=sample.memory_pressure,
            io_pressure=sample.io_pressure,
        )

    def close(self) -> None:
        for workload_id in list(self._readers):
            self._drop(workload_id)
        self.node.close()
