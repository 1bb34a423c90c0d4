"""The protected_cpu_stall objective: act on the harm to the important workloads, not on node busyness."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest
from pydantic import ValidationError

from nodeguard.model.levers import LeverChange
from nodeguard.model.samples import CpuMax
from nodeguard.model.snapshot import WorkloadUsage
from nodeguard.model.workloads import QosClass
from nodeguard.policy.holds import HeldThrottle, LoweredWeight
from nodeguard.policy.metrics import Metric
from nodeguard.policy.planner import Plan, plan
from nodeguard.policy.protect_state import ProtectState
from nodeguard.policy.settings import ProtectSettings
from nodeguard.policy.stall import competing_demand, competing_group, stall_share
from nodeguard.policy.state import Direction, GuardState, HeldBack
from nodeguard.policy.trace import plan_to_data
from nodeguard.policy.whatif import what_if
from nodeguard.surfaces.render import render_plan
from tests.policy.builders import (
    guard,
    kubelet_node,
    original_quota,
    predicted_node,
    previous_quota,
    quota,
    restores,
    reweighs,
    snapshot,
    stall_objective,
    throttles,
    usage,
)

STALL = Metric.PROTECTED_CPU_STALL
QUOTA_STREAK_TICKS = ProtectSettings().streak_ticks
QUOTA_TRIAL_TICKS = ProtectSettings().trial_ticks


# The quota lever alone (most tests here); the weight lever comes first by default, tested below.
SETTINGS = guard(stall_objective(), minQuotaCores=0.05, protectLever="quota")


def busy_node(important_waiting: float, burner_starved: float = 0.72) -> list[WorkloadUsage]:
    """Six burners that each want a whole core on 2 cores, and a Guaranteed pod that waited ``important_waiting``."""
    burners = [usage(f"be{i}", cores=0.26, waiting=burner_starved, priority=-i, cpu_max=CpuMax(None)) for i in range(6)]
    important = usage("g", qos=QosClass.GUARANTEED, cores=0.4, waiting=important_waiting, starved=0.0,
                      cpu_max=CpuMax(50000))  # fmt: skip
    return [*burners, important]


def raised_cores(change: LeverChange) -> float:
    """The cores a quota restore adds."""
    new, old = quota(change).cores, previous_quota(change).cores
    assert new is not None and old is not None, change
    return new - old


def test_share_prefers_psi_and_takes_its_own_throttling_off() -> None:
    """The stall is PSI where the kernel has it, else the threads' wait, less its own throttled time, in 0..1."""
    base = usage("g", cores=0.4, waiting=0.3)
    assert stall_share(base) == pytest.approx(0.3)
    assert stall_share(base._replace(cpu_stall_pct=12.0)) == pytest.approx(0.12)
    assert stall_share(base._replace(throttled_cores=0.25)) == pytest.approx(0.05)
    assert stall_share(base._replace(throttled_cores=0.5)) == 0.0
    assert stall_share(base._replace(waiting_cores=3.0)) == 1.0
    assert stall_share(usage("idle", cores=0.0, waiting=None)) == 0.0
    assert stall_share(usage("new", cores=None)) is None


def test_no_harm_no_action_on_a_saturated_node() -> None:
    """A node 100 % busy whose protected pod is not stalled is left alone: busyness is not harm."""
    p = plan(snapshot(busy_node(important_waiting=0.01), cpus=2, cores_used=2.0), GuardState(), SETTINGS)
    assert p.readings[STALL] == pytest.approx(1.0)
    assert p.actions == ()


def test_harm_throttles_the_batch_work_to_leave_room() -> None:
    """A stalled protected pod gets about its wait in idle CPU, once the other burners have expanded."""
    workloads = busy_node(important_waiting=0.2)
    p = plan(snapshot(workloads, cpus=2, cores_used=2.0), GuardState(), SETTINGS)
    acted = throttles(p)
    assert acted and "g" not in {a.workload_id for a in acted}
    # Everyone takes what it wanted within its (new) limit: the node is left about the pod's wait idle.
    assert predicted_node(p, workloads) == pytest.approx(2.0 - 0.2, abs=0.05)
    assert p.readings[STALL] == pytest.approx(20.0)


def test_it_measures_again_before_acting_again() -> None:
    """After a throttle the stall objective cools down: the next tick (still harmed) does not throttle more."""
    workloads = busy_node(important_waiting=0.2)
    first = plan(snapshot(workloads, cpus=2, cores_used=2.0), GuardState(), SETTINGS)
    second = plan(snapshot(workloads, cpus=2, cores_used=2.0, monotonic=101.0), first.state, SETTINGS)
    assert throttles(first) and not throttles(second)
    assert any(b.cause == "cooldown" for b in second.blocked)


def test_calm_restores_and_dead_band_holds() -> None:
    """Between restoreBelow and the threshold nothing moves; below it the throttles go up by restoreStepPercent
    of the node in all, then the harm is measured again (a cool-down) before the next step."""
    first = plan(snapshot(busy_node(0.2), cpus=2, cores_used=2.0), GuardState(), SETTINGS)
    assert throttles(first)
    state = dataclasses.replace(first.state, cooldowns={})
    held = plan(snapshot(busy_node(0.03), cpus=2, cores_used=1.8, monotonic=101.0), state, SETTINGS)
    assert held.actions == ()
    assert any(b.cause == "dead-band" for b in held.blocked)
    calm = plan(snapshot(busy_node(0.005), cpus=2, cores_used=1.8, monotonic=102.0), state, SETTINGS)
    raised = restores(calm)
    assert raised and sum(raised_cores(a) for a in raised) == pytest.approx(0.2), "restoreStep"
    again = plan(snapshot(busy_node(0.005), cpus=2, cores_used=1.8, monotonic=103.0), calm.state, SETTINGS)
    assert again.actions == () and any(b.cause == "cooldown" for b in again.blocked), "measures before the next"


def test_a_candidates_stall_is_never_read() -> None:
    """Only protected workloads' stalls count: a throttled burner's huge wait is not harm to act on."""
    workloads = busy_node(important_waiting=0.0, burner_starved=5.0)
    p = plan(snapshot(workloads, cpus=2, cores_used=2.0), GuardState(), SETTINGS)
    assert p.readings[STALL] == 0.0
    assert p.actions == ()


def test_a_selector_protects_a_burstable_pod_and_keeps_it_off_the_candidates() -> None:
    """With ``protect`` patterns, the matched pod's stall drives the objective and it is never throttled."""
    settings = guard(stall_objective(protect=["web-*"]), minQuotaCores=0.05, protectLever="quota")
    web = usage("kubepods/burstable/web-1", qos=QosClass.BURSTABLE, cores=0.4, waiting=0.3, starved=0.0)
    workloads = [*busy_node(important_waiting=0.0), web]
    p = plan(snapshot(workloads, cpus=2, cores_used=2.0), GuardState(), settings)
    assert p.readings[STALL] == pytest.approx(30.0)
    assert {s.name for s in p.protected} == {"web-1"}, "the default (Guaranteed) no longer applies"
    assert throttles(p) and web.workload.id not in {a.workload_id for a in throttles(p)}


def test_first_sight_blocks_nothing_protected_reads_zero() -> None:
    """A protected pod without a rate yet leaves the reading unknown; with nothing protected it is 0 (no harm)."""
    newcomer = usage("g", qos=QosClass.GUARANTEED, cores=None)
    assert plan(snapshot([newcomer]), GuardState(), SETTINGS).readings[STALL] is None
    assert plan(snapshot([usage("be")]), GuardState(), SETTINGS).readings[STALL] == 0.0


def test_what_if_a_stall_throttles() -> None:
    """``plan --what-if protected_cpu_stall=30%`` shows what the guard would do were the pod that stalled."""
    snap = what_if(snapshot(busy_node(0.0), cpus=2, cores_used=2.0), {"protected_cpu_stall": "30%"})
    p = plan(snap, GuardState(), SETTINGS)
    assert p.readings[STALL] == 30.0
    assert throttles(p)


def test_the_period_lever_writes_a_short_period() -> None:
    """guard.throttlePeriodUs: throttles write their quota on that CFS period; the original is kept for restore."""
    settings = guard(stall_objective(), minQuotaCores=0.05, throttlePeriodUs=10_000, protectLever="quota")
    p = plan(snapshot(busy_node(0.2), cpus=2, cores_used=2.0), GuardState(), settings)
    acted = throttles(p)
    assert acted and all(quota(a).period_us == 10_000 for a in acted)
    assert all(original_quota(a) == CpuMax(None) for a in acted)


@pytest.mark.parametrize(
    ("objective", "path", "words"),
    [
        ({**stall_objective(), "action": "evict", "restoreBelow": None}, "objectives.0.action", "cannot drive"),
        (
            {"metric": "cpu_total_usage", "threshold": 1, "restoreBelow": 0.5, "action": "throttle", "protect": ["x"]},
            "objectives.0",
            "node metric",
        ),
    ],
)
def test_config_refuses_what_the_stall_objective_cannot_do(objective: dict[str, Any], path: str, words: str) -> None:
    """Evicting on a protected workload's stall, or a protect selector on a node metric, is a config error."""
    with pytest.raises(ValidationError) as caught:
        guard(objective)
    errors = caught.value.errors()
    assert any(".".join(map(str, e["loc"])) == path and words in e["msg"] for e in errors), errors


def test_plan_shows_each_protected_stall_against_its_target_and_the_lever() -> None:
    """`nodeguard plan` and the trace show the protected pod's stall, its target, that it is harmed, and the lever."""
    settings = guard(stall_objective(), minQuotaCores=0.05, throttlePeriodUs=10_000, protectLever="quota")
    p = plan(snapshot(busy_node(0.2), cpus=2, cores_used=2.0), GuardState(), settings)
    [shown] = plan_to_data(p)["protected"]
    assert shown["name"] == "g" and shown["stall_pct"] == pytest.approx(20.0)
    assert (shown["target_pct"], shown["harmed"]) == (5.0, True)
    assert shown["levers"] == ["cpu.max quota on a 10 ms period"]
    text = render_plan(p)
    assert "protected workloads" in text and "20.0%" in text and "(10 ms period)" in text


# --- the weight lever ---------------------------------------------------------------------------------------

WEIGHT = guard(stall_objective(), minQuotaCores=0.05, weightHoldSeconds=60)


def test_competing_group_is_where_the_paths_part() -> None:
    """The weight that counts against a Guaranteed pod is its sibling tier's; between siblings, the pod's own."""
    assert competing_group("kp/burstable/pod1/c1", "kp/podg") == "kp/burstable"
    assert competing_group("kp/burstable/pod1", "kp/burstable/web") == "kp/burstable/pod1"
    assert competing_group("demo/batch-0", "demo/important") == "demo/batch-0"
    assert competing_group("kp/podg/c", "kp/podg") is None


def test_weights_first_then_quota() -> None:
    """Harm lowers the weight of each tier that competes with the protected pod (no quota touched); still harmed
    once they are all lowered, the quota lever takes over on the QUOTA_STREAK_TICKS-th tick over target in a row."""
    first = plan(snapshot(kubelet_node(0.2), cpus=2, cores_used=2.0), GuardState(), WEIGHT)
    assert {r.group for r in reweighs(first) if r.holds_back} == {"kp/burstable", "kp/besteffort"}
    assert throttles(first) == [] and set(first.state.held(LoweredWeight)) == {"kp/burstable", "kp/besteffort"}
    state = dataclasses.replace(first.state, cooldowns={})
    for tick in range(2, QUOTA_STREAK_TICKS):
        waiting = plan(snapshot(kubelet_node(0.2), cpus=2, cores_used=2.0, monotonic=99.0 + tick), state, WEIGHT)
        assert reweighs(waiting) == [] and throttles(waiting) == []
        assert any("quotas wait" in b.detail for b in waiting.blocked), waiting.blocked
        state = waiting.state
    last = plan(snapshot(kubelet_node(0.2), cpus=2, cores_used=2.0, monotonic=99.0 + QUOTA_STREAK_TICKS), state,
                WEIGHT)  # fmt: skip
    assert reweighs(last) == [] and throttles(last)


def test_a_residual_stall_around_the_target_costs_no_quota() -> None:
    """With the weights down, a stall over target three ticks out of four (noise around the target, as the v2 VM's
    residual stall with every tier idle) never gets the quota lever."""
    assert QUOTA_STREAK_TICKS > 3
    first = plan(snapshot(kubelet_node(0.2), cpus=2, cores_used=2.0), GuardState(), WEIGHT)
    state = dataclasses.replace(first.state, cooldowns={})
    for tick in range(40):  # past the drain patience (20 ticks): only the streak holds quotas back
        waited = 0.06 if tick % 4 else 0.03
        p = plan(snapshot(kubelet_node(waited), cpus=2, cores_used=2.0, monotonic=101.0 + tick), state, WEIGHT)
        assert throttles(p) == [], tick
        state = p.state


def test_a_group_holding_a_protected_workload_is_never_lowered() -> None:
    """A Burstable pod protected by a selector keeps its tier's weight: the burners there are left to the quota."""
    settings = guard(stall_objective(protect=["podg", "web"]), minQuotaCores=0.05)
    web = usage("kp/burstable/web", qos=QosClass.BURSTABLE, cores=0.2, waiting=0.0, starved=0.0)
    p = plan(snapshot([*kubelet_node(0.2), web], cpus=2, cores_used=2.0), GuardState(), settings)
    assert {r.group for r in reweighs(p)} == {"kp/besteffort"}


def test_weights_stay_down_while_the_work_under_them_still_wants_the_cpu() -> None:
    """No harm for longer than weightHoldSeconds is not enough while the burners under the lowered weights still
    wait for CPU the node does not have: the harm is absent because the weights are down, so they stay (blocked
    as contended), tick after tick."""
    first = plan(snapshot(kubelet_node(0.2), cpus=2, cores_used=2.0), GuardState(), WEIGHT)
    state = first.state
    for tick in range(5):
        p = plan(snapshot(kubelet_node(0.0), cpus=2, cores_used=2.0, monotonic=161.0 + 30 * tick), state, WEIGHT)
        assert reweighs(p) == [] and set(p.state.held(LoweredWeight)) == {"kp/burstable", "kp/besteffort"}, tick
        assert {b.cause for b in p.blocked if b.direction == Direction.RESTORE} == {"contended"}, p.blocked
        state = p.state


def test_weights_come_back_after_the_hold_once_the_work_under_them_is_quiet() -> None:
    """When the burners stop wanting CPU, a lowered weight stays while harm is recent and comes back after
    weightHoldSeconds without harm, its work quiet for quietTicks in a row by then."""
    first = plan(snapshot(kubelet_node(0.2), cpus=2, cores_used=2.0), GuardState(), WEIGHT)
    quiet = kubelet_node(0.0, burner_cores=0.05, burner_waiting=0.0)
    state = first.state
    for now in (130.0, 140.0, 150.0):  # quiet, but harm was recent
        soon = plan(snapshot(quiet, cpus=2, cores_used=0.6, monotonic=now), state, WEIGHT)
        assert reweighs(soon) == [] and set(soon.state.held(LoweredWeight)) == {"kp/burstable", "kp/besteffort"}
        state = soon.state
    later = plan(snapshot(quiet, cpus=2, cores_used=0.6, monotonic=161.0), state, WEIGHT)
    assert {(r.group, r.holds_back) for r in reweighs(later)} == {("kp/burstable", False), ("kp/besteffort", False)}
    assert later.state.held(LoweredWeight) == {}


def test_one_quiet_or_unknown_tick_under_lasting_contention_puts_no_weight_back() -> None:
    """After the hold, a single tick whose burners read quiet, or whose burners' use is not known (first sight),
    is not enough: the weights stay until the work has been quiet for quietTicks in a row."""
    first = plan(snapshot(kubelet_node(0.2), cpus=2, cores_used=2.0), GuardState(), WEIGHT)
    busy = plan(snapshot(kubelet_node(0.0), cpus=2, cores_used=2.0, monotonic=170.0), first.state, WEIGHT)
    quiet = kubelet_node(0.0, burner_cores=0.05, burner_waiting=0.0)
    unknown = [u._replace(cores=None, waiting_cores=None) if "podg" not in u.workload.id else u for u in quiet]
    state = busy.state
    for now, node in ((171.0, quiet), (172.0, unknown), (173.0, quiet), (174.0, quiet)):
        p = plan(snapshot(node, cpus=2, cores_used=2.0, monotonic=now), state, WEIGHT)
        assert reweighs(p) == [], now
        assert any(b.cause == "contended" for b in p.blocked), p.blocked
        state = p.state
    back = plan(snapshot(quiet, cpus=2, cores_used=0.6, monotonic=175.0), state, WEIGHT)
    assert {r.group for r in reweighs(back) if not r.holds_back} == {"kp/burstable", "kp/besteffort"}


def test_a_weight_comes_back_at_once_when_its_candidates_leave() -> None:
    """A lowered weight with no candidate left under it goes back on the next tick, harm or not."""
    first = plan(snapshot(kubelet_node(0.2), cpus=2, cores_used=2.0), GuardState(), WEIGHT)
    gone = [u for u in kubelet_node(0.2) if "besteffort" not in u.workload.id]
    left = plan(snapshot(gone, cpus=2, cores_used=2.0, monotonic=101.0), first.state, WEIGHT)
    assert [(r.group, r.holds_back) for r in reweighs(left)] == [("kp/besteffort", False)]


def test_competing_demand_is_the_wait_past_the_idle_cpu_without_their_own_throttling() -> None:
    """The competitors' demand is their threads' wait less their own CFS throttling, past the node's idle CPU;
    without waits, their use on a node with no idle CPU."""
    a = usage("a", cores=0.5, waiting=0.8)._replace(throttled_cores=0.3)
    b = usage("b", cores=0.5, waiting=0.4)
    assert competing_demand([a, b], idle_cores=0.0) == pytest.approx(0.9)
    assert competing_demand([a, b], idle_cores=0.5) == pytest.approx(0.4)
    assert competing_demand([a, b], idle_cores=2.0) == 0.0
    blind = [usage("c", cores=0.7, waiting=None), usage("d", cores=0.2, waiting=None)]
    assert competing_demand(blind, idle_cores=0.0) == pytest.approx(0.9)
    assert competing_demand(blind, idle_cores=1.0) == 0.0


def test_quota_waits_while_lowered_weights_drain_the_stall() -> None:
    """After the weights come down, a stall cut to half or less is left to drain (no quota) for a while; one that
    lasts past the patience, or that the weights did not cut, gets the quota lever."""
    first = plan(snapshot(kubelet_node(0.2), cpus=2, cores_used=2.0), GuardState(), WEIGHT)
    state = dataclasses.replace(first.state, cooldowns={})
    draining = plan(snapshot(kubelet_node(0.08), cpus=2, cores_used=2.0, monotonic=102.0), state, WEIGHT)
    assert throttles(draining) == [] and any("draining" in b.detail for b in draining.blocked)
    sustained = dataclasses.replace(state, streaks={(STALL, Direction.THROTTLE): QUOTA_STREAK_TICKS})
    late = plan(snapshot(kubelet_node(0.08), cpus=2, cores_used=2.0, monotonic=121.0), sustained, WEIGHT)
    assert throttles(late), "past the patience"


def test_a_group_held_back_after_a_refused_weight_leaves_the_gap_to_the_quota_lever() -> None:
    """While a tier's weight write is held back (the kernel refused it), the planner does not retry it: the
    quota lever closes the harm instead, on the burners in that tier too."""
    hold = HeldBack("kp/burstable", "EACCES", "cpu.shares", "refused", 99.0, 130.0, 1)
    lowered = LoweredWeight("kp/besteffort", 90.0, 20.0)
    streaks = {(STALL, Direction.THROTTLE): QUOTA_STREAK_TICKS}
    state = GuardState.holding(lowered, held_back={"kp/burstable": hold}, streaks=streaks)
    p = plan(snapshot(kubelet_node(0.2), cpus=2, cores_used=2.0), state, WEIGHT)
    assert reweighs(p) == []
    assert {a.workload_id for a in throttles(p)} & {"kp/burstable/pod0", "kp/burstable/pod1"}
    assert [h.workload_id for h in p.held_back] == ["kp/burstable"], "the hold shows in the plan"


def quotas_after_weights(after: float) -> tuple[Plan, list[Plan]]:
    """The quota lever's first throttle (weights long down, the stall at 6 % for a streak), then QUOTA_TRIAL_TICKS
    ticks at ``after`` (a share of a tick) with those quotas held."""
    lowered = [LoweredWeight(g, 0.0, 20.0) for g in ("kp/burstable", "kp/besteffort")]
    state = GuardState.holding(*lowered, streaks={(STALL, Direction.THROTTLE): QUOTA_STREAK_TICKS},
                               protect=ProtectState(recent_stall=(6.0,) * (QUOTA_STREAK_TICKS - 1)))  # fmt: skip
    first = plan(snapshot(kubelet_node(0.06), cpus=2, cores_used=2.0, monotonic=100.0), state, WEIGHT)
    later, state = [], first.state
    for tick in range(1, QUOTA_TRIAL_TICKS + 1):
        p = plan(snapshot(kubelet_node(after), cpus=2, cores_used=2.0, monotonic=100.0 + tick), state, WEIGHT)
        later.append(p)
        state = p.state
    return first, later


def test_quotas_that_do_not_cut_the_stall_go_back_and_stay_off() -> None:
    """Quotas set after the weights are judged after QUOTA_TRIAL_TICKS: a stall they left where it was (6 %) gets
    every one of them released, and the quota lever stays off (weights down) for weightHoldSeconds."""
    first, later = quotas_after_weights(0.06)
    trial = first.state.protect.trial
    assert throttles(first) and trial is not None and trial.before == 6.0
    judged = later[-1]
    released = {a.workload_id for a in restores(judged) if a.release}
    assert released and released == set(first.state.held(HeldThrottle)) | {
        a.workload_id for p in later[:-1] for a in throttles(p)
    }, "every quota set for the stall goes back"
    assert judged.state.held(HeldThrottle) == {} and judged.state.protect.futile_until == 100.0 + QUOTA_TRIAL_TICKS + 60
    assert any(b.cause == "futile" for b in judged.blocked)
    assert all("did not cut" in a.reason for a in restores(judged))
    state, causes = judged.state, set()
    for tick in range(1, 6):  # still harmed: past any cool-down, the quota lever says why it waits
        nxt = plan(snapshot(kubelet_node(0.06), cpus=2, cores_used=2.0, monotonic=110.0 + tick), state, WEIGHT)
        assert throttles(nxt) == [], tick
        causes |= {b.cause for b in nxt.blocked}
        state = nxt.state
    assert "futile" in causes, causes
    assert state.held(LoweredWeight).keys() == {"kp/burstable", "kp/besteffort"}, "the weights stay down"


def test_quotas_that_cut_the_stall_stay() -> None:
    """Quotas that brought the stall from 6 % to 2 % pass their trial: held, nothing released, the lever stays on."""
    first, later = quotas_after_weights(0.02)
    judged = later[-1]
    assert throttles(first)
    assert not any(restores(p) for p in later)
    protect = judged.state.protect
    assert judged.state.held(HeldThrottle) and protect.trial is None and protect.futile_until is None


def test_only_a_besteffort_pod_is_asked_to_be_idle() -> None:
    """Between sibling pods the weight lever lowers the competing pods themselves: a BestEffort pod is asked for
    cpu.idle (its weight is written once, at its creation), a Burstable pod and a QoS tier for the least weight
    (a resize and kubelet rewrite theirs, and an idle group refuses every weight write)."""
    protected = usage("kp/burstable/web", qos=QosClass.BURSTABLE, cores=0.4, waiting=0.3, starved=0.0,
                      protected=True)  # fmt: skip
    siblings = [
        usage("kp/burstable/batch", qos=QosClass.BURSTABLE, cores=0.8, waiting=0.7),
        usage("kp/besteffort/be", qos=QosClass.BEST_EFFORT, cores=0.8, waiting=0.7),
    ]
    settings = guard(stall_objective(protect=["web"]), minQuotaCores=0.05)
    p = plan(snapshot([protected, *siblings], cpus=2, cores_used=2.0), GuardState(), settings)
    targets = {c.group: c.target for c in p.changes if c.kind == "reweigh"}
    assert targets == {"kp/burstable/batch": None, "kp/besteffort": None}
    be_pod = usage("kp/be", qos=QosClass.BEST_EFFORT, cores=0.8, waiting=0.7)
    guaranteed = usage("kp/podg", qos=QosClass.GUARANTEED, cores=0.4, waiting=0.3, starved=0.0)
    p = plan(snapshot([guaranteed, be_pod], cpus=2, cores_used=2.0), GuardState(), guard(stall_objective()))
    assert {c.group: c.target for c in p.changes if c.kind == "reweigh"} == {"kp/be": "0"}
