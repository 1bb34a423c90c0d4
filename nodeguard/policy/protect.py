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
them has not waited for CPU the node does not have (tuning.CONTENDED_CORES) for
quietTicks in a row: before, the harm is absent because the weight is down,
and putting it back would bring the harm back. With guard.protectLever "quota", quotas act at once and
are never on trial.

Everything here is pure: ``ProtectState`` (policy.protect_state) is what
protection carries between ticks, its phase stored in it; the lowered weights
are the weight lever's holds in the guard state. ``step`` is the phase
decision at the stall objective's line, ``observe`` and ``judge`` run at the
start of a tick, ``weights_may_return`` and ``settled`` at its end
(policy.protection applies them to the tick).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, replace

from nodeguard.policy.actions import Cause
from nodeguard.policy.holds import LoweredWeight
from nodeguard.policy.protect_state import ProtectPhase, ProtectState, QuotaTrial
from nodeguard.policy.settings import ProtectSettings
from nodeguard.policy.tuning import CONTENDED_CORES

Lowered = Mapping[str, LoweredWeight]  # the weight lever's holds, by group


def _fmt(value: float) -> str:
    return f"{value:.4g}"


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
    trialTicks, a Futile verdict when they did not cut the stall: they go back, the quota lever off (FUTILE)."""
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
    futile = replace(state, trial=None, futile_until=now + tuning.quota_off_seconds)
    return futile.entering(ProtectPhase.FUTILE, now), Futile(mean, trial.ticks, trial.before)


@dataclass(frozen=True, slots=True)
class StallSeen:
    """What the stall objective's line sees this tick, once it is past its target and ready to act."""

    now: float
    stall: float | None  # the reading, percent
    streak: int  # ticks in a row over target
    tick_seconds: float
    weights: bool  # the weight lever comes first (guard.protectLever "weight")
    lowered: Lowered  # the groups whose weight is down
    lowerable: Mapping[str, tuple[str, ...]]  # groups whose weight may come down, with the active candidates under
    dry_run: bool


@dataclass(frozen=True, slots=True)
class Step:
    """The phase protection is in after this tick's step, and what the phase does: lower weights, wait (a
    blocked cause and why), or quotas."""

    state: ProtectState
    lower: Mapping[str, LoweredWeight] = field(default_factory=dict)  # the weights to lower (held unless dry)
    wait: tuple[Cause, str] | None = None

    @property
    def phase(self) -> ProtectPhase:
        return self.state.phase

    @property
    def quotas(self) -> bool:
        return self.phase in (ProtectPhase.QUOTAS, ProtectPhase.QUOTA_TRIAL)


def step(state: ProtectState, seen: StallSeen, tuning: ProtectSettings) -> Step:
    """The lever for a stall over target, chosen by the phase it leads to: weights while any are left to lower,
    then quotas once the stall is neither draining, nor short of its streak, nor judged beyond quotas."""
    now = seen.now
    if not seen.weights:
        return Step(state.entering(ProtectPhase.QUOTAS, now))
    if seen.lowerable:
        lowered = {group: LoweredWeight(group, now, seen.stall) for group in seen.lowerable}
        return Step(state.entering(ProtectPhase.WEIGHTS_DOWN, now), lower=lowered)
    draining = _draining(seen, tuning)
    if draining is not None:
        return Step(state.entering(ProtectPhase.DRAINING, now), wait=("cooldown", draining))
    if seen.streak < tuning.streak_ticks:
        detail = f"over target {seen.streak}/{tuning.streak_ticks} ticks in a row with the weights down: quotas wait"
        return Step(state.entering(ProtectPhase.QUOTA_STREAK, now), wait=("confirming", detail))
    if state.futile(now):
        assert state.futile_until is not None
        detail = f"quotas did not cut the stall: the quota lever waits {_fmt(state.futile_until - now)}s more"
        return Step(state.entering(ProtectPhase.FUTILE, now), wait=("futile", detail))
    phase = ProtectPhase.QUOTA_TRIAL if state.trial is not None else ProtectPhase.QUOTAS
    return Step(state.entering(phase, now))


def _draining(seen: StallSeen, tuning: ProtectSettings) -> str | None:
    """Why quotas wait for the stall to drain, if the weights lowered last cut it to drainShare or less."""
    if not seen.lowered:
        return None
    last = max(seen.lowered.values(), key=lambda w: w.since)
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
    """Quotas set after the weights go on trial (QUOTA_TRIAL), against the mean of the readings that brought
    them."""
    if state.trial is not None:
        return state
    before = sum(state.recent_stall) / len(state.recent_stall)
    return replace(state, trial=QuotaTrial(now, before)).entering(ProtectPhase.QUOTA_TRIAL, now)


def weights_may_return(state: ProtectState, below_restore: bool, now: float, tuning: ProtectSettings) -> bool:
    """Whether the stall allows lowered weights back: under the restore waterline, and no harm for
    weightHoldSeconds (the work under each weight is asked next: policy.protection)."""
    return below_restore and (state.last_harm is None or now - state.last_harm >= tuning.weight_hold_seconds)


def weighed(lowered: Lowered, demands: Mapping[str, float | None]) -> dict[str, LoweredWeight]:
    """Each lowered group's quiet streak after this tick's demand of the work under it (cores it waits for past
    the idle CPU; None when unknown): a tick at CONTENDED_CORES or more, or unknown, starts it again."""
    out = dict(lowered)
    for group, demand in demands.items():
        held = out.get(group)
        if held is None:
            continue
        quiet = demand is not None and demand < CONTENDED_CORES
        out[group] = replace(held, quiet_ticks=held.quiet_ticks + 1 if quiet else 0)
    return out


def settled(state: ProtectState, *, acted: bool, holding: bool, below_restore: bool, now: float) -> ProtectState:
    """The phase at the end of a tick. ``acted``: the stall line stepped this tick (its phase stands);
    ``holding``: a weight or a quota is held for the stall. Nothing held and no trial is CALM (FUTILE lasts its
    quotaOffSeconds); holds the line did not step on go back while the stall is under its restore waterline
    (GIVING_BACK); a FUTILE spell that ran out falls back to the weights still down, or CALM."""
    if state.phase is ProtectPhase.FUTILE and not state.futile(now):
        state = state.entering(ProtectPhase.WEIGHTS_DOWN if holding else ProtectPhase.CALM, now)
    if acted or state.phase is ProtectPhase.FUTILE:
        return state
    if not holding and state.trial is None:
        return state.entering(ProtectPhase.CALM, now)
    if below_restore and holding:
        return state.entering(ProtectPhase.GIVING_BACK, now)
    return state
