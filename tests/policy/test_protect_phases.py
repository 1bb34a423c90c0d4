"""Protection's phase machine (policy.protect) on its own, and guard.protect's tuning through plan()."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Mapping
from types import MappingProxyType
from typing import Any

import pytest

from nodeguard.model.snapshot import WorkloadUsage
from nodeguard.policy.holds import LoweredWeight
from nodeguard.policy.metrics import Metric
from nodeguard.policy.planner import plan
from nodeguard.policy.protect import StallSeen, judge, observe, on_trial, settled, step, weighed
from nodeguard.policy.protect_state import ProtectPhase, ProtectState, QuotaTrial
from nodeguard.policy.settings import GuardSettings, ProtectSettings
from nodeguard.policy.state import Direction, GuardState
from nodeguard.policy.tuning import CONTENDED_CORES
from tests.policy.builders import guard, kubelet_node, restores, reweighs, snapshot, stall_objective, throttles

STALL = Metric.PROTECTED_CPU_STALL
TUNING = ProtectSettings()
DOWN = {"kp/burstable": LoweredWeight("kp/burstable", 0.0, 20.0)}


def seen(**changes: Any) -> StallSeen:
    base = StallSeen(
        now=100.0, stall=8.0, streak=10, tick_seconds=1.0, weights=True, lowered={}, lowerable={}, dry_run=False
    )  # fmt: skip
    return dataclasses.replace(base, **changes)


def test_weights_come_down_first_and_are_remembered() -> None:
    """With groups left to lower, the step lowers them (WEIGHTS_DOWN, entered now) with the stall that brought
    them; through plan() the state holds them, unless dry-run."""
    groups = {"kp/besteffort": ("kp/besteffort/pod2",)}
    lowered = step(ProtectState(), seen(lowerable=groups), TUNING)
    assert lowered.phase is ProtectPhase.WEIGHTS_DOWN and not lowered.quotas and lowered.state.since == 100.0
    assert lowered.lower == {"kp/besteffort": LoweredWeight("kp/besteffort", 100.0, 8.0)}
    dry = step(ProtectState(), seen(lowerable=groups, dry_run=True), TUNING)
    assert dry.lower == lowered.lower, "the step is the same; the caller holds nothing in a dry run"
    harmed = snapshot(kubelet_node(0.2), cpus=2, cores_used=2.0)
    # Each tier with its active candidates, least important first.
    tiers = {"kp/burstable": ("kp/burstable/pod1", "kp/burstable/pod0"), "kp/besteffort": ("kp/besteffort/pod2",)}
    for dry_run in (False, True):
        p = plan(harmed, GuardState(), guard(stall_objective(dryRun=dry_run), minQuotaCores=0.05))
        assert {r.group: r.workloads for r in reweighs(p) if r.holds_back and r.dry_run == dry_run} == tiers
        assert p.state.held(LoweredWeight) == ({} if dry_run else {g: LoweredWeight(g, 100.0, 20.0) for g in tiers})


def test_quotas_wait_while_the_weights_drain_the_stall() -> None:
    """Weights that cut the stall to drainShare or less make quotas wait (DRAINING), for drainPatienceTicks."""
    lowered = {"kp/burstable": LoweredWeight("kp/burstable", 95.0, 20.0)}
    draining = step(ProtectState(), seen(stall=10.0, lowered=lowered), TUNING)
    assert draining.phase is ProtectPhase.DRAINING and draining.wait is not None and draining.wait[0] == "cooldown"
    more = step(ProtectState(), seen(stall=10.1, lowered=lowered), TUNING)
    assert more.phase is ProtectPhase.QUOTAS, "more than drainShare left"
    late = step(ProtectState(), seen(stall=10.0, now=116.0, lowered=lowered), TUNING)
    assert late.phase is ProtectPhase.QUOTAS, "past the patience"


def test_quotas_wait_for_a_streak_then_act() -> None:
    """With the weights down, quotas wait until the stall has been over target streakTicks in a row."""
    waiting = step(ProtectState(), seen(streak=3, lowered=DOWN), TUNING)
    assert waiting.phase is ProtectPhase.QUOTA_STREAK and waiting.wait == (
        "confirming",
        "over target 3/4 ticks in a row with the weights down: quotas wait",
    )
    assert step(ProtectState(), seen(streak=4, lowered=DOWN), TUNING).quotas
    assert step(ProtectState(), seen(streak=3, lowered=DOWN), TUNING.model_copy(update={"streak_ticks": 3})).quotas


def test_the_quota_lever_alone_skips_the_weights() -> None:
    """With guard.protectLever "quota", the step goes to quotas at once, whatever weights could come down."""
    decided = step(ProtectState(), seen(weights=False, streak=0, lowerable={"kp/besteffort": ("x",)}), TUNING)
    assert decided.phase is ProtectPhase.QUOTAS and decided.lower == {}


def test_a_futile_trial_turns_the_quota_lever_off_for_quota_off_seconds() -> None:
    """After trialTicks, a mean stall above futileShare of what brought the quotas gives a verdict and turns the
    quota lever off for quotaOffSeconds (FUTILE); under it the trial ends and quotas stay."""
    tuning = TUNING.model_copy(update={"trial_ticks": 2, "quota_off_seconds": 30.0})
    state = ProtectState(ProtectPhase.QUOTA_TRIAL, 100.0, trial=QuotaTrial(since=100.0, before=10.0))
    state, verdict = judge(state, True, 8.0, 101.0, tuning)
    assert verdict is None and state.trial == QuotaTrial(100.0, 10.0, 8.0, 1)
    after, verdict = judge(state, True, 7.0, 102.0, tuning)
    assert verdict is not None and verdict.mean == 7.5 and after.futile_until == 132.0 and after.trial is None
    assert (after.phase, after.since) == (ProtectPhase.FUTILE, 102.0)
    # FUTILE lasts its quotaOffSeconds, then falls back to the weights still down (or CALM without them).
    assert settled(after, acted=False, holding=True, below_restore=False, now=131.0).phase is ProtectPhase.FUTILE
    back = settled(after, acted=False, holding=True, below_restore=False, now=132.0)
    assert (back.phase, back.since) == (ProtectPhase.WEIGHTS_DOWN, 132.0)
    assert settled(after, acted=False, holding=False, below_restore=False, now=132.0).phase is ProtectPhase.CALM
    blocked = step(after, seen(now=110.0, lowered=DOWN), tuning)
    assert blocked.phase is ProtectPhase.FUTILE and blocked.wait is not None and blocked.wait[0] == "futile"
    cut, verdict = judge(state, True, 5.0, 102.0, tuning)
    assert verdict is None and cut.trial is None and cut.futile_until is None


def test_a_trial_ends_when_its_quotas_are_gone() -> None:
    """Without quotas held for the stall alone (restored, or their workloads gone), the trial is over."""
    state = ProtectState(trial=QuotaTrial(since=100.0, before=10.0))
    assert judge(state, False, 9.0, 101.0, TUNING) == (ProtectState(), None)


def test_observe_remembers_harm_and_the_last_streak_of_readings() -> None:
    """A reading over target is harm (last_harm); the last streakTicks readings are what a trial starts from."""
    state = ProtectState()
    for now, value in enumerate([6.0, 2.0, 7.0, 8.0, 9.0]):
        state = observe(state, value, 5.0, float(now), TUNING)
    assert state.last_harm == 4.0 and state.recent_stall == (2.0, 7.0, 8.0, 9.0)
    assert observe(state, None, 5.0, 9.0, TUNING) == state
    on = on_trial(state, 9.0)
    assert on.trial == QuotaTrial(9.0, 6.5) and (on.phase, on.since) == (ProtectPhase.QUOTA_TRIAL, 9.0)


def test_state_and_phase_come_from_the_guard_state() -> None:
    """GuardState keeps protection's fields in ``protect`` and the lowered weights as the weight lever's holds;
    the phase is stored there: CALM from the start, and a phase entered again keeps the time it was entered."""
    trial = QuotaTrial(1.0, 6.0)
    protect = ProtectState(last_harm=3.0, recent_stall=(6.0,), trial=trial)
    state = GuardState.holding(*DOWN.values(), protect=protect)
    assert state.protect == ProtectState(ProtectPhase.CALM, None, 3.0, (6.0,), trial, None)
    assert state.held(LoweredWeight) == DOWN
    entered = state.protect.entering(ProtectPhase.QUOTA_TRIAL, 5.0)
    assert (entered.phase, entered.since) == (ProtectPhase.QUOTA_TRIAL, 5.0)
    assert entered.entering(ProtectPhase.QUOTA_TRIAL, 9.0) is entered
    assert (ProtectState().phase, ProtectState().since) == (ProtectPhase.CALM, None)


def test_a_lowered_weights_quiet_streak_counts_ticks_its_work_does_not_contend() -> None:
    """A tick whose work under the weight wants less than CONTENDED_CORES past the idle CPU adds to its quiet
    streak; one at CONTENDED_CORES or more, or unknown, starts it again; a group not lowered is ignored."""
    lowered = {g: LoweredWeight(g, 0.0, 20.0, quiet_ticks=2) for g in ("a", "b", "c", "d")}
    after = weighed(lowered, {"a": 0.0, "b": CONTENDED_CORES, "c": None, "x": 0.0})
    assert {g: w.quiet_ticks for g, w in after.items()} == {"a": 3, "b": 0, "c": 0, "d": 2}
    assert after["a"] == dataclasses.replace(lowered["a"], quiet_ticks=3) and lowered["a"].quiet_ticks == 2


# --- guard.protect through plan() --------------------------------------------------------------------------


def weight_guard(**protect: Any) -> GuardSettings:
    return guard(stall_objective(), minQuotaCores=0.05, protect={"weightHoldSeconds": 60, **protect})


def test_streak_ticks_from_the_config_set_when_quotas_follow_the_weights() -> None:
    """guard.protect.streakTicks is the streak the quota lever waits for once the weights are down."""
    lowered = [LoweredWeight(g, 0.0, 20.0) for g in ("kp/burstable", "kp/besteffort")]
    state = GuardState.holding(*lowered, streaks={(STALL, Direction.THROTTLE): 1})
    harmed = snapshot(kubelet_node(0.06), cpus=2, cores_used=2.0)
    waits = plan(harmed, state, weight_guard())
    assert not throttles(waits)
    assert any(b.cause == "confirming" and "2/4" in b.detail for b in waits.blocked)
    acts = plan(harmed, state, weight_guard(streakTicks=2))
    assert throttles(acts)


def test_quota_off_seconds_is_its_own_timer() -> None:
    """A futile trial turns the quota lever off for protect.quotaOffSeconds, not for the weights' hold."""
    settings = weight_guard(quotaOffSeconds=7, trialTicks=1)
    lowered = [LoweredWeight(g, 0.0, 20.0) for g in ("kp/burstable", "kp/besteffort")]
    state = GuardState.holding(*lowered, streaks={(STALL, Direction.THROTTLE): 4},
                               protect=ProtectState(recent_stall=(6.0,) * 3))  # fmt: skip
    first = plan(snapshot(kubelet_node(0.06), cpus=2, cores_used=2.0, monotonic=100.0), state, settings)
    assert first.state.protect.trial is not None
    judged = plan(snapshot(kubelet_node(0.06), cpus=2, cores_used=2.0, monotonic=101.0), first.state, settings)
    assert restores(judged)
    assert judged.state.protect.futile_until == 101.0 + 7


class CountingWorkloads(Mapping[str, WorkloadUsage]):
    """A snapshot's workloads that count how often they are walked."""

    def __init__(self, found: list[WorkloadUsage]) -> None:
        self.inner = MappingProxyType({u.workload.id: u for u in found})
        self.walks = 0

    def __getitem__(self, key: str) -> WorkloadUsage:
        return self.inner[key]

    def __iter__(self) -> Iterator[str]:
        self.walks += 1
        return iter(self.inner)

    def __len__(self) -> int:
        return len(self.inner)

    def __contains__(self, key: object) -> bool:
        return key in self.inner

    def values(self) -> Any:
        self.walks += 1
        return self.inner.values()

    def items(self) -> Any:
        self.walks += 1
        return self.inner.items()


def test_a_calm_tick_walks_no_workload_until_its_report_is_read() -> None:
    """A tick with nothing past a waterline and nothing held computes no candidates and no stall; the
    protected workloads' stalls and the stall reading are worked out when the plan is read, the same as before."""
    workloads = CountingWorkloads(kubelet_node(0.03))
    calm = dataclasses.replace(snapshot(kubelet_node(0.03), cpus=2, cores_used=1.0), workloads=workloads)
    settings = guard({"metric": "cpu_total_usage", "threshold": 1.8, "restoreBelow": 1.5, "action": "throttle"})
    p = plan(calm, GuardState(), settings)
    assert workloads.walks == 0 and p.candidates is None and p.actions == ()
    assert [s.workload_id for s in p.protected] == ["kp/podg"] and p.protected[0].stall_pct == pytest.approx(3.0)
    assert p.readings[STALL] == pytest.approx(3.0) and workloads.walks == 1
