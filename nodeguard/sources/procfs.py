"""Pure parsers for the node-wide files under /proc."""

from __future__ import annotations

from nodeguard.errors import ParseError
from nodeguard.model.samples import LoadAverage, MemInfo, ProcStatCpu


def parse_proc_stat_cpu(text: str) -> ProcStatCpu:
    """Parse the aggregate ``cpu`` line of /proc/stat.

    guest and guest_nice are already counted in user and nice, so the total
    is the first eight fields (old kernels write fewer).
    """
    for line in text.splitlines():
        fields = line.split()
        if fields and fields[0] == "cpu":
            break
    else:
        raise ParseError(f"/proc/stat: no aggregate 'cpu' line in {text[:80]!r}")
    try:
        ticks = [int(value) for value in fields[1:9]]
    except ValueError:
        raise ParseError(f"/proc/stat: non-numeric cpu field in {line[:120]!r}") from None
    if len(ticks) < 4:
        raise ParseError(f"/proc/stat: too few cpu fields in {line[:120]!r}")
    idle = ticks[3] + (ticks[4] if len(ticks) > 4 else 0)
    return ProcStatCpu(total=sum(ticks), idle=idle)


def parse_loadavg(text: str) -> LoadAverage:
    fields = text.split()
    try:
        runnable, _, threads = fields[3].partition("/")
        return LoadAverage(float(fields[0]), float(fields[1]), float(fields[2]), int(runnable), int(threads))
    except (IndexError, ValueError):
        raise ParseError(f"/proc/loadavg: unexpected format {text[:80]!r}") from None


_UNITS = {"kB": 1024, "B": 1}


def parse_meminfo(text: str) -> MemInfo:
    """Parse /proc/meminfo, splitting on any whitespace (one kernel used a tab)."""
    values: dict[str, int] = {}
    for line in text.splitlines():
        fields = line.split()
        if len(fields) < 2:
            continue
        try:
            values[fields[0].rstrip(":")] = int(fields[1]) * _UNITS.get(fields[2] if len(fields) > 2 else "B", 1)
        except ValueError:
            continue
    if "MemTotal" not in values:
        raise ParseError(f"/proc/meminfo: no MemTotal in {text[:80]!r}")
    available = values.get("MemAvailable")
    if available is None:  # kernels before 3.14
        available = sum(values.get(key, 0) for key in ("MemFree", "Buffers", "Cached"))
    return MemInfo(total=values["MemTotal"], available=available)
