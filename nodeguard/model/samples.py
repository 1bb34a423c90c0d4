"""Parsed kernel readings: one small immutable value per file format."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class CpuStat:
    """cgroup CPU accounting, normalised to microseconds for v1 and v2 alike."""

    usage_usec: int
    user_usec: int = 0
    system_usec: int = 0
    nr_periods: int = 0
    nr_throttled: int = 0
    throttled_usec: int = 0


@dataclass(frozen=True, slots=True)
class CpuMax:
    """A CFS bandwidth limit; ``quota_us`` None means unlimited ("max")."""

    quota_us: int | None
    period_us: int = 100_000

    @property
    def cores(self) -> float | None:
        return None if self.quota_us is None else self.quota_us / self.period_us

    def render_v2(self) -> str:
        quota = "max" if self.quota_us is None else str(self.quota_us)
        return f"{quota} {self.period_us}"


@dataclass(frozen=True, slots=True)
class PsiLine:
    """One line of a pressure file: averages in percent, total in microseconds."""

    avg10: float
    avg60: float
    avg300: float
    total_usec: int


@dataclass(frozen=True, slots=True)
class Psi:
    """A pressure file; ``full`` is None where the kernel does not report it."""

    some: PsiLine | None
    full: PsiLine | None


@dataclass(frozen=True, slots=True)
class CgroupEvents:
    """cgroup.events; ``frozen`` is None on kernels that lack the key."""

    populated: bool
    frozen: bool | None


@dataclass(frozen=True, slots=True)
class ProcStatCpu:
    """The aggregate ``cpu`` line of /proc/stat, in USER_HZ ticks."""

    total: int
    idle: int  # idle + iowait: time no task wanted the CPU

    @property
    def busy(self) -> int:
        return self.total - self.idle


@dataclass(frozen=True, slots=True)
class LoadAverage:
    load1: float
    load5: float
    load15: float
    runnable: int
    threads: int


@dataclass(frozen=True, slots=True)
class MemInfo:
    """The /proc/meminfo figures nodeguard uses, in bytes."""

    total: int
    available: int
