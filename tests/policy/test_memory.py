"""Throttle objectives on memory metrics: memory.high lowered precisely, kept above floors, restored stepwise."""

from __future__ import annotations

from typing import Any

from nodeguard.model.levers import MEMORY_HIGH
from nodeguard.model.samples import CpuMax
from nodeguard.model.snapshot import WorkloadUsage
from nodeguard.model.workloads import QosClass
from nodeguard.policy.actions import Evict
from nodeguard.policy.holds import HeldMemory, HeldThrottle
from nodeguard.policy.metrics import Metric
from nodeguard.policy.outcome import Applied, Refusal, fold
from nodeguard.policy.planner import Plan, plan
from nodeguard.policy.state import Direction, GuardState
from nodeguard.policy.tuning import GRANULE
from tests.policy.builders import (
    GiB,
    MiB,
    at,
    changes,
    cpu_throttle,
    guard,
    high,
    mem,
    mem_throttle,
    original_high,
    previous_high,
    restores,
    settings,
)

UTIL = Metric.MEMORY_TOTAL_UTILIZATION


def down(value: float) -> int:
    return int(value) // GRANULE * GRANULE


def lowered(p: Plan) -> dict[str, int | None]:
    return {a.workload_id: high(a) for a in changes(p, "memory_throttle")}


def raised(p: Plan) -> list[int | None]:
    return [high(a) for a in changes(p, "memory_restore")]


def causes(p: Plan) -> set[tuple[Metric, Direction, str]]:
    return {(b.metric, b.direction, b.cause) for b in p.blocked}


def test_the_gap_is_closed_by_the_largest_least_important_candidate_alone() -> None:
    """1.2 GiB past 80 % of 16 GiB: the largest BestEffort pod's memory.high goes to its usage less the gap."""
    node = at(14 * GiB, mem("big", 4 * GiB), mem("small", GiB), mem("gold", 6 * GiB, qos=QosClass.GUARANTEED))
    p = plan(node, GuardState(), settings(mem_throttle()))
    gap = 14 * GiB - 0.8 * 16 * GiB
    assert lowered(p) == {"big": down(4 * GiB - gap)}
    [action] = changes(p, "memory_throttle")
    assert previous_high(action) is None and original_high(action) is None
    assert action.predicted_release is not None and action.predicted_release >= 100.0 * gap / (16 * GiB)
    assert p.state.held(HeldMemory)["big"].high == down(4 * GiB - gap)
    assert p.state.held(HeldMemory)["big"].original is None


def test_kubelets_memory_qos_value_is_the_original() -> None:
    """A memory.high kubelet set (Memory QoS) is lowered from, and kept as the original to give back."""
    node = at(14 * GiB, mem("big", 4 * GiB, high=5 * GiB))
    p = plan(node, GuardState(), settings(mem_throttle()))
    [action] = changes(p, "memory_throttle")
    assert (previous_high(action), original_high(action)) == (5 * GiB, 5 * GiB)
    assert p.state.held(HeldMemory)["big"].original == 5 * GiB


def test_never_below_the_request_the_next_candidate_takes_the_rest() -> None:
    """A candidate is lowered to its memory request at most; the next one closes what is left of the gap."""
    node = at(14 * GiB, mem("big", 4 * GiB, request=3584 * MiB), mem("next", 2 * GiB))
    p = plan(node, GuardState(), settings(mem_throttle()))
    gap = 14 * GiB - 0.8 * 16 * GiB
    cuts = lowered(p)
    assert cuts["big"] == 3584 * MiB
    assert cuts["next"] == down(2 * GiB - (gap - 512 * MiB))


def test_one_tick_lowers_a_candidate_by_at_most_step_percent_of_its_usage() -> None:
    """With stepPercent 10, the largest candidate loses 10 % of its usage and the next one the rest."""
    node = at(14 * GiB, mem("big", 4 * GiB), mem("next", 3 * GiB))
    p = plan(node, GuardState(), settings(mem_throttle(), step=10.0))
    assert lowered(p)["big"] == down(4 * GiB - 0.4 * GiB)
    assert "next" in lowered(p)


def test_candidates_at_their_floor_leave_the_gap_open_and_eviction_acts() -> None:
    """Every candidate at minHigh: no memory.high changes, the throttle says exhausted, the evict objective evicts."""
    evict = {"metric": "memory_total_utilization", "threshold": "85%", "action": "evict", "triggerAfter": 1}
    node = at(15 * GiB, mem("a", 64 * MiB), mem("b", 64 * MiB), mem("gold", 14 * GiB, qos=QosClass.BURSTABLE))
    p = plan(node, GuardState(), settings(mem_throttle(), evict, min_high="64Mi"))
    assert lowered(p) == {"gold": down(14 * GiB - (15 * GiB - 0.8 * 16 * GiB))}
    node = at(15 * GiB, mem("a", 64 * MiB), mem("b", 64 * MiB))
    p = plan(node, GuardState(), settings(mem_throttle(), evict, min_high="64Mi"))
    assert lowered(p) == {}
    assert (UTIL, Direction.THROTTLE, "exhausted") in causes(p)
    assert [a.workload_id for a in p.actions if isinstance(a, Evict)] == ["a"]


def test_a_workload_the_kernel_could_not_reclaim_down_to_its_limit_is_not_lowered_again() -> None:
    """Usage above a held memory.high (anonymous memory, no swap): a lower value releases nothing, so the next
    candidate is lowered and the hold stays as it is."""
    held = HeldMemory("big", None, 3 * GiB, frozenset({UTIL}), 50.0, 4 * GiB)
    node = at(14 * GiB, mem("big", 4 * GiB, high=3 * GiB), mem("next", 2 * GiB))
    p = plan(node, GuardState.holding(held), settings(mem_throttle()))
    assert set(lowered(p)) == {"next"}
    assert p.state.held(HeldMemory)["big"] == held


def test_a_held_workload_that_was_reclaimed_down_is_lowered_from_its_limit() -> None:
    """Usage at its held memory.high (the kernel reclaimed its cache): the next cut starts from the held value."""
    held = HeldMemory("big", None, 3 * GiB, frozenset({UTIL}), 50.0, 4 * GiB)
    node = at(14 * GiB, mem("big", 3 * GiB, high=3 * GiB))
    p = plan(node, GuardState.holding(held), settings(mem_throttle()))
    gap = 14 * GiB - 0.8 * 16 * GiB
    assert lowered(p) == {"big": down(3 * GiB - gap)}
    assert p.state.held(HeldMemory)["big"].original is None and p.state.held(HeldMemory)["big"].since == 50.0


def test_on_cgroup_v1_the_objective_is_blocked_with_its_cause_and_eviction_stays() -> None:
    """A v1 node has no memory.high: the throttle line is blocked needs-cgroup-v2, the evict line still evicts."""
    evict = {"metric": "memory_total_utilization", "threshold": "85%", "action": "evict", "triggerAfter": 1}
    node = at(15 * GiB, mem("big", 4 * GiB, high=None), version="v1")  # type: ignore[arg-type]
    p = plan(node, GuardState(), settings(mem_throttle(), evict))
    assert lowered(p) == {}
    [blocked] = [b for b in p.blocked if b.cause == "needs-cgroup-v2"]
    assert blocked.metric is UTIL and "cgroup v2" in blocked.detail
    assert [a.workload_id for a in p.actions if isinstance(a, Evict)] == ["big"]


def test_a_workload_without_memory_high_is_not_a_memory_candidate() -> None:
    """A group without the memory controller's file is passed over; the next candidate closes the gap."""
    node = at(14 * GiB, mem("bare", 8 * GiB, high=None), mem("next", 3 * GiB))  # type: ignore[arg-type]
    assert set(lowered(plan(node, GuardState(), settings(mem_throttle())))) == {"next"}


def test_a_dry_run_throttle_holds_nothing() -> None:
    """A dry-run memory objective plans the change but the state holds no memory.high."""
    node = at(14 * GiB, mem("big", 4 * GiB))
    p = plan(node, GuardState(), settings(mem_throttle(dryRun=True)))
    assert [a.dry_run for a in changes(p, "memory_throttle")] == [True]
    assert p.state.held(HeldMemory) == {}


def test_restore_raises_a_step_when_calm_and_releases_to_the_exact_original() -> None:
    """Below the restore waterline memory.high rises by restoreStepPercent of node memory, then goes back whole."""
    held = HeldMemory("big", 5 * GiB, 2 * GiB, frozenset({UTIL}), 50.0, 4 * GiB)
    node = at(8 * GiB, mem("big", 2 * GiB, high=2 * GiB))
    step = guard(mem_throttle(), memory={"restoreStepPercent": 5})
    p = plan(node, GuardState.holding(held), step)
    [first] = changes(p, "memory_restore")
    assert not first.release and high(first) == 2 * GiB + down(0.05 * 16 * GiB)
    big_step = guard(mem_throttle(), memory={"restoreStepPercent": 50})
    p = plan(node, GuardState.holding(held), big_step)
    [last] = changes(p, "memory_restore")
    assert last.release and high(last) == 5 * GiB  # kubelet's value, not the demand it was capped at
    assert p.state.held(HeldMemory) == {}


def test_no_restore_in_the_dead_band() -> None:
    """Between restoreBelow and the waterline a held memory.high stays where it is, and the plan says why."""
    held = HeldMemory("big", None, 2 * GiB, frozenset({UTIL}), 50.0, 4 * GiB)
    node = at(12 * GiB, mem("big", 2 * GiB, high=2 * GiB))
    p = plan(node, GuardState.holding(held), settings(mem_throttle()))
    assert raised(p) == []
    assert (UTIL, Direction.RESTORE, "dead-band") in causes(p)
    assert p.state.held(HeldMemory)["big"].high == 2 * GiB


def test_a_refused_write_holds_the_workload_back_and_the_next_candidate_closes_the_gap() -> None:
    """EINVAL on the first candidate's memory.high: it is held back, and planning again lowers the next one."""
    node = at(14 * GiB, mem("big", 4 * GiB), mem("next", 3 * GiB))
    rules = settings(mem_throttle())
    first = plan(node, GuardState(), rules)
    assert set(lowered(first)) == {"big"}
    refused = {(MEMORY_HIGH.name, "big"): Refusal("EINVAL", "memory.high", "Invalid argument")}
    after = fold(first, GuardState(), Applied(refused=refused))
    assert set(after.refused) == {"big"} and "big" not in after.state.held(HeldMemory)
    again = plan(node, GuardState().with_held_back(after.refused), rules)
    assert set(lowered(again)) == {"next"}


def test_a_memory_throttle_does_not_hold_back_cpu_restores() -> None:
    """Quotas held for CPU still come back while only a memory line is past its waterline."""
    cpu = HeldThrottle("big", CpuMax(None), CpuMax(100_000, 100_000), frozenset({Metric.CPU_TOTAL_USAGE}), 10.0)
    node = at(14 * GiB, mem("big", 4 * GiB, cores=1.0), cores_used=1.0)
    p = plan(node, GuardState.holding(cpu), settings(mem_throttle(), cpu_throttle(6.0, 5.0)))
    assert [a.workload_id for a in restores(p)] == ["big"]
    assert set(lowered(p)) == {"big"}


def mem_protect(threshold: float = 10.0, restore: float = 2.0, **extra: Any) -> dict[str, Any]:
    return {"metric": "protected_memory_stall", "threshold": threshold, "restoreBelow": restore,
            "action": "throttle", "triggerAfter": 1, "restoreAfter": 1, **extra}  # fmt: skip


def gold(stall: float | None) -> WorkloadUsage:
    """A Guaranteed pod re-reading its files, stalled ``stall`` % of the last tick on memory."""
    return mem("gold", GiB, qos=QosClass.GUARANTEED)._replace(memory_stall_pct=stall)


def test_a_protected_pods_memory_stall_lowers_every_candidates_memory_high_one_step() -> None:
    """The protected pod stalled 30 % on memory: each streaming candidate loses stepPercent of its usage, then the
    line cools down."""
    node = at(6 * GiB, gold(30.0), mem("stream-a", 2 * GiB), mem("stream-b", GiB))
    p = plan(node, GuardState(), settings(mem_protect(), step=25.0))
    assert lowered(p) == {"stream-a": down(1.5 * GiB), "stream-b": down(0.75 * GiB)}
    assert p.readings[Metric.PROTECTED_MEMORY_STALL] == 30.0
    assert p.state.cooldowns[(Metric.PROTECTED_MEMORY_STALL, Direction.THROTTLE)] > 0
    again = plan(node, p.state, settings(mem_protect(), step=25.0))
    assert lowered(again) == {}
    assert (Metric.PROTECTED_MEMORY_STALL, Direction.THROTTLE, "cooldown") in causes(again)


def test_the_stall_is_the_protected_workloads_own_not_the_candidates() -> None:
    """A candidate's own memory stall (it is the one being held back) never reads as harm."""
    candidate = mem("stream", 2 * GiB)._replace(memory_stall_pct=80.0)
    p = plan(at(6 * GiB, gold(1.0), candidate), GuardState(), settings(mem_protect()))
    assert p.readings[Metric.PROTECTED_MEMORY_STALL] == 1.0
    assert lowered(p) == {}


def test_a_workload_the_objective_protects_by_name_is_no_candidate() -> None:
    """protect patterns choose who is protected: a BestEffort pod named by them is never lowered, and its stall
    is the one read."""
    mine = mem("cache-reader", GiB)._replace(memory_stall_pct=40.0)
    node = at(6 * GiB, mine, mem("stream", 2 * GiB))
    p = plan(node, GuardState(), settings(mem_protect(protect=["cache-*"])))
    assert set(lowered(p)) == {"stream"}


def test_memory_stall_holds_come_back_a_step_at_a_time_once_calm() -> None:
    """Below restoreBelow a held memory.high rises one step and the restore cools down before the next."""
    held = HeldMemory("stream", None, GiB, frozenset({Metric.PROTECTED_MEMORY_STALL}), 50.0, 2 * GiB)
    node = at(6 * GiB, gold(0.5), mem("stream", GiB, high=GiB))
    rules = guard(mem_protect(), memory={"restoreStepPercent": 1})
    p = plan(node, GuardState.holding(held), rules)
    [step] = changes(p, "memory_restore")
    assert not step.release and high(step) == GiB + down(0.01 * 16 * GiB) and step.predicted_release is None
    again = plan(node, p.state, rules)
    assert raised(again) == []
    assert (Metric.PROTECTED_MEMORY_STALL, Direction.RESTORE, "cooldown") in causes(again)


def test_a_memory_stall_hold_stays_while_its_stream_still_presses_against_it() -> None:
    """Calm only because of the hold: a stream at its memory.high and stalled on its own reclaim keeps the hold
    ("contended"), through ticks without a stall of its own, until it has not pressed for 10 s, or while well
    below the value; then the hold comes back a step."""
    held = HeldMemory("stream", None, GiB, frozenset({Metric.PROTECTED_MEMORY_STALL}), 50.0, 2 * GiB)
    rules = guard(mem_protect(), memory={"restoreStepPercent": 1})

    def tick(state: GuardState, now: float, used: int, stall: float) -> Plan:
        stream = mem("stream", used, high=GiB)._replace(memory_stall_pct=stall)
        return plan(at(6 * GiB, gold(0.5), stream, monotonic=now), state, rules)

    pressing = tick(GuardState.holding(held), 100.0, GiB, 3.0)
    assert raised(pressing) == []
    assert (Metric.PROTECTED_MEMORY_STALL, Direction.RESTORE, "contended") in causes(pressing)
    assert pressing.state.held(HeldMemory)["stream"].pressed == 100.0
    quiet = tick(pressing.state, 105.0, GiB, 0.0)  # a tick without a stall of its own: not stopped yet
    assert raised(quiet) == [] and quiet.state.held(HeldMemory)["stream"].pressed == 100.0
    assert raised(tick(quiet.state, 110.5, GiB, 0.0)) == [GiB + down(0.01 * 16 * GiB)]
    # Never pressed: well below its value (stalled or not), or at it without a stall, it comes back at once.
    for used, stall in ((GiB // 2, 3.0), (GiB, 0.0)):
        assert raised(tick(GuardState.holding(held), 100.0, used, stall)) == [GiB + down(0.01 * 16 * GiB)]


def test_a_pressed_hold_is_given_back_once_a_reload_removes_the_objective() -> None:
    """A reload that drops protected_memory_stall while its stream still presses: no objective asks for the hold
    any more, so it rises a step that tick ("no memory objective holds it"), pressed or not."""
    held = HeldMemory("stream", None, GiB, frozenset({Metric.PROTECTED_MEMORY_STALL}), 50.0, 2 * GiB, pressed=99.0)
    stream = mem("stream", GiB, high=GiB)._replace(memory_stall_pct=3.0)
    p = plan(at(6 * GiB, gold(0.5), stream), GuardState.holding(held), guard(cpu_throttle(),
             memory={"restoreStepPercent": 1}))  # fmt: skip
    [step] = changes(p, "memory_restore")
    assert high(step) == GiB + down(0.01 * 16 * GiB) and "no memory objective holds it" in step.reason


def test_protected_memory_needs_cgroup_v2_too() -> None:
    """On v1 (no memory.pressure per cgroup, no memory.high) the protected-memory line is blocked with its cause."""
    node = at(6 * GiB, gold(30.0), mem("stream", 2 * GiB, high=None), version="v1")  # type: ignore[arg-type]
    p = plan(node, GuardState(), settings(mem_protect()))
    assert lowered(p) == {}
    assert (Metric.PROTECTED_MEMORY_STALL, Direction.THROTTLE, "needs-cgroup-v2") in causes(p)


def test_holds_no_memory_objective_asks_for_are_given_back_a_step_a_tick() -> None:
    """A memory.high adopted from an older run's ledger (no reason known), with no memory objective configured
    now, rises by restoreStepPercent of node memory a tick and goes back to its exact original."""
    held = HeldMemory("big", None, 2 * GiB, frozenset(), 50.0, None)
    node = at(14 * GiB, mem("big", 2 * GiB, high=2 * GiB))  # past any waterline: none is configured
    state = GuardState.holding(held)
    highs = []
    for _ in range(20):
        p = plan(node, state, guard(cpu_throttle(), memory={"restoreStepPercent": 25}))
        [action] = changes(p, "memory_restore")
        assert "no memory objective holds it" in action.reason
        highs.append(high(action))
        state = p.state
        if not state.held(HeldMemory):
            break
    assert highs == [2 * GiB + 4 * GiB, 2 * GiB + 8 * GiB, 2 * GiB + 12 * GiB, None]
