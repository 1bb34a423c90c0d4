"""Pure parsers for cgroup v2 and v1 files.

Kernels add keys over versions and sometimes insert them before the ones we
need, so every parser reads by key and ignores what it does not know.
"""

from __future__ import annotations

from nodeguard.errors import ParseError
from nodeguard.model.samples import CgroupEvents, CpuMax, CpuStat, Psi, PsiLine, PsiTotals

# v1 writes "unlimited" as the largest page-aligned value below 2**63, which
# depends on the page size; anything this large is no real limit.
V1_UNLIMITED_FLOOR = 1 << 62


def parse_flat_keyed(text: str, what: str = "flat-keyed file") -> dict[str, int]:
    """Parse ``key value`` lines (cpu.stat, memory.events, memory.stat)."""
    tokens = text.split()
    if len(tokens) % 2:
        raise ParseError(f"{what}: odd number of fields in {text[:80]!r}")
    try:
        return {key: int(value) for key, value in zip(tokens[::2], tokens[1::2], strict=True)}
    except ValueError:
        raise ParseError(f"{what}: non-integer value in {text[:80]!r}") from None


def parse_cpu_stat(text: str) -> CpuStat:
    """Parse v2 ``cpu.stat``; only ``usage_usec`` is required.

    Runs once per workload per tick, so only the six values kept are converted.
    """
    tokens = text.split()
    if len(tokens) % 2:
        raise ParseError(f"cpu.stat: odd number of fields in {text[:80]!r}")
    pairs = iter(tokens)
    values = dict(zip(pairs, pairs, strict=True))
    get = values.get
    try:
        return CpuStat(
            int(values["usage_usec"]),
            int(get("user_usec", 0)),
            int(get("system_usec", 0)),
            int(get("nr_periods", 0)),
            int(get("nr_throttled", 0)),
            int(get("throttled_usec", 0)),
        )
    except KeyError:
        raise ParseError(f"cpu.stat: no usage_usec in {text[:80]!r}") from None
    except ValueError:
        raise ParseError(f"cpu.stat: non-integer value in {text[:80]!r}") from None


def parse_cpu_max(text: str) -> CpuMax:
    """Parse v2 ``cpu.max``: ``"<quota> <period>"`` or ``"max <period>"``."""
    fields = text.split()
    if not 1 <= len(fields) <= 2:
        raise ParseError(f"cpu.max: expected '<quota|max> <period>', got {text!r}")
    try:
        period = int(fields[1]) if len(fields) == 2 else 100_000
        quota = None if fields[0] == "max" else int(fields[0])
    except ValueError:
        raise ParseError(f"cpu.max: expected '<quota|max> <period>', got {text!r}") from None
    if period <= 0 or (quota is not None and quota <= 0):
        raise ParseError(f"cpu.max: quota and period must be positive, got {text!r}")
    return CpuMax(quota, period)


def parse_int_or_max(text: str, what: str) -> int | None:
    """Parse a single number, or the word ``max`` (None: no limit)."""
    value = text.strip()
    if value == "max":
        return None
    try:
        return int(value)
    except ValueError:
        raise ParseError(f"{what}: expected a number or 'max', got {text[:80]!r}") from None


def shares_to_weight(shares: int) -> int:
    """cgroup v1 ``cpu.shares`` [2, 262144] as v2 ``cpu.weight`` [1, 10000]: the kernel's and kubelet's mapping."""
    return 1 + ((shares - 2) * 9999) // 262142


def parse_cpu_weight(text: str) -> int:
    weight = parse_int_or_max(text, "cpu.weight")
    if weight is None or not 1 <= weight <= 10_000:
        raise ParseError(f"cpu.weight: expected 1..10000, got {text!r}")
    return weight


def _psi_line(fields: list[str], text: str) -> PsiLine:
    values: dict[str, str] = {}
    for field in fields:
        key, sep, value = field.partition("=")
        if not sep:
            raise ParseError(f"pressure: expected key=value, got {field!r} in {text[:120]!r}")
        values[key] = value
    try:
        return PsiLine(
            float(values["avg10"]),
            float(values["avg60"]),
            float(values["avg300"]),
            int(values["total"]),
        )
    except (KeyError, ValueError):
        raise ParseError(f"pressure: missing or bad averages in {text[:120]!r}") from None


def parse_psi(text: str) -> Psi:
    """Parse a PSI file (``cpu.pressure``, ``/proc/pressure/io`` ...).

    ``full`` is absent on CPU before 5.13 and ``some`` is absent in
    ``/proc/pressure/irq``; unknown line kinds are ignored.
    """
    some = full = None
    for line in text.splitlines():
        fields = line.split()
        if not fields:
            continue
        kind = fields[0]
        if kind == "some":
            some = _psi_line(fields[1:], text)
        elif kind == "full":
            full = _psi_line(fields[1:], text)
    if some is None and full is None:
        raise ParseError(f"pressure: no 'some' or 'full' line in {text[:120]!r}")
    return Psi(some, full)


def parse_psi_totals(text: str) -> PsiTotals:
    """Only the cumulative ``total=`` of each line: the cheap per-tick reading of a PSI file.

    The kernel's own layout (a ``some`` line, a ``full`` line, ``total=`` last)
    takes a fast path; anything else is read by key.
    """
    some_line, _, rest = text.partition("\n")
    full_line = rest.partition("\n")[0]
    if some_line.startswith("some ") and full_line.startswith("full "):
        at_some, at_full = some_line.rfind(" total="), full_line.rfind(" total=")
        if at_some > 0 and at_full > 0:
            try:
                return PsiTotals(int(some_line[at_some + 7 :]), int(full_line[at_full + 7 :]))
            except ValueError:
                pass  # something after total=: the general reading below
    return _psi_totals_by_key(text)


def _psi_totals_by_key(text: str) -> PsiTotals:
    some = full = None
    chunks = text.split(" total=")
    for i in range(1, len(chunks)):
        before = chunks[i - 1]
        line_start = before.rfind("\n") + 1
        value = chunks[i].split(None, 1)
        try:
            total = int(value[0])
        except (IndexError, ValueError):
            raise ParseError(f"pressure: bad total in {text[:120]!r}") from None
        if before.startswith("some ", line_start):
            some = total
        elif before.startswith("full ", line_start):
            full = total
    if some is None and full is None:
        raise ParseError(f"pressure: no 'some' or 'full' total in {text[:120]!r}")
    return PsiTotals(some, full)


def parse_pids(text: str) -> tuple[int, ...]:
    """Parse ``cgroup.procs`` / ``cgroup.threads`` / v1 ``tasks``."""
    try:
        return tuple(int(pid) for pid in text.split())
    except ValueError:
        raise ParseError(f"cgroup.procs: non-numeric pid in {text[:80]!r}") from None


def parse_cgroup_events(text: str) -> CgroupEvents:
    values = parse_flat_keyed(text, "cgroup.events")
    if "populated" not in values:
        raise ParseError(f"cgroup.events: no 'populated' in {text[:80]!r}")
    frozen = values.get("frozen")
    return CgroupEvents(bool(values["populated"]), None if frozen is None else bool(frozen))


# --- cgroup v1 ---------------------------------------------------------------


def parse_cfs_quota(quota_text: str, period_text: str) -> CpuMax:
    """Combine v1 ``cpu.cfs_quota_us`` (-1: unlimited) and ``cpu.cfs_period_us``."""
    try:
        quota = int(quota_text)
        period = int(period_text)
    except ValueError:
        raise ParseError(
            f"cpu.cfs_quota_us/cpu.cfs_period_us: expected numbers, got {quota_text!r} and {period_text!r}"
        ) from None
    if period <= 0 or quota == 0 or quota < -1:
        raise ParseError(f"cpu.cfs_quota_us: bad quota {quota} or period {period}")
    return CpuMax(None if quota == -1 else quota, period)


def parse_cpu_stat_v1(stat_text: str, usage_ns_text: str) -> CpuStat:
    """Combine v1 ``cpu.stat`` (throttled_time in ns) and ``cpuacct.usage`` (ns)."""
    values = parse_flat_keyed(stat_text, "cpu.stat (v1)")
    try:
        usage_ns = int(usage_ns_text)
    except ValueError:
        raise ParseError(f"cpuacct.usage: expected a number, got {usage_ns_text[:80]!r}") from None
    return CpuStat(
        usage_ns // 1000,
        nr_periods=values.get("nr_periods", 0),
        nr_throttled=values.get("nr_throttled", 0),
        throttled_usec=values.get("throttled_time", 0) // 1000,
    )


def parse_memory_limit_v1(text: str) -> int | None:
    """Parse ``memory.limit_in_bytes``; values close to 2**63 mean unlimited."""
    limit = parse_int_or_max(text, "memory.limit_in_bytes")
    if limit is None or limit >= V1_UNLIMITED_FLOOR:
        return None
    return limit
