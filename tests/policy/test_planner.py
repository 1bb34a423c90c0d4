"""The planner's seed semantics, tick by tick."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import pytest

from nodeguard.config import parse_document
from nodeguard.errors import ConfigError
from nodeguard.model.levers import LeverChange
from nodeguard.model.samples import CpuMax
from nodeguard.model.snapshot import Snapshot, WorkloadUsage
from nodeguard.model.workloads import QosClass
from nodeguard.policy.actions import Evict
from nodeguard.policy.holds import HeldThrottle
from nodeguard.policy.metrics import Metric
from nodeguard.policy.planner import Plan, plan
from nodeguard.policy.ranking import CPU_USAGE_SORTER
from nodeguard.policy.settings import GuardSettings
from nodeguard.policy.state import Direction, GuardState, PendingEviction
from tests.policy.builders import (
    UNLIMITED,
    GiB,
    MiB,
    cpu_throttle,
    guard,
    original_quota,
    previous_quota,
    quota,
    released_cores,
    restores,
    snapshot,
    throttles,
    usage,
)

CPU = Metric.CPU_TOTAL_USAGE
MEM = Metric.MEMORY_TOTAL_USAGE


def run(snapshots: Iterable[Snapshot], settings: GuardSettings, state: GuardState | None = None) -> list[Plan]:
    plans = []
    state = state or GuardState()
    for snap in snapshots:
        plans.append(plan(snap, state, settings))
        state = plans[-1].state
    return plans


def throttled(p: Plan) -> list[str]:
    return [a.workload_id for a in throttles(p)]


def evicted(p: Plan) -> list[str]:
    return [a.workload_id for a in p.actions if isinstance(a, Evict)]


def causes(p: Plan) -> set[tuple[Metric, Direction, str]]:
    return {(b.metric, b.direction, b.cause) for b in p.blocked}


def held(wid: str, quota_cores: float, original: CpuMax = UNLIMITED, *reasons: Metric) -> HeldThrottle:
    return HeldThrottle(wid, original, CpuMax(round(quota_cores * 100_000)), frozenset(reasons or {CPU}), 0.0)


def mem_evict(threshold: str = "8Gi", **extra: Any) -> dict[str, Any]:
    return {"metric": "memory_total_usage", "threshold": threshold, "action": "evict", "triggerAfter": 1, **extra}


# --- throttle: the minimal prefix ----------------------------------------------------

TEN_LOW = [usage(f"w{i}", cores=1.0, priority=-i) for i in range(10)]


@pytest.mark.parametrize(
    ("workloads", "cores_used", "expected"),
    [
        pytest.param(TEN_LOW, 7.5, ["w9", "w8"], id="ten alike: the two lowest priorities"),
        pytest.param(
            [usage(f"w{i}", cores=0.2 + 0.1 * i) for i in range(10)],
            6.0 + 0.95 + 0.85,
            ["w9", "w8"],
            id="same priority: the two busiest",
        ),
        pytest.param(
            [
                *(usage(f"bu{i}", qos=QosClass.BURSTABLE, cores=3.0) for i in range(5)),
                *(usage(f"be{i}", cores=0.5) for i in range(5)),
            ],
            6.0 + 0.9,
            ["be0", "be1"],
            id="BestEffort before Burstable, however busy",
        ),
        pytest.param(
            [*TEN_LOW, usage("g", qos=QosClass.GUARANTEED, cores=5.0), usage("p", cores=5.0, protected=True)],
            7.5,
            ["w9", "w8"],
            id="Guaranteed and protected are never candidates",
        ),
    ],
)
def test_gap_worth_two_throttles_exactly_the_top_two(
    workloads: list[WorkloadUsage], cores_used: float, expected: list[str]
) -> None:
    """A gap worth two workloads' releases throttles exactly the first two by the sort, and closes it."""
    [p] = run([snapshot(workloads, cores_used=cores_used)], guard(cpu_throttle(6.0, 5.0), minChangePercent=0))
    assert throttled(p) == expected
    released = sum(a.predicted_release or 0.0 for a in p.actions)
    assert released == pytest.approx(cores_used - 6.0, abs=1e-3)
    assert set(p.state.held(HeldThrottle)) == set(expected)


def test_throttle_quota_keeps_the_floor() -> None:
    """A throttle never sets a quota below the workload's request nor below minQuotaCores."""
    workloads = [usage("req", cores=2.0, request=0.8, started_at=2.0), usage("tiny", cores=2.0, started_at=1.0)]
    [p] = run([snapshot(workloads, cores_used=8.0)], guard(cpu_throttle(2.0, 1.0), minQuotaCores=0.1))
    quotas = {a.workload_id: quota(a).cores for a in throttles(p)}
    assert quotas == {"req": pytest.approx(0.8), "tiny": pytest.approx(0.1)}
    assert causes(p) == {(CPU, Direction.THROTTLE, "exhausted")}


def test_throttle_keeps_the_period_and_an_existing_lower_limit() -> None:
    """A workload with its own limit is lowered from that limit, in its own period."""
    own = CpuMax(150_000, 50_000)  # 3 cores
    [p] = run([snapshot([usage("w", cores=3.4, cpu_max=own)], cores_used=7.0)], guard(cpu_throttle(6.0, 5.0)))
    [action] = p.actions
    assert isinstance(action, LeverChange) and action.kind == "throttle"
    assert previous_quota(action) == own and original_quota(action) == own
    assert quota(action) == CpuMax(100_000, 50_000)  # 3 cores (usage counted up to the limit) - 1
    assert released_cores(action) == pytest.approx(1.0)


def test_already_throttled_workload_is_lowered_further() -> None:
    """A throttled workload can be lowered again; its original limit stays the one first recorded."""
    state = GuardState.holding(held("w", 1.0))
    snap = snapshot([usage("w", cores=1.0, cpu_max=CpuMax(100_000))], cores_used=6.5)
    [p] = run([snap], guard(cpu_throttle(6.0, 5.0)), state)
    [action] = p.actions
    assert isinstance(action, LeverChange) and action.kind == "throttle"
    assert previous_quota(action) == CpuMax(100_000)
    assert quota(action) == CpuMax(50_000)
    assert original_quota(action) == UNLIMITED
    assert p.state.held(HeldThrottle)["w"].original == UNLIMITED
    assert p.state.held(HeldThrottle)["w"].quota == CpuMax(50_000)


def test_small_remaining_gap_still_moves_at_least_min_change() -> None:
    """The last workload is lowered by at least minChangePercent of the node, so tiny writes never happen."""
    [p] = run([snapshot(TEN_LOW, cores_used=6.1)], guard(cpu_throttle(6.0, 5.0), minChangePercent=5))
    [action] = p.actions
    assert isinstance(action, LeverChange) and action.kind == "throttle"
    assert released_cores(action) == pytest.approx(0.4)  # 5 % of 8 cores, more than the 0.1 gap


# --- evict ---------------------------------------------------------------------------


def test_memory_only_objective_evicts_and_never_throttles() -> None:
    """A memory objective leads to eviction of the biggest low-importance user, not to throttling."""
    workloads = [usage("small", memory=GiB), usage("big", memory=3 * GiB), usage("g", qos=QosClass.GUARANTEED)]
    [p] = run([snapshot(workloads, memory_used=10 * GiB)], guard(mem_evict("8Gi")))
    assert [type(a) for a in p.actions] == [Evict]
    [action] = p.actions
    assert action.workload_id == "big"
    assert action.predicted_release == 3 * GiB
    assert p.state.evictions["big"].memory_bytes == 3 * GiB


def test_a_memory_throttle_objective_needs_its_restore_waterline() -> None:
    """The config takes a throttle objective on memory (memory.high) only with restoreBelow, naming the path."""
    doc = {
        "global": {
            "guard": {"objectives": [{"metric": "memory_total_usage", "threshold": "80%", "action": "throttle"}]}
        }
    }
    with pytest.raises(ConfigError, match=r"global\.guard\.objectives\[0\]\.restoreBelow"):
        parse_document(doc)


def test_incompressible_evicted_before_compressible() -> None:
    """With one eviction allowed, memory pressure is served before CPU."""
    settings = guard(
        {"metric": "cpu_total_usage", "threshold": 6.0, "action": "evict", "triggerAfter": 1},
        mem_evict("8Gi"),
    )
    workloads = [usage("cpu-hog", cores=4.0, memory=MiB), usage("mem-hog", cores=0.1, memory=4 * GiB)]
    [p] = run([snapshot(workloads, cores_used=7.0, memory_used=10 * GiB)], settings)
    [action] = p.actions
    assert (action.workload_id, action.metric) == ("mem-hog", MEM)
    assert (CPU, Direction.EVICT, "eviction-budget") in causes(p)


def test_evict_picks_the_fewest_workloads() -> None:
    """Evictions stop as soon as the released usage closes the gap."""
    workloads = [usage(f"w{i}", memory=GiB, priority=-i) for i in range(6)]
    [p] = run([snapshot(workloads, memory_used=10 * GiB)], guard(mem_evict("7.5Gi"), evictions={"maxPerTick": 5}))
    assert evicted(p) == ["w5", "w4", "w3"]


def test_eviction_budget_interval_and_pending_release() -> None:
    """maxPerTick, minIntervalSeconds, and a terminating victim counting as released are all respected."""
    settings = guard(mem_evict("8Gi"), evictions={"maxPerTick": 1, "minIntervalSeconds": 30})
    workloads = [usage(f"w{i}", memory=GiB, priority=-i) for i in range(5)]
    gap_two = {"memory_used": 10 * GiB}  # needs two victims
    first, soon, later = run(
        [
            snapshot(workloads, monotonic=100.0, **gap_two),
            snapshot(workloads, monotonic=110.0, **gap_two),
            snapshot(workloads, monotonic=131.0, **gap_two),
        ],
        settings,
    )
    assert evicted(first) == ["w4"]
    assert (MEM, Direction.EVICT, "eviction-budget") in causes(first)
    assert evicted(soon) == []
    assert (MEM, Direction.EVICT, "eviction-budget") in causes(soon)
    # w4 is still terminating: its gigabyte counts, one more victim closes the gap.
    assert evicted(later) == ["w3"]
    assert set(later.state.evictions) == {"w4", "w3"}


def test_terminating_victim_covering_the_gap_stops_a_second_eviction() -> None:
    """No second victim while the first, still terminating, releases enough."""
    state = GuardState(evictions={"w4": PendingEviction("w4", MEM, 1.0, 3 * GiB, 90.0)})
    workloads = [usage(f"w{i}", memory=GiB if i < 4 else 3 * GiB, priority=-i) for i in range(5)]
    [p] = run([snapshot(workloads, memory_used=10 * GiB)], guard(mem_evict("8Gi")), state)
    assert evicted(p) == []
    assert (MEM, Direction.EVICT, "eviction-pending") in causes(p)


def test_gone_and_timed_out_evictions_leave_the_state() -> None:
    """A victim that left is forgotten; one present past the termination timeout is reported as expired."""
    state = GuardState(
        evictions={
            "gone": PendingEviction("gone", MEM, 0.0, GiB, 90.0),
            "stuck": PendingEviction("stuck", MEM, 0.0, GiB, 0.0),
        }
    )
    settings = guard(mem_evict("8Gi"), evictions={"terminationTimeoutSeconds": 60})
    [p] = run([snapshot([usage("stuck")], monotonic=100.0)], settings, state)
    assert p.state.evictions == {}
    assert [e.workload_id for e in p.expired] == ["stuck"]


def test_throttle_releases_reduce_the_evict_gap() -> None:
    """Eviction is a last resort: what this tick's throttles release is not evicted for again."""
    settings = guard(
        cpu_throttle(6.0, 5.0), {"metric": "cpu_total_usage", "threshold": 6.5, "action": "evict", "triggerAfter": 1}
    )
    [p] = run([snapshot(TEN_LOW, cores_used=7.5)], settings)
    assert throttled(p) == ["w9", "w8"]
    assert evicted(p) == []


def test_non_quantified_evict_takes_one_and_waits_for_it() -> None:
    """A load-average eviction evicts one workload, then waits until it is gone."""
    settings = guard(
        {"metric": "load_average", "threshold": 1.0, "action": "evict", "triggerAfter": 1}, cooldownTicks=1
    )
    first, second, third = run(
        [
            snapshot(TEN_LOW, load1=16.0),
            snapshot(TEN_LOW, load1=16.0, monotonic=200.0),
            snapshot(TEN_LOW, load1=16.0, monotonic=300.0),
        ],
        settings,
    )
    assert evicted(first) == ["w9"]
    assert first.actions[0].predicted_release is None
    assert evicted(second) == []
    assert evicted(third) == []
    assert (Metric.LOAD_AVERAGE, Direction.EVICT, "eviction-pending") in causes(third)


# --- counting, cool-downs, circuit breaker -----------------------------------------------


def test_trigger_after_counts_consecutive_ticks() -> None:
    """Acting needs triggerAfter consecutive ticks past the waterline; a tick below starts the count again."""
    settings = guard(cpu_throttle(6.0, 5.0, triggerAfter=3))
    past, calm = snapshot(TEN_LOW, cores_used=7.0), snapshot(TEN_LOW, cores_used=5.5)
    plans = run([past, past, calm, past, past, past], settings)
    assert [bool(throttled(p)) for p in plans] == [False, False, False, False, False, True]
    assert (CPU, Direction.THROTTLE, "confirming") in causes(plans[4])


def test_restore_after_counts_consecutive_calm_ticks() -> None:
    """A restore comes only after restoreAfter consecutive ticks below the restore waterline."""
    settings = guard(cpu_throttle(6.0, 5.0, restoreAfter=3))
    state = GuardState.holding(held("w0", 0.5))
    calm, band = snapshot(TEN_LOW, cores_used=2.0), snapshot(TEN_LOW, cores_used=5.5)
    plans = run([calm, calm, band, calm, calm, calm], settings, state)
    restored = [bool(restores(p)) for p in plans]
    assert restored == [False, False, False, False, False, True]
    assert (CPU, Direction.RESTORE, "dead-band") in causes(plans[2])


def test_closed_loop_metric_acts_on_one_workload_then_cools_down() -> None:
    """load_average (not quantified) throttles one workload per action, then waits cooldownTicks before measuring."""
    settings = guard(
        {"metric": "load_average", "threshold": 2, "restoreBelow": 1, "action": "throttle", "triggerAfter": 1},
        cooldownTicks=2,
    )
    hot = snapshot(TEN_LOW, load1=24.0)  # 3 per core on 8
    plans = run([hot] * 7, settings)
    assert [len(p.actions) for p in plans] == [1, 0, 0, 1, 0, 0, 1]
    assert (Metric.LOAD_AVERAGE, Direction.THROTTLE, "cooldown") in causes(plans[1])
    first = plans[0].actions[0]
    assert isinstance(first, LeverChange) and first.kind == "throttle"
    assert first.workload_id == "w9"
    assert first.predicted_release is None
    assert quota(first).cores == pytest.approx(0.5)  # closedLoopStepPercent 50 of 1 core


@pytest.mark.parametrize(
    ("objective", "snap", "metric"),
    [
        pytest.param(cpu_throttle(6.0, 5.0), snapshot(TEN_LOW, cores_used=None), CPU, id="first snapshot"),
        pytest.param(
            {"metric": "load_average", "threshold": 2, "restoreBelow": 1, "action": "throttle", "triggerAfter": 1},
            snapshot(TEN_LOW, load1=None),
            Metric.LOAD_AVERAGE,
            id="no loadavg",
        ),
        pytest.param(
            cpu_throttle(6.0, 5.0),
            snapshot([*TEN_LOW, usage("new", cores=None)], cores_used=7.5),
            CPU,
            id="a candidate without CPU usage yet",
        ),
        pytest.param(
            {"metric": "load_average", "threshold": 2, "restoreBelow": 1, "action": "throttle", "triggerAfter": 1},
            snapshot([*TEN_LOW, usage("new", cores=None)], load1=24.0),
            Metric.LOAD_AVERAGE,
            id="closed loop with a candidate without CPU usage",
        ),
        pytest.param(
            mem_evict("8Gi"),
            snapshot([*TEN_LOW, usage("nomem", memory=None)], memory_used=12 * GiB),
            MEM,
            id="a candidate without memory usage",
        ),
    ],
)
def test_missing_samples_block_action(objective: dict[str, Any], snap: Snapshot, metric: Metric) -> None:
    """A missing sample blocks the metric and is reported; nothing is acted on."""
    [p] = run([snap], guard(objective), GuardState.primed())
    assert p.actions == ()
    assert any(b.metric == metric and b.cause == "missing-sample" for b in p.blocked)


# --- restore ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    "original",
    [pytest.param(CpuMax(200_000), id="two cores"), pytest.param(UNLIMITED, id="unlimited"), CpuMax(75_000, 50_000)],
)
def test_restore_returns_exactly_the_original_and_never_past_it(original: CpuMax) -> None:
    """Restores rise step by step, never above the original limit, and end by writing the original exactly."""
    settings = guard(cpu_throttle(6.0, 5.0), restoreStepPercent=10, minChangePercent=1)
    state = GuardState.holding(HeldThrottle("w0", original, CpuMax(10_000, original.period_us), frozenset({CPU}), 0.0))
    calm = snapshot(TEN_LOW, cores_used=1.0)
    ceiling = min(original.cores or 8.0, 8.0)
    plans = run([calm] * 20, settings, state)
    raised = [a for p in plans for a in restores(p)]
    for r in raised:
        cores = quota(r).cores
        assert (cores or 8.0) <= ceiling + 1e-9
        assert cores is None or cores - (previous_quota(r).cores or 0) <= 0.8 + 1e-9
    assert raised[-1].release and quota(raised[-1]) == original
    assert [r.release for r in raised].count(True) == 1
    assert plans[-1].state.held(HeldThrottle) == {}


def test_restore_most_important_first_within_the_step() -> None:
    """Restores go to the most important throttled workload first, and all of them share one step per tick."""
    settings = guard(cpu_throttle(6.0, 5.0), restoreStepPercent=10)  # 0.8 cores per tick
    workloads = [usage("be", cores=0.1), usage("bu", qos=QosClass.BURSTABLE, cores=0.1)]
    state = GuardState.holding(held("be", 0.1), held("bu", 0.1))
    [p] = run([snapshot(workloads, cores_used=1.0)], settings, state)
    [action] = p.actions
    assert isinstance(action, LeverChange) and action.kind == "restore"
    assert action.workload_id == "bu"
    assert quota(action).cores == pytest.approx(0.9)
    assert not action.release


def test_restore_step_limited_by_the_up_gap() -> None:
    """A restore raises quotas by no more than the throttle-up gap."""
    settings = guard(cpu_throttle(6.0, 5.0), restoreStepPercent=50)
    state = GuardState.holding(held("w0", 0.1))
    [p] = run([snapshot(TEN_LOW, cores_used=4.7)], settings, state)
    [action] = p.actions
    assert isinstance(action, LeverChange) and action.kind == "restore"
    assert quota(action).cores == pytest.approx(0.4)
    assert action.predicted_release == pytest.approx(-0.3)


def test_restore_skips_changes_under_min_change() -> None:
    """A step smaller than minChangePercent of the node is not written."""
    settings = guard(cpu_throttle(6.0, 5.0), minChangePercent=5)  # 0.4 cores
    state = GuardState.holding(held("w0", 0.1))
    [p] = run([snapshot(TEN_LOW, cores_used=4.8)], settings, state)
    assert p.actions == ()
    assert (CPU, Direction.RESTORE, "step-too-small") in causes(p)


def test_no_restore_while_any_throttle_waterline_is_past() -> None:
    """Quotas never rise in a tick in which some throttle metric is past its waterline."""
    settings = guard(
        cpu_throttle(6.0, 5.0),
        {"metric": "load_average", "threshold": 2, "restoreBelow": 1, "action": "throttle", "triggerAfter": 5},
    )
    state = GuardState.holding(held("w0", 0.1))
    [p] = run([snapshot(TEN_LOW, cores_used=1.0, load1=24.0)], settings, state)
    assert p.actions == ()
    assert (Metric.LOAD_AVERAGE, Direction.RESTORE, "throttling") in causes(p)


def test_departed_throttles_are_reported_and_dropped() -> None:
    """A throttled workload that left the node leaves the state and is named for the ledger."""
    state = GuardState.holding(held("gone", 0.5))
    [p] = run([snapshot(TEN_LOW, cores_used=5.5)], guard(cpu_throttle(6.0, 5.0)), state)
    assert p.departed == ("gone",)
    assert p.state.held(HeldThrottle) == {}


# --- candidates, dry run, purity -----------------------------------------------------------


def test_candidate_classes_and_below_priority() -> None:
    """Only the configured classes below the priority bound are candidates."""
    workloads = [
        usage("be-high", priority=10),
        usage("be-low", priority=1),
        usage("bu-low", qos=QosClass.BURSTABLE, priority=0),
    ]
    settings = guard(cpu_throttle(6.0, 5.0), candidates={"classes": ["BestEffort"], "belowPriority": 5})
    [p] = run([snapshot(workloads, cores_used=8.0)], settings)
    assert throttled(p) == ["be-low"]
    assert p.candidates == 1


@pytest.mark.parametrize(
    "settings",
    [
        pytest.param(guard(cpu_throttle(6.0, 5.0, dryRun=True), mem_evict(dryRun=True)), id="objective dryRun"),
        pytest.param(guard(cpu_throttle(6.0, 5.0), mem_evict(), dryRun=True), id="guard dryRun"),
    ],
)
def test_dry_run_marks_actions_and_holds_nothing(settings: GuardSettings) -> None:
    """Dry-run actions are planned and marked, and the state holds no throttle or eviction for them."""
    [p] = run([snapshot(TEN_LOW, cores_used=7.5, memory_used=12 * GiB)], settings)
    assert throttled(p) and evicted(p)
    assert all(a.dry_run for a in p.actions)
    assert p.state.held(HeldThrottle) == {} and p.state.evictions == {}


def test_dry_run_restore_keeps_the_throttle() -> None:
    """A restore in dry run leaves the throttle held."""
    state = GuardState.holding(held("w0", 0.5))
    [p] = run([snapshot(TEN_LOW, cores_used=1.0)], guard(cpu_throttle(6.0, 5.0), dryRun=True), state)
    [action] = p.actions
    assert isinstance(action, LeverChange) and action.kind == "restore" and action.dry_run
    assert p.state.held(HeldThrottle) == state.held(HeldThrottle)


def test_plan_is_pure() -> None:
    """The same inputs give the same plan, and the input state is left as it was."""
    state = GuardState.holding(held("w0", 0.5), streaks={(CPU, Direction.THROTTLE): 1})
    before = (dict(state.held(HeldThrottle)), dict(state.streaks))
    snap = snapshot(TEN_LOW, cores_used=7.5)
    settings = guard(cpu_throttle(6.0, 5.0, triggerAfter=2))
    first, second = plan(snap, state, settings), plan(snap, state, settings)
    assert first.actions == second.actions and first.state == second.state
    assert (dict(state.held(HeldThrottle)), dict(state.streaks)) == before


def test_throttle_order_follows_objective_sort_by() -> None:
    """An objective's sortBy replaces the metric's default order."""
    workloads = [usage("old", started_at=1.0, cores=2.0), usage("new", started_at=2.0, cores=1.0)]
    by_time = guard(cpu_throttle(6.0, 5.0, sortBy=["running_time"]))
    by_cpu = guard(cpu_throttle(6.0, 5.0))
    [time_plan], [cpu_plan] = (
        run([snapshot(workloads, cores_used=6.5)], by_time),
        run([snapshot(workloads, cores_used=6.5)], by_cpu),
    )
    assert throttled(time_plan) == ["new"]
    assert throttled(cpu_plan) == ["old"]
    assert throttled(cpu_plan) == [CPU_USAGE_SORTER.sort(workloads)[0].workload.id]


def test_restore_releases_at_once_above_the_usage_before_the_throttle() -> None:
    """A workload whose quota can rise back to what it used before the throttle gets its original limit at once."""
    settings = guard(cpu_throttle(6.0, 5.0), restoreStepPercent=10)  # 0.8 cores per tick
    throttle = HeldThrottle("w0", UNLIMITED, CpuMax(50_000), frozenset({CPU}), 0.0, demand_cores=1.0)
    [p] = run([snapshot(TEN_LOW, cores_used=1.0)], settings, GuardState.holding(throttle))
    [action] = p.actions
    assert isinstance(action, LeverChange) and action.kind == "restore"
    assert action.release and quota(action) == UNLIMITED
    assert action.predicted_release == pytest.approx(-0.5)
    assert p.state.held(HeldThrottle) == {}


def test_throttle_records_the_usage_before_it() -> None:
    """The first throttle records the workload's usage; lowering it again keeps that first figure."""
    snap = snapshot(TEN_LOW, cores_used=6.5)
    [first] = run([snap], guard(cpu_throttle(6.0, 5.0)))
    assert first.state.held(HeldThrottle)["w9"].demand_cores == 1.0
    [again] = run([snapshot(TEN_LOW, cores_used=6.3)], guard(cpu_throttle(6.0, 5.0)), first.state)
    assert again.state.held(HeldThrottle)["w9"].demand_cores == 1.0
    assert again.state.held(HeldThrottle)["w9"].quota.cores == pytest.approx(0.2)


def test_adopted_throttle_without_reasons_is_restored() -> None:
    """A throttle adopted from an older run's ledger, with no known reason, is still restored."""
    throttle = HeldThrottle("w0", CpuMax(100_000), CpuMax(90_000), frozenset(), 0.0)
    [p] = run([snapshot(TEN_LOW, cores_used=1.0)], guard(cpu_throttle(6.0, 5.0)), GuardState.holding(throttle))
    [action] = p.actions
    assert isinstance(action, LeverChange) and action.kind == "restore" and action.release
    assert quota(action) == CpuMax(100_000)


def test_target_margin_lands_under_the_waterline() -> None:
    """With targetMarginPercent the throttles release the gap plus that share of the node, no more."""
    settings_ = guard(cpu_throttle(6.0, 5.0), minChangePercent=0, targetMarginPercent=2)
    snap = snapshot(TEN_LOW, cores_used=7.5)
    [p] = run([snap], settings_)
    released = sum(a.predicted_release or 0.0 for a in p.actions)
    assert released == pytest.approx(7.5 - 6.0 + 0.02 * snap.node.cpus, abs=1e-3)
