"""Protection (protected_cpu_stall) as a phase machine: weights first, then quotas on trial.

While the most stalled protected workload is over its target, the weight
lever (guard.protectLever "weight") lowers the CPU weight of every group that
competes with it (WEIGHTS_DOWN). If that cut the stall to guard.protect's
drainShare or less, quotas wait drainPatienceTicks for the rest to drain
(DRAINING); otherwise they wait for the stall to stay over target streakTicks
in a row (QUOTA_STREAK). Then quotas leave about its wait idle past what the
waiting work absorbs, a step and a cool-down at a time (QUOTAS), and are on
trial (QUOTA_TRIAL): if after trialTicks the mean stall is still above
futileShare of what brought them, they buy nothing, all go back at once, and
the quota lever is off for quotaOffSeconds (FUTILE; the weights stay down).
Quotas come back like the others (restore), a step and a cool-down at a time;
weights after weightHoldSeconds without harm, and only once the work under
them has not waited for CPU the node does not have (CONTENDED_CORES) for
quietTicks in a row: before, the harm is absent because the weight is down,
and putting it back would bring the harm back. With guard.protectLever "quota", quotas act at once and
are never on trial.

Everything here is pure: ``ProtectState`` is what protection carries between
ticks (GuardState keeps its fields: ``of``, and planner.plan writes them back), ``step`` the phase decision at the stall
objective's line; ``observe`` and ``judge`` run at the start of a tick and
``weights_may_return`` at its end (protect_levers applies them to the tick).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from enum import Enum

from nodeguard.policy.actions import Cause
from nodeguard.policy.settings import ProtectSettings
from nodeguard.policy.state import GuardState, LoweredWeight, QuotaTrial

# A lowered weight stays while the work under it waits for this many cores more than the node has idle.
CONTENDED_CORES = 0.1


def _fmt(value: float) -> str:
    return f"{value:.4g}"


class Phase(Enum):
    CALM = "calm"  # no lever held for the stall
    WEIGHTS_DOWN = "weights-down"  # competing weights lowered; quotas wait for a reason to act
    DRAINING = "draining"  # the last weights cut the stall to drainShare or less: the rest drains
    QUOTA_STREAK = "quota-streak"  # over target with the weights down: counting to streakTicks
    QUOTAS = "quotas"  # quotas may act (the quota lever alone, or a sustained stall after the weights)
    QUOTA_TRIAL = "quota-trial"  # quotas set after the weights, judged after trialTicks
    FUTILE = "futile"  # the quotas bought nothing: the quota lever is off for quotaOffSeconds


@dataclass(frozen=True, slots=True)
class ProtectState:
    """What protection carries from one tick to the next."""

    lowered: Mapping[str, LoweredWeight] = field(default_factory=dict)  # groups whose weight is down
    last_harm: float | None = None  # monotonic time a protected workload was last over target
    recent_stall: tuple[float, ...] = ()  # the last streakTicks readings: what brings quotas is their mean
    trial: QuotaTrial | None = None
    futile_until: float | None = None  # the quota lever is off until then

    @classmethod
    def of(cls, state: GuardState) -> ProtectState:
        return cls(state.lowered, state.last_harm, state.recent_stall, state.quota_trial, state.quotas_futile_until)

    def phase(self, now: float) -> Phase:
        """Where protection stands between ticks (DRAINING and QUOTA_STREAK need a tick's reading: ``step``)."""
        if self.futile_until is not None and now < self.futile_until:
            return Phase.FUTILE
        if self.trial is not None:
            return Phase.QUOTA_TRIAL
        return Phase.WEIGHTS_DOWN if self.lowered else Phase.CALM

    def futile(self, now: float) -> bool:
        return self.futile_until is not None and now < self.futile_until


def observe(
    state: ProtectState, stall: float | None, target: float, now: float, tuning: ProtectSettings
) -> ProtectState:
    """The tick's reading of the stall objective (target: its threshold, percent) remembered: harm, and the
    readings that a quota's trial is measured against."""
    if stall is None:
        return state
    return replace(
        state,
        last_harm=now if stall > target else state.last_harm,
        recent_stall=(*state.recent_stall, stall)[-tuning.streak_ticks :],
    )


@dataclass(frozen=True, slots=True)
class Futile:
    """A trial's verdict: the quotas left the stall at ``mean`` over ``ticks``, after ``before``."""

    mean: float
    ticks: int
    before: float

    def detail(self) -> str:
        left = f"quotas left the stall at {_fmt(self.mean)}% over {self.ticks} ticks"
        return f"{left}, after {_fmt(self.before)}%: given back"


def judge(
    state: ProtectState, held: bool, stall: float | None, now: float, tuning: ProtectSettings
) -> tuple[ProtectState, Futile | None]:
    """One more tick of the quotas' trial (``held``: quotas held for the stall alone are still there); after
    trialTicks, a Futile verdict when they did not cut the stall: they go back, the quota lever off."""
    trial = state.trial
    if trial is None:
        return state, None
    if not held:
        return replace(state, trial=None), None  # released (calm) or gone
    if stall is None or now <= trial.since:
        return state, None
    trial = replace(trial, total=trial.total + stall, ticks=trial.ticks + 1)
    if trial.ticks < tuning.trial_ticks:
        return replace(state, trial=trial), None
    mean = trial.total / trial.ticks
    if mean <= tuning.futile_share * trial.before:
        return replace(state, trial=None), None
    return replace(state, trial=None, futile_until=now + tuning.quota_off_seconds), Futile(
        mean, trial.ticks, trial.before
    )


@dataclass(frozen=True, slots=True)
class Seen:
    """What the stall objective's line sees this tick, once it is past its target and ready to act."""

    now: float
    stall: float | None  # the reading, percent
    streak: int  # ticks in a row over target
    tick_seconds: float
    weights: bool  # the weight lever comes first (guard.protectLever "weight")
    lowerable: Mapping[str, tuple[str, ...]]  # groups whose weight may come down, with the active candidates under
    dry_run: bool


@dataclass(frozen=True, slots=True)
class Step:
    """The phase this tick is in and what it does: lower weights, wait (a blocked cause and why), or quotas."""

    phase: Phase
    state: ProtectState
    lower: Mapping[str, tuple[str, ...]] = field(default_factory=dict)
    wait: tuple[Cause, str] | None = None

    @property
    def quotas(self) -> bool:
        return self.phase in (Phase.QUOTAS, Phase.QUOTA_TRIAL)


def step(state: ProtectState, seen: Seen, tuning: ProtectSettings) -> Step:
    """The lever for a stall over target: weights while any are left to lower, then quotas once the stall is
    neither draining, nor short of its streak, nor judged beyond quotas."""
    if not seen.weights:
        return Step(Phase.QUOTAS, state)
    if seen.lowerable:
        lowered = state.lowered
        if not seen.dry_run:
            news = {group: LoweredWeight(group, seen.now, seen.stall) for group in seen.lowerable}
            lowered = {**lowered, **news}
        return Step(Phase.WEIGHTS_DOWN, replace(state, lowered=lowered), lower=seen.lowerable)
    draining = _draining(state, seen, tuning)
    if draining is not None:
        return Step(Phase.DRAINING, state, wait=("cooldown", draining))
    if seen.streak < tuning.streak_ticks:
        detail = f"over target {seen.streak}/{tuning.streak_ticks} ticks in a row with the weights down: quotas wait"
        return Step(Phase.QUOTA_STREAK, state, wait=("confirming", detail))
    if state.futile(seen.now):
        assert state.futile_until is not None
        detail = f"quotas did not cut the stall: the quota lever waits {_fmt(state.futile_until - seen.now)}s more"
        return Step(Phase.FUTILE, state, wait=("futile", detail))
    return Step(Phase.QUOTA_TRIAL if state.trial is not None else Phase.QUOTAS, state)


def _draining(state: ProtectState, seen: Seen, tuning: ProtectSettings) -> str | None:
    """Why quotas wait for the stall to drain, if the weights lowered last cut it to drainShare or less."""
    if not state.lowered:
        return None
    last = max(state.lowered.values(), key=lambda w: w.since)
    value = seen.stall
    if (
        last.stall_pct is None
        or value is None
        or seen.now - last.since > tuning.drain_patience_ticks * seen.tick_seconds
    ):
        return None
    if value > tuning.drain_share * last.stall_pct:
        return None
    return f"{_fmt(value)}% after {_fmt(last.stall_pct)}% when weights came down: draining, quota waits"


def on_trial(state: ProtectState, now: float) -> ProtectState:
    """Quotas set after the weights go on trial, against the mean of the readings that brought them."""
    if state.trial is not None:
        return state
    before = sum(state.recent_stall) / len(state.recent_stall)
    return replace(state, trial=QuotaTrial(now, before))


def weights_may_return(state: ProtectState, below_restore: bool, now: float, tuning: ProtectSettings) -> bool:
    """Whether the stall allows lowered weights back: under the restore waterline, and no harm for
    weightHoldSeconds (the work under each weight is asked next: protect_levers)."""
    return below_restore and (state.last_harm is None or now - state.last_harm >= tuning.weight_hold_seconds)


def weighed(state: ProtectState, demands: Mapping[str, float | None]) -> ProtectState:
    """Each lowered group's quiet streak after this tick's demand of the work under it (cores it waits for past
    the idle CPU; None when unknown): a tick at CONTENDED_CORES or more, or unknown, starts it again."""
    lowered = dict(state.lowered)
    for group, demand in demands.items():
        held = lowered.get(group)
        if held is None:
            continue
        quiet = demand is not None and demand < CONTENDED_CORES
        lowered[group] = replace(held, quiet_ticks=held.quiet_ticks + 1 if quiet else 0)
    return replace(state, lowered=lowered)


def without_weights(state: ProtectState, groups: set[str]) -> ProtectState:
    if not groups:
        return state
    return replace(state, lowered={g: w for g, w in state.lowered.items() if g not in groups})
