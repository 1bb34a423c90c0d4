"""What the guard holds back, one record shape per lever, all behind one protocol (``Hold``).

The guard state keeps every hold keyed by (lever, group). Each kind says which
lever it is (``lever``), whether its group is a workload that can leave the
node (``on_workload``: a QoS tier held by a weight is not one), how it shows in
the trace, and how it follows an original that moved or comes back from the
ledger at start; the folds and adoption are then the same for every lever.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass, replace
from typing import Any, ClassVar, NamedTuple, Protocol, Self, TypeVar

from nodeguard.model.levers import CPU_QUOTA, CPU_WEIGHT, MEMORY_HIGH, LeverKey
from nodeguard.model.samples import CpuMax
from nodeguard.policy.metrics import Metric

STALL = Metric.PROTECTED_CPU_STALL


def cpu_max_data(limit: CpuMax) -> dict[str, Any]:
    return {"quota_us": limit.quota_us, "period_us": limit.period_us, "cores": limit.cores}


def bytes_shown(value: int | None) -> int | str:
    """A memory.high value as shown: bytes, or "max"."""
    return "max" if value is None else value


def quota_text(limit: CpuMax) -> str:
    return limit.render_v2()


def memory_text(value: int | None) -> str:
    return "max" if value is None else str(value)


def memory_value(text: str) -> int | None:
    return None if text == "max" else int(text)


def reasons_of(reason: str) -> frozenset[Metric]:
    """A ledger record's reason as the metrics it names (none for an older or foreign reason)."""
    return frozenset({Metric(reason)}) if reason in Metric._value2member_map_ else frozenset()


class Hold(Protocol):
    lever: ClassVar[str]
    trace_key: ClassVar[str]  # its section of the trace's state
    on_workload: ClassVar[bool]  # its group is a workload: held for one that left the node, it is given back

    @property
    def group(self) -> str: ...

    @property
    def reasons(self) -> frozenset[Metric]: ...

    def moved(self, original: str) -> Self:
        """The hold under a new original (the lever's canonical text) someone set behind nodeguard."""
        ...

    def trace(self) -> dict[str, Any]: ...

    def lever_shown(self) -> str:
        """The lever as a protected workload's trace entry names it."""
        ...

    @classmethod
    def adopted(cls, group: str, original: str, applied: str, reason: str, now: float) -> Self:
        """A ledger record a restarted daemon keeps holding."""
        ...


class QuotaDetails(NamedTuple):
    """A quota change as the trace shows it: the limits in cores, and what it releases or whether it released.

    A named tuple, as LeverChange: one per throttle of a busy tick."""

    quota: CpuMax
    previous: CpuMax
    original: CpuMax
    release_cores: float | None = None  # a throttle's
    full: bool | None = None  # a restore's

    def fields(self) -> Iterable[tuple[str, object]]:
        yield "quota", cpu_max_data(self.quota)
        yield "previous", cpu_max_data(self.previous)
        yield "original", cpu_max_data(self.original)
        yield "lever", quota_lever_shown(self.quota, self.original)
        if self.release_cores is not None:
            yield "release_cores", self.release_cores
        if self.full is not None:
            yield "full", self.full


class MemoryDetails(NamedTuple):
    """A memory.high change as the trace shows it: bytes (or "max"), and what it may release or whether it
    released."""

    high: int | None
    previous: int | None
    original: int | None
    release_bytes: int | None = None  # a throttle's
    full: bool | None = None  # a restore's

    def fields(self) -> Iterable[tuple[str, object]]:
        yield "lever", MEMORY_HIGH.name
        yield "memory_high", bytes_shown(self.high)
        yield "previous", bytes_shown(self.previous)
        yield "original", bytes_shown(self.original)
        if self.release_bytes is not None:
            yield "release_bytes", self.release_bytes
        if self.full is not None:
            yield "full", self.full


def quota_lever_shown(quota: CpuMax, original: CpuMax) -> str:
    """Which knob a throttle turns: the quota, on the workload's own period or another one."""
    if quota.period_us != original.period_us:
        return f"cpu.max quota on a {quota.period_us / 1000:g} ms period"
    return "cpu.max quota"


@dataclass(frozen=True, slots=True)
class HeldThrottle:
    """A workload whose quota the guard lowered, and the limit it had before."""

    lever: ClassVar[str] = CPU_QUOTA.name
    trace_key: ClassVar[str] = "throttles"
    on_workload: ClassVar[bool] = True

    group: str
    original: CpuMax  # cpu.max when first throttled; quota_us None = unlimited
    quota: CpuMax  # what the guard set last
    reasons: frozenset[Metric]  # may be empty (a throttle adopted from the ledger of an older run)
    since: float  # monotonic time of the first throttle
    # Cores it used when first throttled; a restore that lifts the quota past
    # this releases it at once. None (unknown) climbs all the way step by step.
    demand_cores: float | None = None

    def moved(self, original: str) -> HeldThrottle:
        return replace(self, original=CpuMax.from_v2(original))

    def trace(self) -> dict[str, Any]:
        return {
            "original": cpu_max_data(self.original),
            "quota": cpu_max_data(self.quota),
            "reasons": sorted(str(m) for m in self.reasons),
            "since": self.since,
        }

    def lever_shown(self) -> str:
        return quota_lever_shown(self.quota, self.original)

    @classmethod
    def adopted(cls, group: str, original: str, applied: str, reason: str, now: float) -> HeldThrottle:
        return cls(group, CpuMax.from_v2(original), CpuMax.from_v2(applied), reasons_of(reason), now)


@dataclass(frozen=True, slots=True)
class HeldMemory:
    """A workload whose memory.high the guard lowered (policy.memory), and the value it had before."""

    lever: ClassVar[str] = MEMORY_HIGH.name
    trace_key: ClassVar[str] = "memory"
    on_workload: ClassVar[bool] = True

    group: str
    original: int | None  # bytes, None for "max"
    high: int  # what the guard set last, bytes
    reasons: frozenset[Metric]  # may be empty (adopted from the ledger of an older run)
    since: float  # monotonic time of the first throttle
    # Bytes it used when first throttled: a restore that lifts memory.high past this releases it at once.
    demand_bytes: int | None = None
    # Monotonic time it was last seen pressing against the hold (policy.memory.presses); None: not yet.
    pressed: float | None = None

    def moved(self, original: str) -> HeldMemory:
        return replace(self, original=memory_value(original))

    def trace(self) -> dict[str, Any]:
        return {
            "original": bytes_shown(self.original),
            "memory_high": self.high,
            "reasons": sorted(str(m) for m in self.reasons),
            "since": self.since,
        }

    def lever_shown(self) -> str:
        return MEMORY_HIGH.name

    @classmethod
    def adopted(cls, group: str, original: str, applied: str, reason: str, now: float) -> HeldMemory:
        high = memory_value(applied)
        assert high is not None, "a held memory.high is a number of bytes"
        return cls(group, memory_value(original), high, reasons_of(reason), now)


@dataclass(frozen=True, slots=True)
class LoweredWeight:
    """A group whose CPU weight nodeguard holds at the least (the ledger keeps its original)."""

    lever: ClassVar[str] = CPU_WEIGHT.name
    trace_key: ClassVar[str] = "lowered_weights"
    on_workload: ClassVar[bool] = False
    reasons: ClassVar[frozenset[Metric]] = frozenset({STALL})

    group: str
    since: float  # monotonic
    stall_pct: float | None = None  # the protected stall that made it come down
    # Ticks in a row the work under it did not wait for CPU the node lacks: what lets it go back.
    quiet_ticks: int = 0

    def moved(self, original: str) -> LoweredWeight:
        return self

    def trace(self) -> dict[str, Any]:
        return {"since": self.since}

    def lever_shown(self) -> str:
        return f"cpu weight lowered on {self.group}"

    @classmethod
    def adopted(cls, group: str, original: str, applied: str, reason: str, now: float) -> LoweredWeight:
        return cls(group, now)


AnyHold = HeldThrottle | HeldMemory | LoweredWeight
# Every lever's holds, in the order the trace lists them (each registered lever has one:
# tests/integration/test_lever_registry.py).
HOLD_KINDS: tuple[type[AnyHold], ...] = (HeldThrottle, HeldMemory, LoweredWeight)
KIND_OF: dict[str, type[AnyHold]] = {kind.lever: kind for kind in HOLD_KINDS}

H = TypeVar("H", HeldThrottle, HeldMemory, LoweredWeight)
Holds = Mapping[str, Mapping[str, AnyHold]]  # lever -> group -> hold


def holding(holds: Iterable[AnyHold]) -> dict[str, dict[str, AnyHold]]:
    """Holds as the guard state keys them."""
    keyed: dict[str, dict[str, AnyHold]] = {}
    for hold in holds:
        keyed.setdefault(hold.lever, {})[hold.group] = hold
    return keyed


def updated(holds: Holds, changes: Mapping[LeverKey, AnyHold | None]) -> dict[str, dict[str, AnyHold]]:
    """``holds`` with each (lever, group) set to its new hold, or dropped for None."""
    out = {lever: dict(groups) for lever, groups in holds.items()}
    for (lever, group), hold in changes.items():
        if hold is None:
            out.get(lever, {}).pop(group, None)
        else:
            out.setdefault(lever, {})[group] = hold
    return {lever: groups for lever, groups in out.items() if groups}
