"""Per-cgroup and node readers for the hot path.

Each reader opens its per-tick files once and re-reads them with ``os.pread``
(about 5x cheaper than reopening). A cgroup that was removed makes its kept
descriptors fail with ENODEV or ENOENT: that is a workload that left.
"""

from __future__ import annotations

import errno
import math
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

from nodeguard.errors import CgroupGone, ParseError
from nodeguard.log import RateLimiter, get_logger
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
    shares_to_weight,
)
from nodeguard.sources.procfs import parse_loadavg, parse_meminfo, parse_proc_stat_cpu
from nodeguard.sources.taskwait import TaskWait, Waits, subtree

log = get_logger("nodeguard.readers")

_ABSENT = -1
_GONE_ERRNOS = frozenset({errno.ENOENT, errno.ENODEV, errno.ESTALE})
_OPEN_FLAGS = os.O_RDONLY | os.O_CLOEXEC
_BUFSIZE = 4096

# cpu.stat, the CPU limit, cpu.pressure totals, memory in use, the run-queue waits of its
# threads since the last sample (None when not followed), memory.high (math.inf: "max"; None:
# no such file) and memory.pressure totals (cgroup v2 only).
RawSample = tuple[CpuStat, CpuMax | None, PsiTotals | None, int | None, Waits | None, float | None, PsiTotals | None]


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


_UNSEEN = object()  # equal to no bytes read: the next sample parses the file


def parse_memory_high(raw: bytes | None) -> float | None:
    """memory.high in bytes, math.inf for "max"; None when absent or read empty (a group being removed)."""
    if not raw or not raw.strip():
        return None
    return math.inf if raw.strip() == b"max" else int(raw)


def _follow(waits: TaskWait | None, threads: bool) -> Waits | None:
    if waits is None:
        return None
    if not threads:
        waits.pause()
        return None
    return waits.sample()


class V2Reader:
    """cgroup v2: cpu.stat (required), cpu.max, cpu.pressure, memory.current; its threads' run-queue wait."""

    __slots__ = (
        "_cpu", "_cpu_max", "_high", "_last_high", "_last_max", "_last_mem", "_last_mem_psi", "_last_psi",
        "_last_stat", "_max", "_mem", "_mem_psi", "_memory_high", "_memory_psi", "_psi", "_stat", "_totals",
        "_unchanged", "_used", "_wait", "path", "steady",
    )  # fmt: skip

    # A file whose bytes did not change since the last tick parses to the same
    # value: reuse it. Idle cgroups (sandboxes, sleeping services) are common,
    # and a bytes comparison costs a fraction of a parse. Off only to measure.
    reuse_unchanged = True

    def __init__(self, path: str, proc_root: str | None = "/proc", memory: bool = True) -> None:
        self.path = path
        self._forget_parses()
        stat = open_optional(path + "/cpu.stat")
        if stat == _ABSENT:
            if not os.path.isdir(path):
                raise CgroupGone(path)
            raise ParseError(f"{path}: no cpu.stat (kernel before 4.15?)")
        self._stat = stat
        self._max = open_optional(path + "/cpu.max")
        self._psi = open_optional(path + "/cpu.pressure")
        self._mem = open_optional(path + "/memory.current")
        self._high = self._mem_psi = _ABSENT
        self.follow_memory(memory)
        self._wait = TaskWait(subtree(path), proc_root, "cgroup.threads") if proc_root is not None else None

    def _forget_parses(self) -> None:
        """Forget each file's last bytes (``_last_*``) and its parse: the next sample parses every file."""
        self._last_stat = self._last_max = self._last_psi = self._last_mem = _UNSEEN
        self._last_high = self._last_mem_psi = _UNSEEN
        # steady: this sample and the one before read the same bytes in every file and no thread was followed, so
        # the sample is the last one's objects and the rates from it are those of the last tick (sensor.py).
        self._unchanged = self.steady = False
        self._cpu: CpuStat | None = None
        self._cpu_max: CpuMax | None = None
        self._totals: PsiTotals | None = None
        self._used: int | None = None
        self._memory_high: float | None = None
        self._memory_psi: PsiTotals | None = None

    def follow_memory(self, on: bool) -> None:
        """Read memory.high and memory.pressure each sample, or not (no memory objective: two reads saved)."""
        if on:
            # One at a time: after an OSError the file already open stays followed, the other reads as missing.
            if self._high == _ABSENT:
                self._high = open_optional(self.path + "/memory.high")
            if self._mem_psi == _ABSENT:
                self._mem_psi = open_optional(self.path + "/memory.pressure")
        else:
            _close_all([self._high, self._mem_psi])
            self._high = self._mem_psi = _ABSENT

    def rescan(self) -> None:
        """Follow the threads of descendants that appeared or left since (containers starting, stopping)."""
        if self._wait is not None:
            self._wait.watch(subtree(self.path))

    def sample(self, threads: bool = True) -> RawSample:
        """One reading; ``threads``: follow its threads' waits too (skipped for idle workloads)."""
        # The hottest code in nodeguard: one call per workload per tick. A file
        # read as the same bytes as last time keeps its parse: an idle cgroup
        # costs its reads and a comparison per file, and builds nothing.
        pread = os.pread
        try:
            stat = pread(self._stat, _BUFSIZE, 0)
            limit = pread(self._max, _BUFSIZE, 0) if self._max != _ABSENT else None
            psi = pread(self._psi, _BUFSIZE, 0) if self._psi != _ABSENT else None
            memory = pread(self._mem, _BUFSIZE, 0) if self._mem != _ABSENT else None
            high = pread(self._high, _BUFSIZE, 0) if self._high != _ABSENT else None
            mem_psi = pread(self._mem_psi, _BUFSIZE, 0) if self._mem_psi != _ABSENT else None
        except OSError as exc:
            self._unchanged = False  # a tick without its sample: the next one is not the last one's again
            if exc.errno in _GONE_ERRNOS:
                raise CgroupGone(self.path) from None
            raise
        if not self.reuse_unchanged:
            self._forget_parses()
        # Each parse is kept with its bytes only once it succeeded.
        unchanged = True
        if stat != self._last_stat:
            unchanged = False
            self._cpu = parse_cpu_stat(stat.decode())
            self._last_stat = stat
        if limit != self._last_max:
            unchanged = False
            self._cpu_max = None if limit is None else parse_cpu_max(limit.decode())
            self._last_max = limit
        # A cgroup being removed can read empty: that reading is missing, the CPU sample stands.
        if psi != self._last_psi:
            unchanged = False
            self._totals = parse_psi_totals(psi.decode()) if psi and psi.strip() else None
            self._last_psi = psi
        if memory != self._last_mem:
            unchanged = False
            self._used = int(memory) if memory and memory.strip() else None
            self._last_mem = memory
        if high != self._last_high:
            unchanged = False
            self._memory_high = parse_memory_high(high)
            self._last_high = high
        if mem_psi != self._last_mem_psi:
            unchanged = False
            self._memory_psi = parse_psi_totals(mem_psi.decode()) if mem_psi and mem_psi.strip() else None
            self._last_mem_psi = mem_psi
        waits = None
        wait = self._wait
        if wait is not None:
            if threads:
                waits = wait.sample()
                unchanged = False
            else:
                wait.pause()
        self.steady = unchanged and self._unchanged
        self._unchanged = unchanged
        cpu = self._cpu
        assert cpu is not None  # cpu.stat was parsed above or on an earlier sample
        return cpu, self._cpu_max, self._totals, self._used, waits, self._memory_high, self._memory_psi

    def details(self) -> CgroupDetails:
        return read_details_v2(self.path)

    def close(self) -> None:
        if self._wait is not None:
            self._wait.close()
        _close_all([self._stat, self._max, self._psi, self._mem, self._high, self._mem_psi])
        self._stat = self._max = self._psi = self._mem = self._high = self._mem_psi = _ABSENT


def read_detail(path: str) -> str | None:
    """A detail file's text; None when it is absent or empty (a cgroup being removed can read empty)."""
    text = read_text(path)
    return text if text and not text.isspace() else None


def read_details_v2(path: str) -> CgroupDetails:
    weight = read_detail(path + "/cpu.weight")
    cpu_pressure = read_detail(path + "/cpu.pressure")
    memory_max = read_detail(path + "/memory.max")
    events = read_detail(path + "/memory.events")
    pressure = read_detail(path + "/memory.pressure")
    procs = read_text(path + "/cgroup.procs")
    cgroup_events = read_detail(path + "/cgroup.events")
    if procs is None:
        raise CgroupGone(path)
    return CgroupDetails(
        cpu_weight=parse_cpu_weight(weight) if weight is not None else None,
        cpu_pressure=parse_psi(cpu_pressure) if cpu_pressure is not None else None,
        memory_max=parse_int_or_max(memory_max, "memory.max") if memory_max is not None else None,
        memory_events=parse_flat_keyed(events, "memory.events") if events is not None else None,
        memory_pressure=parse_psi(pressure) if pressure is not None else None,
        procs=parse_pids(procs),
        events=parse_cgroup_events(cgroup_events) if cgroup_events is not None else None,
    )


class V1Reader:
    """cgroup v1: cpuacct.usage (required), cpu.stat, CFS quota, memory usage, the threads' run-queue wait;
    PSI from a v2 mount."""

    __slots__ = ("_mem", "_period", "_psi", "_quota", "_stat", "_usage", "_wait", "memory_path", "path")

    steady = False  # every sample parsed afresh: never the last one's objects (V2Reader.steady)

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

    def follow_memory(self, on: bool) -> None:
        """cgroup v1 has neither memory.high nor memory.pressure: nothing to follow."""

    def sample(self, threads: bool = True) -> RawSample:
        """One reading; ``threads``: follow its threads' waits too (skipped for idle workloads)."""
        usage = pread_text(self._usage)
        stat = pread_text(self._stat) if self._stat != _ABSENT else ""
        cpu = parse_cpu_stat_v1(stat, usage)
        cpu_max = None
        if _ABSENT not in (self._quota, self._period):
            cpu_max = parse_cfs_quota(pread_text(self._quota), pread_text(self._period))
        psi_text = _other_hierarchy(self._psi)
        memory_text = _other_hierarchy(self._mem)
        psi = parse_psi_totals(psi_text) if psi_text else None
        used = int(memory_text) if memory_text else None
        return cpu, cpu_max, psi, used, _follow(self._wait, threads), None, None  # v1: no memory.high, no PSI

    def details(self) -> CgroupDetails:
        procs = read_text(self.path + "/cgroup.procs")
        if procs is None:
            raise CgroupGone(self.path)
        limit = read_detail(self.memory_path + "/memory.limit_in_bytes") if self.memory_path else None
        shares = read_detail(self.path + "/cpu.shares")
        return CgroupDetails(
            cpu_weight=shares_to_weight(int(shares)) if shares else None,
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


def _other_hierarchy(fd: int) -> str | None:
    """A v1 workload's file outside its cpu hierarchy (memory, the v2 mount's PSI), stripped.

    None when there is none, it reads empty, or its group went first: kubelet
    removes a pod's group from each hierarchy in turn, and the cpu one decides
    whether the workload is still there.
    """
    if fd == _ABSENT:
        return None
    try:
        return pread_text(fd).strip() or None
    except CgroupGone:
        return None


CgroupReader = V2Reader | V1Reader


@dataclass(frozen=True, slots=True)
class NodeSample:
    """The node's files this tick; a file that could not be read or parsed is None."""

    cpu: ProcStatCpu | None
    load: LoadAverage | None
    memory: MemInfo | None
    cpu_pressure: Psi | None
    memory_pressure: Psi | None
    io_pressure: Psi | None


_T = TypeVar("_T")


class NodeReader:
    """/proc/stat, /proc/loadavg, /proc/meminfo and /proc/pressure/*, kept open.

    A node file that fails or reads badly leaves only what needs it without a
    value this tick (warned once a minute per file); /proc/stat must be there
    at start, for the number of CPUs.
    """

    def __init__(self, proc_root: str = "/proc") -> None:
        self.proc_root = proc_root
        self._stat = os.open(f"{proc_root}/stat", _OPEN_FLAGS)
        self._loadavg = open_optional(f"{proc_root}/loadavg")
        self._meminfo = open_optional(f"{proc_root}/meminfo")
        self._psi = {kind: open_optional(f"{proc_root}/pressure/{kind}") for kind in ("cpu", "memory", "io")}
        self._warnings = RateLimiter(60.0)
        self.cpus = count_cpus(pread_text(self._stat, 1 << 20))

    def _read(
        self, fd: int, name: str, parse: Callable[[str], _T], *, size: int = _BUFSIZE, warn: bool = True
    ) -> _T | None:
        if fd == _ABSENT:
            return None
        try:
            return parse(pread_text(fd, size))
        except (OSError, CgroupGone, ParseError) as exc:
            if warn and self._warnings.allow(name):
                log.warning("node file unreadable; what needs it has no value this tick", file=name, error=str(exc))
            return None

    def sample(self) -> NodeSample:
        root = self.proc_root
        return NodeSample(
            cpu=self._read(self._stat, f"{root}/stat", _first_line_cpu, size=512),
            load=self._read(self._loadavg, f"{root}/loadavg", parse_loadavg),
            memory=self._read(self._meminfo, f"{root}/meminfo", parse_meminfo, size=16384),
            # psi=0 on the kernel command line: the files exist but fail, every tick.
            cpu_pressure=self._read(self._psi["cpu"], "cpu", parse_psi, warn=False),
            memory_pressure=self._read(self._psi["memory"], "memory", parse_psi, warn=False),
            io_pressure=self._read(self._psi["io"], "io", parse_psi, warn=False),
        )

    def close(self) -> None:
        _close_all([self._stat, self._loadavg, self._meminfo, *self._psi.values()])


def _first_line_cpu(proc_stat: str) -> ProcStatCpu:
    return parse_proc_stat_cpu(proc_stat.split("\n", 1)[0])


def count_cpus(proc_stat: str) -> int:
    """Logical CPUs listed in /proc/stat (``cpu0``, ``cpu1`` ...); at least one."""
    count = sum(1 for line in proc_stat.splitlines() if line.startswith("cpu") and line[3:4].isdigit())
    return max(1, count)
