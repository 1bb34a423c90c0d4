"""Properties of precise throttling and restoring over generated nodes."""

from __future__ import annotations

import random

from hypothesis import given, settings
from hypothesis import strategies as st

from nodeguard.model.levers import LeverChange
from nodeguard.model.samples import CpuMax
from nodeguard.model.snapshot import WorkloadUsage
from nodeguard.model.workloads import QosClass
from nodeguard.policy.holds import HeldThrottle
from nodeguard.policy.metrics import Metric
from nodeguard.policy.planner import plan
from nodeguard.policy.ranking import CPU_USAGE_SORTER
from nodeguard.policy.state import GuardState
from nodeguard.policy.tuning import CLOSED_CORES
from tests.policy.builders import (
    UNLIMITED,
    cpu_throttle,
    guard,
    quota,
    released_cores,
    restores,
    snapshot,
    throttles,
    usage,
)

CPUS = 32
THRESHOLD = 16.0


@st.composite
def workloads(draw: st.DrawFn) -> list[WorkloadUsage]:
    count = draw(st.integers(1, 30))
    return [
        usage(
            f"w{i:02d}",
            qos=draw(st.sampled_from([QosClass.BEST_EFFORT, QosClass.BURSTABLE])),
            priority=draw(st.integers(-2, 2)),
            cores=draw(st.floats(0.0, 4.0)),
            request=draw(st.one_of(st.none(), st.floats(0.0, 2.0))),
            cpu_max=draw(st.sampled_from([UNLIMITED, CpuMax(300_000), CpuMax(150_000, 50_000)])),
            started_at=draw(st.floats(1.0, 1e6)),
        )
        for i in range(count)
    ]


gaps = st.floats(0.01, 20.0)
min_changes = st.sampled_from([0.0, 0.5, 2.0])


def throttle_plan(ws: list[WorkloadUsage], gap: float, min_change: float) -> list[LeverChange]:
    settings_ = guard(cpu_throttle(THRESHOLD, THRESHOLD / 2), minChangePercent=min_change)
    p = plan(snapshot(ws, cpus=CPUS, cores_used=THRESHOLD + gap), GuardState(), settings_)
    return throttles(p)


@settings(max_examples=300)
@given(workloads(), gaps, min_changes)
def test_throttled_set_is_the_minimal_prefix(ws: list[WorkloadUsage], gap: float, min_change: float) -> None:
    """The throttled workloads are a prefix of the releasable candidates in sort order, and no shorter one closes the gap."""
    actions = throttle_plan(ws, gap, min_change)
    order = [u.workload.id for u in CPU_USAGE_SORTER.sort(ws)]
    chosen = [a.workload_id for a in actions]
    positions = [order.index(wid) for wid in chosen]
    assert positions == sorted(positions)
    # Every candidate skipped before the last chosen one (every candidate, when none was) was at its floor already.
    skipped = set(order[: positions[-1]] if chosen else order) - set(chosen)
    for u in ws:
        if u.workload.id in skipped:
            floor = max(0.05, u.workload.cpu_request_cores or 0.0)
            used = min(u.cores or 0.0, (u.cpu_max.cores if u.cpu_max else None) or float("inf"))
            assert used - floor < CLOSED_CORES
    # Without the last one the gap is still open (with none, it is open).
    assert sum(released_cores(a) for a in actions[:-1]) < gap - CLOSED_CORES + 1e-9


@settings(max_examples=300)
@given(workloads(), gaps, min_changes)
def test_overshoot_is_less_than_one_step(ws: list[WorkloadUsage], gap: float, min_change: float) -> None:
    """Predicted releases close the gap, or use every candidate, and overshoot it by less than the last step."""
    actions = throttle_plan(ws, gap, min_change)
    released = sum(released_cores(a) for a in actions)

    def writes(found: list[LeverChange]) -> list[tuple[str, CpuMax]]:
        return [(a.workload_id, quota(a)) for a in found]

    if released >= gap - CLOSED_CORES:  # closed (the gap is never under CLOSED_CORES: something was lowered)
        assert actions and released - gap < released_cores(actions[-1])
        remaining = gap - sum(released_cores(a) for a in actions[:-1])
        assert released_cores(actions[-1]) <= max(remaining, min_change / 100 * CPUS) + 1e-4  # whole microseconds
    else:  # exhausted: every candidate went as low as it can; a larger gap changes nothing
        assert writes(throttle_plan(ws, gap + 1.0, min_change)) == writes(actions)


@given(workloads(), gaps, st.randoms(use_true_random=False))
def test_plan_does_not_depend_on_input_order(ws: list[WorkloadUsage], gap: float, rnd: random.Random) -> None:
    """Shuffling the snapshot's workloads does not change the plan."""
    shuffled = list(ws)
    rnd.shuffle(shuffled)
    assert throttle_plan(ws, gap, 1.0) == throttle_plan(shuffled, gap, 1.0)


@given(
    st.sampled_from([UNLIMITED, CpuMax(50_000), CpuMax(250_000), CpuMax(30_000, 20_000)]),
    st.floats(0.05, 0.4),
    st.lists(st.floats(0.0, 15.0), min_size=1, max_size=40),
    st.floats(1.0, 100.0),
)
def test_restores_never_exceed_the_original(original: CpuMax, start: float, usages: list[float], step: float) -> None:
    """Whatever the node does, a restored quota never rises above the original limit, and a full restore is exact."""
    settings_ = guard(cpu_throttle(12.0, 10.0), restoreStepPercent=step, minChangePercent=0.5)
    period = original.period_us
    state = GuardState.holding(
        HeldThrottle("w", original, CpuMax(round(start * period), period), frozenset({Metric.CPU_TOTAL_USAGE}), 0.0)
    )
    ceiling = min(original.cores or float(CPUS), float(CPUS))
    for cores_used in usages:
        before = state.held(HeldThrottle).get("w")
        limit = before.quota if before is not None else original
        ws = [usage("w", cores=min(limit.cores or 4.0, 4.0), cpu_max=limit)]
        p = plan(snapshot(ws, cpus=CPUS, cores_used=cores_used), state, settings_)
        for action in restores(p):
            assert action.release == (quota(action) == original)
            if not action.release:
                cores = quota(action).cores
                assert cores is not None and cores < ceiling
        state = p.state
        held = state.held(HeldThrottle).get("w")  # every tick: held below the original, or released to it exactly
        assert held is None or (held.quota.cores is not None and held.quota.cores < ceiling)
