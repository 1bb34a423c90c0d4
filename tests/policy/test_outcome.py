"""Folding what the executor reports into the guard state: pure, so every path is checked here, for every lever."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

import pytest

from nodeguard.model.levers import CPU_QUOTA, CPU_WEIGHT, MEMORY_HIGH, LeverChange, LeverKey
from nodeguard.model.samples import CpuMax
from nodeguard.policy.holds import AnyHold, HeldMemory, HeldThrottle, LoweredWeight, holding
from nodeguard.policy.metrics import Metric
from nodeguard.policy.outcome import (
    Applied,
    HoldTimes,
    Kept,
    MovedOriginals,
    Refusal,
    adopted,
    fold,
    fold_moves,
    without_failed_evictions,
)
from nodeguard.policy.planner import Plan, plan
from nodeguard.policy.state import GuardState, PendingEviction
from tests.policy.builders import GiB, guard, snapshot, usage

NOW = 100.0
ORIGINAL, HELD, NEW = CpuMax(200000), CpuMax(100000), CpuMax(50000)
REFUSAL = Refusal("EINVAL", "cpu.max", "Invalid argument")
HOLDS = HoldTimes(first=10.0, longest=40.0)
QUOTA, WEIGHT, MEMORY = CPU_QUOTA.name, CPU_WEIGHT.name, MEMORY_HIGH.name
STALL, MEMORY_USE = Metric.PROTECTED_CPU_STALL, Metric.MEMORY_TOTAL_UTILIZATION


def held(group: str, quota: CpuMax = HELD) -> HeldThrottle:
    return HeldThrottle(group, ORIGINAL, quota, frozenset({Metric.CPU_TOTAL_USAGE}), NOW - 50)


def throttle(group: str) -> LeverChange:
    return LeverChange(QUOTA, group, NEW.render_v2(), ORIGINAL.render_v2(), release=False, holds_back=True,
                       kind="throttle", metric=Metric.CPU_TOTAL_USAGE, reason="gap", workload=usage(group).workload,
                       gap_before=1.0, predicted_release=0.5, previous=HELD.render_v2(), releases=0.5)  # fmt: skip


def restore(group: str, *, full: bool) -> LeverChange:
    quota = ORIGINAL if full else CpuMax(150000)
    return LeverChange(QUOTA, group, quota.render_v2(), ORIGINAL.render_v2(), release=full, holds_back=False,
                       kind="restore", metric=Metric.CPU_TOTAL_USAGE, reason="calm", workload=usage(group).workload,
                       gap_before=-1.0, predicted_release=-0.5, previous=HELD.render_v2())  # fmt: skip


def memory_held(group: str, high: int = 2 * GiB) -> HeldMemory:
    return HeldMemory(group, None, high, frozenset({MEMORY_USE}), NOW - 50, 3 * GiB)


def memory_throttle(group: str) -> LeverChange:
    return LeverChange(MEMORY, group, str(GiB), "max", release=False, holds_back=True, kind="memory_throttle",
                       metric=MEMORY_USE, reason="gap", workload=usage(group).workload, previous=str(2 * GiB),
                       releases=float(GiB))  # fmt: skip


def memory_restore(group: str, *, full: bool) -> LeverChange:
    return LeverChange(MEMORY, group, "max" if full else str(3 * GiB), "max", release=full, holds_back=False,
                       kind="memory_restore", metric=MEMORY_USE, reason="calm", workload=usage(group).workload,
                       previous=str(2 * GiB))  # fmt: skip


def weight_held(group: str) -> LoweredWeight:
    return LoweredWeight(group, NOW - 50, 8.0)


def reweigh(group: str, *, lower: bool, workloads: tuple[str, ...] = ("a",)) -> LeverChange:
    return LeverChange(WEIGHT, group, None, None, release=not lower, holds_back=lower, kind="reweigh",
                       metric=STALL, reason="harm" if lower else "calm", workloads=workloads)  # fmt: skip


@dataclass(frozen=True)
class Lever:
    """One lever's holds and changes on a group, as a plan makes them: what the folds see."""

    name: str
    before_lower: Callable[[str], AnyHold | None]  # the group's hold before a lowering (None: not held yet)
    after_lower: Callable[[str], AnyHold]  # the hold the plan's state has after it
    lower: Callable[[str], LeverChange]
    before_give_back: Callable[[str], AnyHold]  # the hold a full give-back ends
    give_back: Callable[[str], LeverChange]


LEVERS = [
    pytest.param(Lever(QUOTA, held, lambda g: held(g, NEW), throttle, held, lambda g: restore(g, full=True)),
                 id="quota"),
    pytest.param(Lever(MEMORY, memory_held, lambda g: memory_held(g, GiB), memory_throttle, memory_held,
                       lambda g: memory_restore(g, full=True)), id="memory"),
    # A weight comes down once, to the least: a group whose weight is lowered was not held before.
    pytest.param(Lever(WEIGHT, lambda g: None, lambda g: LoweredWeight(g, NOW, 8.0), lambda g: reweigh(g, lower=True),
                       weight_held, lambda g: reweigh(g, lower=False)), id="weight"),
]  # fmt: skip


def state_of(*holds: AnyHold | None) -> GuardState:
    return GuardState.holding(*(h for h in holds if h is not None))


def hold_of(state: GuardState, key: LeverKey) -> AnyHold | None:
    lever, group = key
    return state.holds.get(lever, {}).get(group)


def planned(*changes: LeverChange, state: GuardState) -> Plan:
    """A plan of these changes whose state assumes they all happened."""
    base = plan(snapshot(monotonic=NOW), GuardState(), guard())
    return replace(base, actions=changes, state=state)


@pytest.mark.parametrize("lever", LEVERS)
def test_a_refused_lowering_keeps_the_old_hold_and_holds_the_group_back_longer_each_time(lever: Lever) -> None:
    """A refused lowering (a throttle, a lower memory.high, a lowered weight) leaves the state at the hold the group
    had (none for a weight not lowered yet), holds it back for the first hold, and a second refusal in a row
    doubles the hold."""
    key = (lever.name, "a")
    before = state_of(lever.before_lower("a"))
    p = planned(lever.lower("a"), state=state_of(lever.after_lower("a")))
    first = fold(p, before, Applied(refused={key: REFUSAL}), HOLDS)
    assert hold_of(first.state, key) == lever.before_lower("a")
    assert first.refused["a"].until == NOW + 10 and first.state.held_back["a"].error == "EINVAL"
    again = fold(p, first.state, Applied(refused={key: REFUSAL}), HOLDS)
    assert again.refused["a"].until == NOW + 20 and again.refused["a"].failures == 2


def test_a_refused_throttle_keeps_the_old_limit() -> None:
    """The quota held after a refused throttle is the limit the workload had, not the one asked for."""
    p = planned(throttle("a"), state=GuardState.holding(held("a", NEW)))
    after = fold(p, GuardState.holding(held("a")), Applied(refused={(QUOTA, "a"): REFUSAL}), HOLDS)
    assert after.state.held(HeldThrottle)["a"].quota == HELD


@pytest.mark.parametrize("lever", LEVERS)
def test_a_refused_give_back_keeps_the_hold_without_holding_the_group_back(lever: Lever) -> None:
    """A give-back the kernel refused leaves the hold as it was (the value is still in place) and is no reason to
    leave the group out: for a weight as for a quota."""
    key = (lever.name, "a")
    before = state_of(lever.before_give_back("a"))
    p = planned(lever.give_back("a"), state=GuardState())
    after = fold(p, before, Applied(refused={key: REFUSAL}), HOLDS)
    assert hold_of(after.state, key) == lever.before_give_back("a")
    assert after.refused == {} and after.state.held_back == {}


@pytest.mark.parametrize("lever", LEVERS)
def test_a_withheld_lowering_of_a_group_not_held_leaves_nothing_held(lever: Lever) -> None:
    """A lowering the ledger could not record first was not written: a group not held before stays so."""
    key = (lever.name, "a")
    p = planned(lever.lower("a"), state=state_of(lever.after_lower("a")))
    after = fold(p, GuardState(), Applied(withheld=frozenset({key})), HOLDS)
    assert hold_of(after.state, key) is None and after.state.holds == {} and after.refused == {}


@pytest.mark.parametrize("lever", LEVERS)
def test_a_withheld_change_keeps_the_hold_the_group_had(lever: Lever) -> None:
    """A give-back (or a further lowering) the ledger could not record first was not written: the group keeps the
    hold it had, and nothing is held back."""
    key = (lever.name, "a")
    before = state_of(lever.before_give_back("a"))
    p = planned(lever.give_back("a"), state=GuardState())
    after = fold(p, before, Applied(withheld=frozenset({key})), HOLDS)
    assert hold_of(after.state, key) == lever.before_give_back("a") and after.refused == {}
    had = lever.before_lower("a")
    if had is not None:
        p = planned(lever.lower("a"), state=state_of(lever.after_lower("a")))
        assert hold_of(fold(p, state_of(had), Applied(withheld=frozenset({key}))).state, key) == had


@pytest.mark.parametrize("lever", LEVERS)
def test_a_group_that_left_is_forgotten(lever: Lever) -> None:
    """A group whose cgroup left while its value was written is no longer held."""
    key = (lever.name, "a")
    p = planned(lever.lower("a"), state=state_of(lever.after_lower("a")))
    after = fold(p, state_of(lever.before_give_back("a")), Applied(gone=frozenset({key})))
    assert after.state.holds == {}


@pytest.mark.parametrize("full", [False, True])
@pytest.mark.parametrize(
    ("key", "hold", "raised", "change"),
    [
        pytest.param((QUOTA, "a"), held("a"), held("a", CpuMax(150000)), restore, id="quota"),
        pytest.param((MEMORY, "a"), memory_held("a"), memory_held("a", 3 * GiB), memory_restore, id="memory"),
    ],
)
def test_a_released_record_ends_the_hold_whether_or_not_the_plan_asked_for_all_of_it(
    key: LeverKey, hold: AnyHold, raised: AnyHold, change: Callable[..., LeverChange], full: bool
) -> None:
    """A step up the ledger could not record goes all the way back, so the hold ends; a full give-back ended it in
    the plan already."""
    step_state = GuardState.holding(raised) if not full else GuardState()
    p = planned(change("a", full=full), state=step_state)
    written = {key: "max 100000" if key[0] == QUOTA else "max"}
    after = fold(p, GuardState.holding(hold), Applied(written=written, released=frozenset({key})))
    assert after.state.holds == {} and after.refused == {}


def test_a_write_that_succeeds_ends_the_hold_and_a_failed_eviction_is_pending_no_more() -> None:
    """A written limit drops the workload's held-back entry; an eviction that failed leaves the pending list."""
    pending = PendingEviction("b", Metric.MEMORY_TOTAL_USAGE, 1.0, 1 << 30, NOW - 1)
    first = fold(
        planned(throttle("a"), state=GuardState.holding(held("a", NEW))),
        GuardState(), Applied(refused={(QUOTA, "a"): REFUSAL}), HOLDS,
    )  # fmt: skip
    state = replace(first.state, evictions={"b": pending}, holds=holding([held("a", NEW)]))
    after = fold(planned(throttle("a"), state=state), first.state, Applied(written={(QUOTA, "a"): NEW.render_v2()}))
    folded = without_failed_evictions(after.state, {"b"})
    assert folded.held_back == {} and folded.evictions == {} and folded.held(HeldThrottle)["a"].quota == NEW


def test_a_written_weight_or_memory_high_ends_the_hold_back_too() -> None:
    """A write that succeeds on any lever ends its group's held-back entry."""
    cases: list[tuple[LeverKey, LeverChange, AnyHold]] = [
        ((WEIGHT, "t"), reweigh("t", lower=True), LoweredWeight("t", NOW, 8.0)),
        ((MEMORY, "m"), memory_throttle("m"), memory_held("m", GiB)),
    ]
    for key, change, hold in cases:
        first = fold(planned(change, state=GuardState.holding(hold)), GuardState(), Applied(refused={key: REFUSAL}))
        assert set(first.state.held_back) == {key[1]}
        after = fold(planned(change, state=replace(first.state, holds=holding([hold]))), first.state,
                     Applied(written={key: "1" if key[0] == WEIGHT else str(GiB)}))  # fmt: skip
        assert after.state.held_back == {} and hold_of(after.state, key) == hold


def test_moves_replace_the_original_and_released_records_leave_every_lever() -> None:
    """A moved original is the hold's new original (a quota's, a memory.high's; a weight keeps its hold); a released
    quota, weight or memory.high is no longer held."""
    state = GuardState.holding(held("a"), held("b"), LoweredWeight("t", NOW), LoweredWeight("u", NOW),
                               memory_held("m"), memory_held("n"))  # fmt: skip
    moves = MovedOriginals(
        {(QUOTA, "a"): CpuMax(120000).render_v2(), (MEMORY, "m"): str(4 * GiB), (WEIGHT, "u"): "50"},
        frozenset({(QUOTA, "b"), (WEIGHT, "t"), (MEMORY, "n")}),
    )
    moved = fold_moves(state, moves)
    assert moved.held(HeldThrottle) == {"a": replace(held("a"), original=CpuMax(120000))}
    assert moved.held(HeldMemory) == {"m": replace(memory_held("m"), original=4 * GiB)}
    assert moved.held(LoweredWeight) == {"u": LoweredWeight("u", NOW)}


def test_a_refused_lowering_holds_the_group_back_and_a_refused_raise_keeps_its_hold() -> None:
    """A weight the kernel would not lower is not lowered and is held back (the quota lever goes on); a refused
    put-back keeps the weight held without holding anything back; a withheld or vanished group is not lowered."""
    changes = (reweigh("t", lower=True), reweigh("v", lower=True), reweigh("w", lower=True),
               reweigh("u", lower=False, workloads=("b",)))  # fmt: skip
    before = GuardState.holding(LoweredWeight("u", NOW - 50))
    p = planned(*changes, state=GuardState.holding(*(LoweredWeight(g, NOW) for g in ("t", "v", "w"))))
    applied = Applied(refused={(WEIGHT, "t"): REFUSAL, (WEIGHT, "u"): REFUSAL},
                      withheld=frozenset({(WEIGHT, "v")}), gone=frozenset({(WEIGHT, "w")}))  # fmt: skip
    after = fold(p, before, applied, HOLDS)
    assert after.state.held(LoweredWeight) == {"u": LoweredWeight("u", NOW - 50)}
    assert set(after.state.held_back) == {"t"} and after.state.held_back["t"].until == NOW + 10
    assert set(after.refused) == {"t"}


def test_adopted_records_are_held_again_per_lever() -> None:
    """A daemon adopting its ledger holds each quota with its limits and metric (none when the metric is unknown),
    each memory.high with its values, and each weight as lowered since now."""
    state = adopted(
        [Kept(QUOTA, "a", "cpu_total_usage", ORIGINAL.render_v2(), HELD.render_v2()),
         Kept(QUOTA, "b", "gone_metric", ORIGINAL.render_v2(), HELD.render_v2()),
         Kept(WEIGHT, "t", "protected_cpu_stall", "100", "1"),
         Kept(MEMORY, "m", "memory_total_utilization", "max", str(GiB))], NOW,
    )  # fmt: skip
    assert state.held(HeldThrottle)["a"] == HeldThrottle("a", ORIGINAL, HELD, frozenset({Metric.CPU_TOTAL_USAGE}), NOW)
    assert state.held(HeldThrottle)["b"].reasons == frozenset()
    assert state.held(LoweredWeight) == {"t": LoweredWeight("t", NOW)}
    assert state.held(HeldMemory) == {"m": HeldMemory("m", None, GiB, frozenset({MEMORY_USE}), NOW)}
