"""Elastic demand: batch work takes every core a throttle frees, so one tick's throttles must cover that too."""

from __future__ import annotations

import pytest

from nodeguard.model.samples import CpuMax
from nodeguard.model.workloads import QosClass
from nodeguard.policy.holds import HeldThrottle
from nodeguard.policy.metrics import Metric
from nodeguard.policy.planner import plan
from nodeguard.policy.state import GuardState
from tests.policy.builders import cpu_throttle, guard, predicted_node, quota, restores, snapshot, throttles, usage

POD_LIMIT = CpuMax(150000)
CPU = Metric.CPU_TOTAL_USAGE
SETTINGS = guard(cpu_throttle(1.4, 1.0), minQuotaCores=0.05)


def elastic_node(burner_waiting: float | None, important_waiting: float | None = 0.2) -> list:  # type: ignore[type-arg]
    """Six burners that each want a whole core and get 0.28, and an important pod that wants 0.5 and gets 0.3."""
    burners = [usage(f"be{i}", cores=0.28, waiting=burner_waiting, cpu_max=POD_LIMIT, priority=-i) for i in range(6)]
    # A sleeper: its wait is not starved demand, but the room made is for it.
    important = usage("g", qos=QosClass.GUARANTEED, cores=0.3, waiting=important_waiting, starved=0.0,
                      cpu_max=CpuMax(50000))  # fmt: skip
    return [*burners, important]


def test_one_tick_covers_what_the_others_would_take() -> None:
    """On a saturated node the throttles leave room for the waiting work to expand and still land under the line."""
    workloads = elastic_node(burner_waiting=0.72)
    p = plan(snapshot(workloads, cpus=2, cores_used=2.0), GuardState(), SETTINGS)
    throttled = [a.workload_id for a in throttles(p)]
    assert "g" not in throttled
    assert len(throttled) == 6, "every burner would take what another gives up"
    assert predicted_node(p, workloads) == pytest.approx(1.4, abs=0.02), "closes the gap, no more"
    assert [a.workload_id for a in p.actions][:2] == ["be5", "be4"], "least important first"


def test_without_wait_figures_it_lowers_what_the_usage_says() -> None:
    """With no wait known (first tick, or none measured) the plan is the usage-only one: fewer throttles."""
    workloads = elastic_node(burner_waiting=None, important_waiting=None)
    p = plan(snapshot(workloads, cpus=2, cores_used=2.0), GuardState(), SETTINGS)
    assert len(throttles(p)) < 6


def test_waits_on_a_node_with_idle_cpu_are_latency_not_demand() -> None:
    """Waits of threads on a node that still has idle CPU (wake-up latency) do not widen the throttle."""
    workloads = [usage(f"w{i}", cores=0.5, waiting=0.05, priority=-i) for i in range(4)]
    quiet = plan(snapshot(workloads, cpus=4, cores_used=2.5), GuardState(), guard(cpu_throttle(2.0, 1.5)))
    none = plan(
        snapshot([usage(f"w{i}", cores=0.5, priority=-i) for i in range(4)], cpus=4, cores_used=2.5),
        GuardState(), guard(cpu_throttle(2.0, 1.5)),
    )  # fmt: skip
    assert [(a.workload_id, quota(a)) for a in quiet.actions] == [(a.workload_id, quota(a)) for a in none.actions]


def test_a_starved_candidate_is_capped_too() -> None:
    """A BestEffort burner that gets almost nothing (kubelet's weight 2) but waits a whole core is capped at its
    floor: it would take what the others give up."""
    starved = usage("be-starved", cores=0.01, waiting=0.99, cpu_max=POD_LIMIT, priority=-10)
    busy = [usage(f"bu{i}", qos=QosClass.BURSTABLE, cores=0.66, waiting=0.34, cpu_max=POD_LIMIT) for i in range(3)]
    p = plan(snapshot([starved, *busy], cpus=2, cores_used=2.0), GuardState(), SETTINGS)
    quotas = {a.workload_id: quota(a) for a in throttles(p)}
    assert quotas["be-starved"] == CpuMax(5000)


def test_a_held_throttle_does_not_count_as_waiting_to_expand() -> None:
    """A workload waiting only because its quota holds it back cannot take freed CPU: no extra throttling for it."""
    held_back_by_quota = usage("held", cores=0.1, waiting=0.9, cpu_max=CpuMax(10000))
    others = [usage(f"w{i}", cores=0.6, priority=-i) for i in range(3)]
    with_it = plan(snapshot([held_back_by_quota, *others], cpus=2, cores_used=1.9), GuardState(), SETTINGS)
    without = plan(snapshot(others, cpus=2, cores_used=1.9), GuardState(), SETTINGS)
    assert [(a.workload_id, quota(a)) for a in with_it.actions] == [(a.workload_id, quota(a)) for a in without.actions]


def test_room_left_under_the_waterline_goes_back_to_starved_throttled_work() -> None:
    """After a throttle that overshot (node well under its aim, above the restore waterline), starved throttled
    workloads get the room back a step at a time, most important first; a sleeping one is left alone."""
    held = {
        "be0": HeldThrottle("be0", POD_LIMIT, CpuMax(5000), frozenset({CPU}), 0.0, demand_cores=1.0),
        "be1": HeldThrottle("be1", POD_LIMIT, CpuMax(30000), frozenset({CPU}), 0.0, demand_cores=1.0),
        "calm": HeldThrottle("calm", POD_LIMIT, CpuMax(30000), frozenset({CPU}), 0.0, demand_cores=1.0),
    }
    workloads = [
        usage("be0", cores=0.05, waiting=0.95, cpu_max=CpuMax(5000), priority=-2),
        usage("be1", cores=0.3, waiting=0.7, cpu_max=CpuMax(30000), priority=-1),
        usage("calm", cores=0.1, waiting=None, cpu_max=CpuMax(30000)),
    ]
    settings = guard(cpu_throttle(1.4, 1.0, triggerAfter=2), targetMarginPercent=1, restoreStepPercent=10)
    state = GuardState.holding(*held.values())
    first = plan(snapshot(workloads, cpus=2, cores_used=1.2), state, settings)
    assert not first.actions, "confirming first: triggerAfter ticks with room"
    second = plan(snapshot(workloads, cpus=2, cores_used=1.2, monotonic=101.0), first.state, settings)
    raised = {a.workload_id: quota(a) for a in restores(second)}
    assert set(raised) == {"be1"}, "the most important starved workload, not the sleeping one"
    assert raised["be1"] == CpuMax(39000), "half the room: 1.4 less the 1 % margin (0.02) less 1.2 is 0.18: 0.09"
    assert "starved" in second.actions[0].reason


def test_room_left_under_the_waterline_goes_back_to_duty_cycled_work_its_quota_holds_back() -> None:
    """A duty-cycled workload sleeps between bursts (never starved), but one its own quota cut this tick is refilled;
    one nothing cut, and one only its container's own limit cut (a higher hold would go unused), are left alone."""
    held = {
        wid: HeldThrottle(wid, POD_LIMIT, CpuMax(20000), frozenset({CPU}), 0.0, demand_cores=0.3)
        for wid in ("cut", "uncut", "container")
    }
    workloads = [
        usage("cut", cores=0.2, waiting=0.05, starved=0.0, cpu_max=CpuMax(20000), priority=-1)._replace(
            throttled_cores=0.08, own_throttled_cores=0.08
        ),
        usage("uncut", cores=0.1, waiting=0.0, starved=0.0, cpu_max=CpuMax(20000))._replace(
            throttled_cores=0.0, own_throttled_cores=0.0
        ),
        usage("container", cores=0.1, waiting=0.08, starved=0.0, cpu_max=CpuMax(20000), priority=5)._replace(
            throttled_cores=0.08, own_throttled_cores=0.0
        ),
    ]
    settings = guard(cpu_throttle(1.4, 1.0, triggerAfter=1), targetMarginPercent=1, restoreStepPercent=10)
    result = plan(snapshot(workloads, cpus=2, cores_used=1.2), GuardState.holding(*held.values()), settings)
    raised = {a.workload_id: a for a in restores(result)}
    assert set(raised) == {"cut"}
    assert quota(raised["cut"]) == CpuMax(29000), "half the room: (1.4 - 0.02 - 1.2) / 2 is 0.09"
    assert "its quota holds it back" in raised["cut"].reason


def test_a_refill_closes_in_by_min_change_where_half_the_room_is_less() -> None:
    """Room of 0.03 cores (half of it under minChange, 0.02): the step is minChange, so the node does not stay up to
    twice minChange under its aim."""
    held = {"be": HeldThrottle("be", POD_LIMIT, CpuMax(30000), frozenset({CPU}), 0.0, demand_cores=1.0)}
    workloads = [usage("be", cores=0.3, waiting=0.7, cpu_max=CpuMax(30000))]
    settings = guard(cpu_throttle(1.4, 1.0, triggerAfter=1), targetMarginPercent=1, minChangePercent=1)
    result = plan(snapshot(workloads, cpus=2, cores_used=1.35), GuardState.holding(*held.values()), settings)
    [step] = restores(result)
    assert quota(step) == CpuMax(32000), "1.4 less the 0.02 margin less 1.35 is 0.03 of room: a step of 0.02"


def test_no_refill_within_min_change_of_the_aim_or_past_the_waterline() -> None:
    """Close to the aim (under minChange away) or over the waterline, nothing is refilled."""
    held = {"be": HeldThrottle("be", POD_LIMIT, CpuMax(30000), frozenset({CPU}), 0.0, demand_cores=1.0)}
    workloads = [usage("be", cores=0.3, waiting=0.7, cpu_max=CpuMax(30000))]
    settings = guard(cpu_throttle(1.4, 1.0), targetMarginPercent=1, minChangePercent=2)
    state = GuardState.holding(*held.values())
    for used in (1.35, 1.5):
        result = plan(snapshot(workloads, cpus=2, cores_used=used), state, settings)
        result = plan(snapshot(workloads, cpus=2, cores_used=used, monotonic=101.0), result.state, settings)
        assert not restores(result), used


def test_a_refill_never_releases_a_starved_workload_past_the_room() -> None:
    """A refill step close to what the workload used when throttled still raises it by the room only: releasing it
    to its original (1.5 cores) would let elastic work take far more than the room."""
    held = {"be": HeldThrottle("be", POD_LIMIT, CpuMax(71000), frozenset({CPU}), 0.0, demand_cores=0.72)}
    workloads = [usage("be", cores=0.71, waiting=0.29, cpu_max=CpuMax(71000))]
    settings = guard(cpu_throttle(1.4, 0.9, restoreAfter=1), targetMarginPercent=1)
    result = plan(snapshot(workloads, cpus=2, cores_used=1.28), GuardState.holding(*held.values()), settings)
    [step] = restores(result)
    assert not step.release and quota(step) == CpuMax(71000 + 5000), "half of 0.1 cores of room, not the original"


def test_a_throttle_remembers_the_demand_before_it() -> None:
    """A starved burner's recorded demand is its usage plus its unmet wait, not what its new limit lets it wait."""
    workloads = elastic_node(burner_waiting=0.72)
    p = plan(snapshot(workloads, cpus=2, cores_used=2.0), GuardState(), SETTINGS)
    demands = {wid: held.demand_cores for wid, held in p.state.held(HeldThrottle).items()}
    assert demands and all(d == pytest.approx(0.28 + 0.72, abs=0.05) for d in demands.values()), demands
