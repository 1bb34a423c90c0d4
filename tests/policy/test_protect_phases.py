"""Protection's phase machine (policy.protect) on its own, and guard.protect's tuning through plan()."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator, Mapping
from types import MappingProxyType
from typing import Any

import pytest

from nodeguard.model.snapshot import WorkloadUsage
from nodeguard.policy.actions import Restore, Throttle
from nodeguard.policy.metrics import Metric
from nodeguard.policy.planner import plan
from nodeguard.policy.protect import Phase, ProtectState, Seen, judge, observe, on_trial, step
from nodeguard.policy.settings import GuardSettings, ProtectSettings
from nodeguard.policy.state import Direction, GuardState, LoweredWeight, QuotaTrial
from tests.policy.builders import guard, kubelet_node, snapshot, stall_objective

STALL = Metric.PROTECTED_CPU_STALL
TUNING = ProtectSettings()
DOWN = {"kp/burstable": LoweredWeight("kp/burstable", 0.0, 20.0)}


def seen(**changes: Any) -> Seen:
    base = Seen(
        now=100.0, stall=8.0, streak=10, tick_seconds=1.0, weights=True, lowerable={}, dry_run=False
    )  # fmt: skip
    return dataclasses.replace(base, **changes)


def test_weights_come_down_first_and_are_remembered() -> None:
    """With groups left to lower, the step lowers them (WEIGHTS_DOWN) and the state holds them, unless dry-run."""
    groups = {"kp/besteffort": ("kp/besteffort/pod2",)}
    lowered = step(ProtectState(), seen(lowerable=groups), TUNING)
    assert lowered.phase is Phase.WEIGHTS_DOWN and lowered.lower == groups and not lowered.quotas
    assert lowered.state.lowered == {"kp/besteffort": LoweredWeight("kp/besteffort", 100.0, 8.0)}
    dry = step(ProtectState(), seen(lowerable=groups, dry_run=True), TUNING)
    assert dry.lower == groups and dry.state.lowered == {}


def test_quotas_wait_while_the_weights_drain_the_stall() -> None:
    """Weights that cut the stall to drainShare or less make quotas wait (DRAINING), for drainPatienceTicks."""
    state = ProtectState(lowered={"kp/burstable": LoweredWeight("kp/burstable", 95.0, 20.0)})
    draining = step(state, seen(stall=10.0), TUNING)
    assert draining.phase is Phase.DRAINING and draining.wait is not None and draining.wait[0] == "cooldown"
    assert step(state, seen(stall=10.1), TUNING).phase is Phase.QUOTAS, "more than drainShare left"
    assert step(state, seen(stall=10.0, now=116.0), TUNING).phase is Phase.QUOTAS, "past the patience"


def test_quotas_wait_for_a_streak_then_act() -> None:
    """With the weights down, quotas wait until the stall has been over target streakTicks in a row."""
    waiting = step(ProtectState(lowered=DOWN), seen(streak=3), TUNING)
    assert waiting.phase is Phase.QUOTA_STREAK and waiting.wait == (
        "confirming",
        "over target 3/4 ticks in a row with the weights down: quotas wait",
    )
    assert step(ProtectState(lowered=DOWN), seen(streak=4), TUNING).quotas
    assert step(ProtectState(lowered=DOWN), seen(streak=3), TUNING.model_copy(update={"streak_ticks": 3})).quotas


def test_the_quota_lever_alone_skips_the_weights() -> None:
    """With guard.protectLever "quota", the step goes to quotas at once, whatever weights could come down."""
    decided = step(ProtectState(), seen(weights=False, streak=0, lowerable={"kp/besteffort": ("x",)}), TUNING)
    assert decided.phase is Phase.QUOTAS and decided.lower == {}


def test_a_futile_trial_turns_the_quota_lever_off_for_quota_off_seconds() -> None:
    """After trialTicks, a mean stall above futileShare of what brought the quotas gives a verdict and turns the
    quota lever off for quotaOffSeconds (FUTILE); under it the trial ends and quotas stay."""
    tuning = TUNING.model_copy(update={"trial_ticks": 2, "quota_off_seconds": 30.0})
    state = ProtectState(lowered=DOWN, trial=QuotaTrial(since=100.0, before=10.0))
    state, verdict = judge(state, True, 8.0, 101.0, tuning)
    assert verdict is None and state.trial == QuotaTrial(100.0, 10.0, 8.0, 1)
    after, verdict = judge(state, True, 7.0, 102.0, tuning)
    assert verdict is not None and verdict.mean == 7.5 and after.futile_until == 132.0 and after.trial is None
    assert after.phase(131.0) is Phase.FUTILE and after.phase(132.0) is Phase.WEIGHTS_DOWN
    blocked = step(after, seen(now=110.0), tuning)
    assert blocked.phase is Phase.FUTILE and blocked.wait is not None and blocked.wait[0] == "futile"
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
    assert on_trial(state, 9.0).trial == QuotaTrial(9.0, 6.5)


def test_state_and_phase_come_from_the_guard_state() -> None:
    """ProtectState reads GuardState's five protection fields; between ticks its phase follows them."""
    trial = QuotaTrial(1.0, 6.0)
    state = ProtectState.of(GuardState(lowered=DOWN, last_harm=3.0, recent_stall=(6.0,), quota_trial=trial))
    assert state == ProtectState(DOWN, 3.0, (6.0,), trial, None)
    assert state.phase(5.0) is Phase.QUOTA_TRIAL
    assert ProtectState().phase(5.0) is Phase.CALM


# --- guard.protect through plan() --------------------------------------------------------------------------


def weight_guard(**protect: Any) -> GuardSettings:
    return guard(stall_objective(), minQuotaCores=0.05, protect={"weightHoldSeconds": 60, **protect})


def test_streak_ticks_from_the_config_set_when_quotas_follow_the_weights() -> None:
    """guard.protect.streakTicks is the streak the quota lever waits for once the weights are down."""
    lowered = {g: LoweredWeight(g, 0.0, 20.0) for g in ("kp/burstable", "kp/besteffort")}
    state = GuardState(lowered=lowered, streaks={(STALL, Direction.THROTTLE): 1})
    harmed = snapshot(kubelet_node(0.06), cpus=2, cores_used=2.0)
    waits = plan(harmed, state, weight_guard())
    assert not any(isinstance(a, Throttle) for a in waits.actions)
    assert any(b.cause == "confirming" and "2/4" in b.detail for b in waits.blocked)
    acts = plan(harmed, state, weight_guard(streakTicks=2))
    assert any(isinstance(a, Throttle) for a in acts.actions)


def test_quota_off_seconds_is_its_own_timer() -> None:
    """A futile trial turns the quota lever off for protect.quotaOffSeconds, not for the weights' hold."""
    settings = weight_guard(quotaOffSeconds=7, trialTicks=1)
    lowered = {g: LoweredWeight(g, 0.0, 20.0) for g in ("kp/burstable", "kp/besteffort")}
    state = GuardState(lowered=lowered, streaks={(STALL, Direction.THROTTLE): 4}, recent_stall=(6.0,) * 3)
    first = plan(snapshot(kubelet_node(0.06), cpus=2, cores_used=2.0, monotonic=100.0), state, settings)
    assert first.state.quota_trial is not None
    judged = plan(snapshot(kubelet_node(0.06), cpus=2, cores_used=2.0, monotonic=101.0), first.state, settings)
    assert any(isinstance(a, Restore) for a in judged.actions)
    assert judged.state.quotas_futile_until == 101.0 + 7


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
