"""Folding what the executor reports into the guard state: pure, so every path is checked here."""

from __future__ import annotations

from dataclasses import replace

import pytest

from nodeguard.model.samples import CpuMax
from nodeguard.policy.actions import Restore, Reweigh, Throttle
from nodeguard.policy.metrics import Metric
from nodeguard.policy.outcome import (
    QUOTA,
    WEIGHT,
    Held,
    HoldTimes,
    Moves,
    QuotaOutcome,
    Refusal,
    Unchanged,
    adopted,
    after_pass,
    after_reweigh,
    fold_moves,
)
from nodeguard.policy.planner import Plan, plan
from nodeguard.policy.state import GuardState, HeldThrottle, LoweredWeight, PendingEviction
from tests.policy.builders import guard, snapshot, usage

NOW = 100.0
ORIGINAL, HELD, NEW = CpuMax(200000), CpuMax(100000), CpuMax(50000)
REFUSAL = Refusal("EINVAL", "cpu.max", "Invalid argument")
HOLDS = HoldTimes(first=10.0, longest=40.0)


def held(group: str, quota: CpuMax = HELD) -> HeldThrottle:
    return HeldThrottle(group, ORIGINAL, quota, frozenset({Metric.CPU_TOTAL_USAGE}), NOW - 50)


def throttle(group: str) -> Throttle:
    return Throttle(usage(group).workload, Metric.CPU_TOTAL_USAGE, "gap", 1.0, 0.5, 0.5, NEW, HELD, ORIGINAL, False)


def restore(group: str, *, full: bool) -> Restore:
    quota = ORIGINAL if full else CpuMax(150000)
    return Restore(usage(group).workload, Metric.CPU_TOTAL_USAGE, "calm", -1.0, -0.5, quota, HELD, ORIGINAL, full,
                   False)  # fmt: skip


def planned(*actions: Throttle | Restore, state: GuardState, reweighs: tuple[Reweigh, ...] = ()) -> Plan:
    """A plan of these actions whose state assumes they all happened."""
    base = plan(snapshot(monotonic=NOW), GuardState(), guard())
    return replace(base, actions=actions, reweighs=reweighs, state=state)


def test_a_refused_throttle_keeps_the_old_limit_and_holds_the_workload_back_longer_each_time() -> None:
    """A refused throttle leaves the state at the limit the workload had, holds it back for the first hold, and a
    second refusal in a row doubles the hold."""
    before = GuardState(throttles={"a": held("a")})
    p = planned(throttle("a"), state=GuardState(throttles={"a": held("a", NEW)}))
    first = after_pass(p, before, QuotaOutcome(Unchanged(refused={"a": REFUSAL})), HOLDS)
    assert first.state.throttles["a"].quota == HELD
    assert first.refused["a"].until == NOW + 10 and first.state.held_back["a"].error == "EINVAL"
    again = after_pass(p, first.state, QuotaOutcome(Unchanged(refused={"a": REFUSAL})), HOLDS)
    assert again.refused["a"].until == NOW + 20 and again.refused["a"].failures == 2


def test_a_refused_restore_keeps_the_throttle_without_holding_the_workload_back() -> None:
    """A restore the kernel refused leaves the throttle held (the limit is still in place) and is no reason to
    leave the workload out as a candidate."""
    before = GuardState(throttles={"a": held("a")})
    p = planned(restore("a", full=True), state=GuardState())
    after = after_pass(p, before, QuotaOutcome(Unchanged(refused={"a": REFUSAL})), HOLDS)
    assert after.state.throttles == {"a": held("a")} and after.refused == {} and after.state.held_back == {}


def test_a_withheld_throttle_of_a_new_workload_leaves_nothing_held() -> None:
    """A throttle the ledger could not record first was not written: a workload not throttled before stays so."""
    p = planned(throttle("a"), state=GuardState(throttles={"a": held("a", NEW)}))
    after = after_pass(p, GuardState(), QuotaOutcome(Unchanged(withheld=frozenset({"a"}))), HOLDS)
    assert after.state.throttles == {} and after.refused == {}


def test_a_group_that_left_is_forgotten() -> None:
    """A workload whose cgroup left while its limit was written is no longer held."""
    p = planned(throttle("a"), state=GuardState(throttles={"a": held("a", NEW)}))
    after = after_pass(p, GuardState(throttles={"a": held("a")}), QuotaOutcome(Unchanged(gone=frozenset({"a"}))))
    assert after.state.throttles == {}


@pytest.mark.parametrize("full", [False, True])
def test_a_released_record_ends_the_throttle_whether_or_not_the_plan_asked_for_all_of_it(full: bool) -> None:
    """A step up the ledger could not record goes all the way back, so the throttle ends; a full restore ended it
    in the plan already."""
    step_state = GuardState(throttles={"a": held("a", CpuMax(150000))}) if not full else GuardState()
    p = planned(restore("a", full=full), state=step_state)
    written = {"a": ORIGINAL}
    after = after_pass(
        p, GuardState(throttles={"a": held("a")}), QuotaOutcome(written=written, released=frozenset({"a"}))
    )
    assert after.state.throttles == {} and after.written == written


def test_a_write_that_succeeds_ends_the_hold_and_a_failed_eviction_is_pending_no_more() -> None:
    """A written limit drops the workload's held-back entry; an eviction that failed leaves the pending list."""
    pending = PendingEviction("b", Metric.MEMORY_TOTAL_USAGE, 1.0, 1 << 30, NOW - 1)
    first = after_pass(
        planned(throttle("a"), state=GuardState(throttles={"a": held("a", NEW)})),
        GuardState(), QuotaOutcome(Unchanged(refused={"a": REFUSAL})), HOLDS,
    )  # fmt: skip
    state = replace(first.state, evictions={"b": pending}, throttles={"a": held("a", NEW)})
    after = after_pass(planned(throttle("a"), state=state), first.state,
                       QuotaOutcome(written={"a": NEW}, failed_evictions=frozenset({"b"})))  # fmt: skip
    assert after.state.held_back == {} and after.state.evictions == {} and after.state.throttles["a"].quota == NEW


def test_moves_replace_the_original_and_released_records_leave_every_lever() -> None:
    """A moved original is the throttle's new original; a released quota or weight is no longer held."""
    state = GuardState(throttles={"a": held("a"), "b": held("b")}, lowered={"t": LoweredWeight("t", NOW)})
    moved = fold_moves(state, Moves({"a": CpuMax(120000)}, frozenset({(QUOTA, "b"), (WEIGHT, "t")})))
    assert moved.throttles == {"a": replace(held("a"), original=CpuMax(120000))} and moved.lowered == {}


def test_a_refused_lowering_holds_the_group_back_and_a_refused_raise_keeps_nothing_back() -> None:
    """A weight the kernel would not lower is not lowered and is held back (the quota lever goes on); a refused
    put-back holds nothing back; a withheld or vanished group is not lowered."""
    lower = Reweigh("t", Metric.PROTECTED_CPU_STALL, "harm", True, ("a",), False)
    raise_ = Reweigh("u", Metric.PROTECTED_CPU_STALL, "calm", False, ("b",), False)
    lowered = {g: LoweredWeight(g, NOW) for g in ("t", "v", "w")}
    p = planned(state=GuardState(lowered=lowered), reweighs=(lower, raise_))
    unchanged = Unchanged({"t": REFUSAL, "u": REFUSAL}, withheld=frozenset({"v"}), gone=frozenset({"w"}))
    after = after_reweigh(p, p.state, unchanged, HOLDS)
    assert after.lowered == {} and set(after.held_back) == {"t"} and after.held_back["t"].until == NOW + 10


def test_adopted_records_are_held_again_per_lever() -> None:
    """A daemon adopting its ledger holds each quota with its limits and metric (none when the metric is unknown)
    and each weight as lowered since now."""
    state = adopted(
        [Held(QUOTA, "a", "cpu_total_usage", ORIGINAL, HELD), Held(QUOTA, "b", "gone_metric", ORIGINAL, HELD),
         Held(WEIGHT, "t", "protected_cpu_stall")], NOW,
    )  # fmt: skip
    assert state.throttles["a"] == HeldThrottle("a", ORIGINAL, HELD, frozenset({Metric.CPU_TOTAL_USAGE}), NOW)
    assert state.throttles["b"].reasons == frozenset() and state.lowered == {"t": LoweredWeight("t", NOW)}
