"""Per-cgroup and node readers for the hot path.

Each reader opens its per-tick files once and re-reads them with ``os.pread``
(about 5x cheaper than reopening). A cgroup that was removed makes its kept
descriptors fail with ENODEV or ENOENT: that is a workload that left.
"""

from __future__ import annotations

import errno
import os
from dataclasses import dataclass

from nodeguard.errors import CgroupGone, ParseError
from nodeguard.model.samples import CgroupEvents, CpuMax, CpuStat, LoadAverage, MemInfo, ProcStatCpu, Psi, PsiTotals
from nodeguard.sources.cgroupfs import (
    parse_cfs_quota,
    parse_cgroup_events,
    parse_cpu_max,
    parse_cpu_stat,
    parse_cpu_stat_v1,
    parse_cpu_weight,
    parse_flat_keyed,
    parse_int_or_max,
    parse_memory_limit_v1,
    parse_pids,
    parse_psi,
    parse_psi_totals,
)
from nodeguard.sources.procfs import parse_loadavg, parse_meminfo, parse_proc_stat_cpu
from nodeguard.sources.taskwait import TaskWait, subtree

_ABSENT = -1
_GONE_ERRNOS = frozenset({errno.ENOENT, errno.ENODEV, errno.ESTALE})
_OPEN_FLAGS = os.O_RDONLY | os.O_CLOEXEC
_BUFSIZE = 4096

# cpu.stat, the CPU limit, cpu.pressure totals, memory in use, and (v1) the run-queue wait
# of its threads since the last sample, in ns.
RawSample = tuple[CpuStat, CpuMax | None, PsiTotals | None, int | None, int | None]


def open_optional(path: str) -> int:
    """A descriptor for ``path``, or -1 when the file does not exist (controller off)."""
    try:
        return os.open(path, _OPEN_FLAGS)
    except OSError as exc:
        if exc.errno in _GONE_ERRNOS:
            return _ABSENT
        raise


def pread_text(fd: int, size: int = _BUFSIZE) -> str:
    try:
        return os.pread(fd, size, 0).decode()
    except OSError as exc:
        if exc.errno in _GONE_ERRNOS:
            raise CgroupGone(str(exc)) from None
        raise
    except UnicodeDecodeError:
        raise ParseError("file is not text") from None


def read_text(path: str) -> str | None:
    """One-off read of a small file; None when it does not exist."""
    fd = open_optional(path)
    if fd == _ABSENT:
        return None
    try:
        return pread_text(fd, 65536)
    finally:
        os.close(fd)


def _close_all(fds: list[int]) -> None:
    for fd in fds:
        if fd != _ABSENT:
            os.close(fd)


@dataclass(frozen=True, slots=True)
class CgroupDetails:
    """Files read on demand (status views, evictors), not every tick."""

    cpu_weight: int | None
    cpu_pressure: Psi | None
    memory_max: int | None  # None: unlimited or no memory controller
    memory_events: dict[str, int] | None
    memory_pressure: Psi | None
    procs: tuple[int, ...]
    events: CgroupEvents | None


# Each file's bytes last read and what they parsed to: (cpu.stat, cpu.max, cpu.pressure).
_Parsed = tuple[object, CpuStat | None, object, CpuMax | None, object, PsiTotals | None]
_UNREAD: _Parsed = (object(), None, object(), None, object(), None)  # equal to no bytes: everything is parsed


class V2Reader:
    """cgroup v2: cpu.stat (required), cpu.max, cpu.pressure, memory.current."""

    __slots__ = ("_last", "_max", "_mem", "_psi", "_stat", "path")

    # A file whose bytes did not change since the last tick parses to the same
    # value: reuse it. Idle cgroups (sandboxes, sleeping services) are common,
    # and a bytes comparison costs a fraction of a parse. Off only to measure.
    reuse_unchanged = True

    def __init__(self, path: str) -> None:
        self.path = path
        self._last: _Parsed = _UNREAD
        stat = open_optional(path + "/cpu.stat")
        if stat == _ABSENT:
            if not os.path.isdir(path):
                raise CgroupGone(path)
            raise ParseError(f"{path}: no cpu.stat (kernel before 4.15?)")
        self._stat = stat
        self._max = open_optional(path + "/cpu.max")
        self._psi = open_optional(path + "/cpu.pressure")
        self._mem = open_optional(path + "/memory.current")

    def sample(self) -> RawSample:
        # The hottest code in nodeguard: one call per workload per tick.
        pread = os.pread
        try:
            stat = pread(self._stat, _BUFSIZE, 0)
            limit = pread(self._max, _BUFSIZE, 0) if self._max != _ABSENT else None
            psi = pread(self._psi, _BUFSIZE, 0) if self._psi != _ABSENT else None
            memory = pread(self._mem, _BUFSIZE, 0) if self._mem != _ABSENT else None
        except OSError as exc:
            if exc.errno in _GONE_ERRNOS:
                raise CgroupGone(self.path) from None
            raise
        last = self._last if self.reuse_unchanged else _UNREAD
        cpu = last[1]
        if cpu is None or stat != last[0]:
            cpu = parse_cpu_stat(stat.decode())
        cpu_max = last[3] if limit == last[2] else (None if limit is None else parse_cpu_max(limit.decode()))
        totals = last[5] if psi == last[4] else (None if psi is None else parse_psi_totals(psi.decode()))
        self._last = (stat, cpu, limit, cpu_max, psi, totals)
        return cpu, cpu_max, totals, None if memory is None else int(memory), None

    def details(self) -> CgroupDetails:
        return read_details_v2(self.path)

    def close(self) -> None:
        _close_all([self._stat, self._max, self._psi, self._mem])
        self._stat = self._max = self._psi = self._mem = _ABSENT


def read_details_v2(path: str) -> CgroupDetails:
    weight = read_text(path + "/cpu.weight")
    cpu_pressure = read_text(path + "/cpu.pressure")
    memory_max = read_text(path + "/memory.max")
    events = read_text(path + "/memory.events")
    pressure = read_text(path + "/memory.pressure")
    procs = read_text(path + "/cgroup.procs")
    cgroup_events = read_text(path + "/cgroup.events")
    if procs is None:
        raise CgroupGone(path)
    return CgroupDetails(
        cpu_weight=parse_cpu_weight(weight) if weight is not None else None,
        cpu_pressure=parse_psi(cpu_pressure) if cpu_pressure else None,
        memory_max=parse_int_or_max(memory_max, "memory.max") if memory_max is not None else None,
        memory_events=parse_flat_keyed(events, "memory.events") if events is not None else None,
        memory_pressure=parse_psi(pressure) if pressure else None,
        procs=parse_pids(procs),
        events=parse_cgroup_events(cgroup_events) if cgroup_events is not None else None,
    )


class V1Reader:
    """cgroup v1: cpuacct.usage (required), cpu.stat, CFS quota, memory usage, the threads' run-queue wait;
    PSI from a v2 mount."""

    __slots__ = ("_mem", "_period", "_psi", "_quota", "_stat", "_usage", "_wait", "memory_path", "path")

    def __init__(
        self,
        cpu_path: str,
        cpuacct_path: str,
        memory_path: str | None,
        unified_path: str | None,
        proc_root: str | None = "/proc",
    ) -> None:
        self.path = cpu_path
        self.memory_path = memory_path
        usage = open_optional(cpuacct_path + "/cpuacct.usage")
        if usage == _ABSENT:
            raise CgroupGone(cpuacct_path)
        self._usage = usage
        self._stat = open_optional(cpu_path + "/cpu.stat")
        self._quota = open_optional(cpu_path + "/cpu.cfs_quota_us")
        self._period = open_optional(cpu_path + "/cpu.cfs_period_us")
        self._mem = open_optional(memory_path + "/memory.usage_in_bytes") if memory_path else _ABSENT
        self._psi = open_optional(unified_path + "/cpu.pressure") if unified_path else _ABSENT
        self._wait = TaskWait(subtree(cpu_path), proc_root) if proc_root is not None else None

    def rescan(self) -> None:
        """Follow the threads of descendants that appeared or left since (containers starting, stopping)."""
        if self._wait is not None:
            self._wait.watch(subtree(self.path))

    def sample(self) -> RawSample:
        usage = pread_text(self._usage)
        stat = pread_text(self._stat) if self._stat != _ABSENT else ""
        cpu = parse_cpu_stat_v1(stat, usage)
        cpu_max = None
        if _ABSENT not in (self._quota, self._period):
            cpu_max = parse_cfs_quota(pread_text(self._quota), pread_text(self._period))
        psi = parse_psi_totals(pread_text(self._psi)) if self._psi != _ABSENT else None
        memory = int(pread_text(self._mem)) if self._mem != _ABSENT else None
        waited = self._wait.waited_ns() if self._wait is not None else None
        return cpu, cpu_max, psi, memory, waited

    def details(self) -> CgroupDetails:
        procs = read_text(self.path + "/cgroup.procs")
        if procs is None:
            raise CgroupGone(self.path)
        limit = read_text(self.memory_path + "/memory.limit_in_bytes") if self.memory_path else None
        shares = read_text(self.path + "/cpu.shares")
        return CgroupDetails(
            # cpu.shares 2..262144 maps onto cpu.weight 1..10000 as the kernel's v1/v2 bridge does.
            cpu_weight=1 + ((int(shares) - 2) * 9999) // 262142 if shares else None,
            cpu_pressure=None,
            memory_max=parse_memory_limit_v1(limit) if limit is not None else None,
            memory_events=None,
            memory_pressure=None,
            procs=parse_pids(procs),
            events=None,
        )

    def close(self) -> None:
        if self._wait is not None:
            self._wait.close()
        _close_all([self._usage, self._stat, self._quota, self._period, self._mem, self._psi])
        self._usage = self._stat = self._quota = self._period = self._mem = self._psi = _ABSENT


CgroupReader = V2Reader | V1Reader


@dataclass(frozen=True, slots=True)
class NodeSample:
    cpu: ProcStatCpu
    load: LoadAverage
    memory: MemInfo
    cpu_pressure: Psi | None
    memory_pressure: Psi | None
    io_pressure: Psi | None


class NodeReader:
    """/proc/stat, /proc/loadavg, /proc/meminfo and /proc/pressure/*, kept open."""

    def __init__(self, proc_root: str = "/proc") -> None:
        self.proc_root = proc_root
        self._stat = os.open(f"{proc_root}/stat", _OPEN_FLAGS)
        self._loadavg = os.open(f"{proc_root}/loadavg", _OPEN_FLAGS)
        self._meminfo = os.open(f"{proc_root}/meminfo", _OPEN_FLAGS)
        self._psi = {kind: open_optional(f"{proc_root}/pressure/{kind}") for kind in ("cpu", "memory", "io")}
        self.cpus = count_cpus(pread_text(self._stat, 1 << 20))

    def _pressure(self, kind: str) -> Psi | None:
        fd = self._psi[kind]
        if fd == _ABSENT:
            return None
        try:
            return parse_psi(pread_text(fd))
        except OSError:  # psi=0 on the kernel command line: the file exists but fails
            return None

    def sample(self) -> NodeSample:
        return NodeSample(
            cpu=parse_proc_stat_cpu(pread_text(self._stat, 512).split("\n", 1)[0]),
            load=parse_loadavg(pread_text(self._loadavg)),
            memory=parse_meminfo(pread_text(self._meminfo, 16384)),
            cpu_pressure=self._pressure("cpu"),
            memory_pressure=self._pressure("memory"),
            io_pressure=self._pressure("io"),
        )

    def close(self) -> None:
        _close_all([self._stat, self._loadavg, self._meminfo, *self._psi.values()])


def count_cpus(proc_stat: str) -> int:
    """Logical CPUs listed in /proc/stat (``cpu0``, ``cpu1`` ...); at least one."""
    count = sum(1 for line in proc_stat.splitlines() if line.startswith("cpu") and line[3:4].isdigit())
    return max(1, count)
