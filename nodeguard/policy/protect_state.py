"""What protection (protected_cpu_stall) carries from one tick to the next: its phase, and the readings behind it.

The phase is stored, not derived: ``policy.protect`` moves it, the phase
chooses the lever at the stall objective's line, and /status, ``nodeguard
plan`` and the trace show it with the time it was entered.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from enum import StrEnum


class ProtectPhase(StrEnum):
    CALM = "calm"  # no lever held for the stall
    WEIGHTS_DOWN = "weights-down"  # competing weights lowered; quotas wait for a reason to act
    DRAINING = "draining"  # the last weights cut the stall to drainShare or less: the rest drains
    QUOTA_STREAK = "quota-streak"  # over target with the weights down: counting to streakTicks
    QUOTAS = "quotas"  # quotas may act (the quota lever alone, or a sustained stall after the weights)
    QUOTA_TRIAL = "quota-trial"  # quotas set after the weights, judged after trialTicks
    FUTILE = "futile"  # the quotas bought nothing: the quota lever is off for quotaOffSeconds
    GIVING_BACK = "giving-back"  # the stall is under its restore waterline: what is held goes back as it may


@dataclass(frozen=True, slots=True)
class QuotaTrial:
    """Quotas set for a protected workload's stall after the weights came down: they stay only if they cut it."""

    since: float  # monotonic time of the first of them
    before: float  # the stall (percent), the mean of the readings that brought them
    total: float = 0.0  # stall readings (percent) since, summed
    ticks: int = 0


@dataclass(frozen=True, slots=True)
class ProtectState:
    """Protection between ticks: its phase and since when, the last harm, the recent readings, the trial."""

    phase: ProtectPhase = ProtectPhase.CALM
    since: float | None = None  # monotonic time the phase was entered; None: calm since the daemon started
    last_harm: float | None = None  # monotonic time a protected workload was last over target
    recent_stall: tuple[float, ...] = ()  # the last streakTicks readings: what brings quotas is their mean
    trial: QuotaTrial | None = None
    futile_until: float | None = None  # the quota lever is off until then

    def entering(self, phase: ProtectPhase, now: float) -> ProtectState:
        """In ``phase`` from ``now`` on; the same state when it is there already."""
        return self if phase is self.phase else replace(self, phase=phase, since=now)

    def futile(self, now: float) -> bool:
        return self.futile_until is not None and now < self.futile_until
