"""A workload whose write the kernel refused is held back: the next candidates close the gap, in the same tick."""

from __future__ import annotations

from nodeguard.policy.planner import plan
from nodeguard.policy.state import GuardState, HeldBack, held_back_after
from nodeguard.policy.trace import plan_to_data
from tests.policy.builders import cpu_throttle, guard, snapshot, throttles, usage

TEN = [usage(f"w{i}", cores=1.0, priority=-i) for i in range(10)]


def hold(wid: str, until: float, failures: int = 1) -> HeldBack:
    return HeldBack(wid, "EINVAL", "cpu.cfs_quota_us", "Invalid argument", 0.0, until, failures)


def throttled(state: GuardState, now: float = 100.0) -> list[str]:
    result = plan(snapshot(TEN, cores_used=7.5, monotonic=now), state, guard(cpu_throttle(6.0, 5.0)))
    return [a.workload_id for a in throttles(result)]


def test_held_back_workloads_are_skipped_and_the_next_ones_close_the_gap() -> None:
    """With the two least important held back, the gap of 1.5 cores is closed by the next two."""
    assert throttled(GuardState()) == ["w9", "w8"]
    state = GuardState(held_back={"w9": hold("w9", until=130.0), "w8": hold("w8", until=130.0)})
    assert throttled(state) == ["w7", "w6"]


def test_a_hold_ends_with_its_backoff() -> None:
    """Once its back-off has passed the workload is a candidate again (and its record stays, for the next doubling)."""
    state = GuardState(held_back={"w9": hold("w9", until=99.0)})
    assert throttled(state) == ["w9", "w8"]
    result = plan(snapshot(TEN, cores_used=7.5), state, guard(cpu_throttle(6.0, 5.0)))
    assert "w9" in result.state.held_back and result.held_back == ()


def test_every_candidate_held_back_is_said_in_the_plan() -> None:
    """When no candidate is left the plan blocks the metric as exhausted, naming the held-back workloads."""
    state = GuardState(held_back={u.workload.id: hold(u.workload.id, until=200.0) for u in TEN})
    result = plan(snapshot(TEN, cores_used=7.5), state, guard(cpu_throttle(6.0, 5.0)))
    assert not result.actions
    [blocked] = result.blocked
    assert blocked.cause == "exhausted" and "10 held back after refused writes" in blocked.detail
    assert "(EINVAL)" in blocked.detail
    trace = plan_to_data(result)
    assert [h["workload"] for h in trace["held_back"]] == sorted(u.workload.id for u in TEN)
    assert trace["held_back"][0]["file"] == "cpu.cfs_quota_us"


def test_a_departed_workload_leaves_its_hold_behind() -> None:
    """A hold of a workload that left the node is dropped from the state."""
    state = GuardState(held_back={"gone": hold("gone", until=200.0)})
    assert "gone" not in plan(snapshot(TEN, cores_used=1.0), state, guard(cpu_throttle())).state.held_back


def test_backoff_doubles_per_refusal_in_a_row_up_to_its_cap() -> None:
    """30 s, 60 s, 120 s … never more than the cap; the first refusal's time is kept."""
    first = held_back_after(None, "w", error="EINVAL", file="f", detail="d", now=10.0, first=30, longest=100)
    assert (first.until, first.failures, first.since) == (40.0, 1, 10.0)
    second = held_back_after(first, "w", error="EINVAL", file="f", detail="d", now=50.0, first=30, longest=100)
    assert (second.until, second.failures, second.since) == (110.0, 2, 10.0)
    third = held_back_after(second, "w", error="EBUSY", file="f", detail="d", now=120.0, first=30, longest=100)
    assert (third.until, third.error) == (220.0, "EBUSY")
