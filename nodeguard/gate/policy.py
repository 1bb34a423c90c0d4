"""The admission policy: a pure function from (counts, signals, limits, rates, now) to admit or hold, with a reason.

Order of the checks, first failing one holds:

1. counts: ``maxStarting`` and ``maxStartingPerCore`` (never overridden);
2. ``maxRate``: a token bucket (never overridden);
3. load signals: ``maxLoadAverageMultiplier`` x cores and ``maxCPU``, averaged
   over a window. A configured signal without a sample yet holds, as the worst
   case until measured. ``minRate`` overrides this step: when no load was
   admitted for 1/minRate seconds, the next one goes in whatever the signals say.

A hold carries ``retry_at`` when only time can lift it (the bucket refills, the
minRate interval ends); other holds are lifted by events (a slot freed, new signals).
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, replace

from nodeguard.gate.settings import GateSettings


@dataclass(frozen=True, slots=True)
class Limits:
    cores: int
    max_starting: int | None = None
    max_starting_per_core: float | None = None
    max_load_multiplier: float | None = None
    max_cpu: float | None = None
    min_rate: float = 0.0
    max_rate: float | None = None
    burst: int = 1

    @classmethod
    def from_settings(cls, settings: GateSettings, cores: int) -> Limits:
        return cls(
            cores=max(1, cores),
            max_starting=settings.max_starting,
            max_starting_per_core=settings.max_starting_per_core,
            max_load_multiplier=settings.max_load_average_multiplier,
            max_cpu=settings.max_cpu,
            min_rate=settings.min_rate,
            max_rate=settings.max_rate,
            burst=settings.max_rate_burst,
        )

    @property
    def per_core_slots(self) -> int | None:
        if self.max_starting_per_core is None:
            return None
        # At least one: a small node must still start things.
        return max(1, math.floor(self.max_starting_per_core * self.cores + 1e-9))

    @property
    def slots(self) -> int | None:
        """Loads allowed to be starting at once; None: no count limit."""
        found = [n for n in (self.max_starting, self.per_core_slots) if n is not None]
        return min(found) if found else None


@dataclass(frozen=True, slots=True)
class Signals:
    """Load signals averaged over the window; None where there is no sample."""

    load1: float | None = None
    cpu_percent: float | None = None
    samples: int = 0


@dataclass(frozen=True, slots=True)
class Rates:
    tokens: float  # of the maxRate bucket, as of ``refilled_at``
    refilled_at: float  # monotonic
    last_admit: float  # monotonic: when the last load was admitted (or when the gate started)

    @classmethod
    def initial(cls, limits: Limits, now: float) -> Rates:
        return cls(tokens=float(limits.burst), refilled_at=now, last_admit=now)


@dataclass(frozen=True, slots=True)
class Decision:
    admit: bool
    reason: str
    retry_at: float | None = None  # monotonic: decide again then (a time-based hold)


def refill(rates: Rates, limits: Limits, now: float) -> Rates:
    if limits.max_rate is None:
        return rates
    tokens = min(float(limits.burst), rates.tokens + max(0.0, now - rates.refilled_at) * limits.max_rate)
    return replace(rates, tokens=tokens, refilled_at=now)


def admitted(rates: Rates, limits: Limits, now: float) -> Rates:
    """The rates after one admission at ``now``."""
    rates = refill(rates, limits, now)
    tokens = rates.tokens - 1 if limits.max_rate is not None else rates.tokens
    return replace(rates, tokens=tokens, last_admit=now)


def decide(starting: int, signals: Signals, limits: Limits, rates: Rates, now: float) -> Decision:
    """Admit the next pending load now, or hold it and say why."""
    if limits.max_starting is not None and starting >= limits.max_starting:
        return Decision(False, f"maxStarting: {starting} of {limits.max_starting} starting")
    per_core = limits.per_core_slots
    if per_core is not None and starting >= per_core:
        return Decision(
            False,
            f"maxStartingPerCore: {starting} of {per_core} starting "
            f"({limits.max_starting_per_core:g} x {limits.cores} cores)",
        )
    if limits.max_rate is not None:
        bucket = refill(rates, limits, now)
        if bucket.tokens < 1.0 - 1e-9:
            retry_at = now + (1.0 - bucket.tokens) / limits.max_rate
            return Decision(False, f"maxRate: {limits.max_rate:g}/s", retry_at)
    over = _over_signals(signals, limits)
    if over is None:
        return Decision(True, "within limits")
    if limits.min_rate > 0:
        due = rates.last_admit + 1.0 / limits.min_rate
        if now >= due - 1e-9:
            return Decision(True, f"minRate {limits.min_rate:g}/s despite {over}")
        return Decision(False, over, due)
    return Decision(False, over)


def _over_signals(signals: Signals, limits: Limits) -> str | None:
    if limits.max_load_multiplier is not None:
        ceiling = limits.max_load_multiplier * limits.cores
        if signals.load1 is None:
            return "maxLoadAverageMultiplier: no load average sample yet"
        if signals.load1 > ceiling:
            return f"maxLoadAverageMultiplier: load1 {signals.load1:.2f} > {ceiling:g}"
    if limits.max_cpu is not None:
        if signals.cpu_percent is None:
            return "maxCPU: no CPU sample yet"
        if signals.cpu_percent > limits.max_cpu:
            return f"maxCPU: {signals.cpu_percent:.1f}% > {limits.max_cpu:g}%"
    return None


class SignalWindow:
    """The node's load signals over the last ``seconds``, averaged."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds
        self._samples: deque[tuple[float, float | None, float | None]] = deque()

    def add(self, now: float, load1: float | None, cpu_percent: float | None) -> None:
        self._samples.append((now, load1, cpu_percent))
        self._prune(now)

    def _prune(self, now: float) -> None:
        # Keep the newest sample even when it is older than the window: a stale
        # measurement beats none (the tick may be slower than the window).
        while len(self._samples) > 1 and self._samples[0][0] < now - self.seconds:
            self._samples.popleft()

    def signals(self, now: float) -> Signals:
        self._prune(now)
        loads = [s[1] for s in self._samples if s[1] is not None]
        cpus = [s[2] for s in self._samples if s[2] is not None]
        return Signals(
            load1=sum(loads) / len(loads) if loads else None,
            cpu_percent=sum(cpus) / len(cpus) if cpus else None,
            samples=len(self._samples),
        )
