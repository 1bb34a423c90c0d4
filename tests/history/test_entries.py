"""A group's change on a node of many pods stays one line that fits a file, the pods it named listed first."""

from __future__ import annotations

from nodeguard.history.entries import TickContext
from nodeguard.history.recorder import encode
from nodeguard.history.settings import MIN_FILE_BYTES
from nodeguard.model.workloads import QosClass
from nodeguard.policy.planner import plan
from nodeguard.policy.settings import Candidates
from nodeguard.policy.state import GuardState
from tests.policy.builders import guard, snapshot, usage

TIER = "kubepods.slice/kubepods-burstable.slice"


def test_a_tier_of_a_thousand_pods_is_cut_to_fit_and_says_how_many_more() -> None:
    """1,000 pods under the tier (ids as the systemd driver writes them): the entry lists the named candidates first,
    as many pods as fit, counts the rest, and encodes to less than the least file of the history."""
    pods = [usage(f"{TIER}/kubepods-burstable-pod{i:08x}_0d4b_4c1e_9f60_2b7d5c8e1a42.slice", qos=QosClass.BURSTABLE)
            for i in range(1000)]  # fmt: skip
    found = snapshot(pods)
    tick = TickContext(plan(found, GuardState(), guard()), found, Candidates())
    named = [pods[999].workload.id, pods[500].workload.id]
    members = tick.members(TIER, named)
    assert members["workloads"] == named
    assert [w["id"] for w in members["under"][:2]] == named, "the named candidates' names first"
    assert members["under_more"] == 1000 - len(members["under"]) > 0
    size = len(encode({"v": 1, "at": 1.0, "kind": "reweigh", "group": TIER, **members}))
    assert 16 << 10 < size < MIN_FILE_BYTES
