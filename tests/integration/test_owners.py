"""nodeguard beside the node's other owners: with every lever held, no write of kubelet, the runtime or systemd fails.

Each scenario of the owner double (tests/support/owners.py) runs on a fresh kubelet-shaped node of the real kernel
(this host's cgroup v1; cgroup v2 in the VM, ``kernel``-marked) with nodeguard's holds in place, written as its
executor writes them, then a few of its drift steps (tests/support/owner_scenarios.py).
"""

from __future__ import annotations

import pytest

from nodeguard.actuators.levers.cpu_quota import QuotaLever, ordered_writes
from nodeguard.actuators.levers.cpu_weight import WeightLever
from nodeguard.actuators.restore import Outcome, restore_all
from nodeguard.model.samples import CpuMax
from nodeguard.sources.cgroupfs import parse_cpu_max
from tests.support import cgroups as rc
from tests.support.owner_scenarios import SCENARIOS, Node, run

VERSIONS = ["v1", pytest.param("v2", marks=pytest.mark.kernel)]


def skip_without(version: str) -> None:
    why = rc.why_no_v1_cpu() if version == "v1" else rc.why_no_v2()
    if why:
        pytest.skip(why)


@pytest.mark.parametrize("version", VERSIONS)
@pytest.mark.parametrize("scenario", sorted(SCENARIOS))
def test_no_owner_write_fails_and_every_hold_comes_back(version: str, scenario: str) -> None:
    """Zero refused owner writes, no owner error, no failed re-assertion, and nodeguard's holds back within a
    tick (or released, where the owner's new value holds the group back as much)."""
    skip_without(version)
    result = run(version, scenario)  # type: ignore[arg-type]
    assert result.refused == 0 and not result.refusals, result.refusals
    assert not result.failures, result.failures
    assert not result.nodeguard_failures, result.nodeguard_failures
    assert result.holds_back_at is not None and result.holds_back_at <= 1, result


@pytest.mark.parametrize("version", VERSIONS)
@pytest.mark.parametrize("direction", ["resize_up", "resize_down"])
def test_a_resize_is_the_new_original_and_a_stop_gives_it_back(version: str, direction: str) -> None:
    """After an in-place resize of a held pod, the ledger holds the pod's new limit as its original within a tick,
    the hold is back under it, and a restore gives back the new limits, not the old."""
    skip_without(version)
    seen: dict[str, object] = {}

    def check(node: Node) -> None:
        pod = node.owners.pod_path(node.pods["batch"])
        record = node.ledger.get("cpu.max", pod)
        assert record is not None
        seen["original"] = parse_cpu_max(record.original).cores
        seen["outcomes"] = restore_all(node.ledger, node.levers)
        seen["after"] = parse_cpu_max(node.levers["cpu.max"].read(pod)).cores

    result = run(version, direction, after=check)  # type: ignore[arg-type]
    new = 2.0 if direction == "resize_up" else 1.0
    assert result.refused == 0 and result.holds_back_at == 1
    assert seen["original"] == pytest.approx(new), "the resized limit is the original"
    assert seen["after"] == pytest.approx(new), "a restore gives back the new limit"
    outcomes = seen["outcomes"]
    assert isinstance(outcomes, dict) and Outcome.FAILED not in outcomes


def test_holding_a_v1_pod_below_its_containers_limit_fails_the_runtime(monkeypatch: pytest.MonkeyPatch) -> None:
    """The check above can fail: with the pod's own quota held below its container's limit (the old lever), the
    runtime's write of the container's limit at a restart is refused with EINVAL."""
    skip_without("v1")

    def below(self: QuotaLever, workload_id: str, current: CpuMax, target: CpuMax, *rest: object) -> object:
        limited = rest[-1]
        assert isinstance(limited, dict)
        return ordered_writes(workload_id, current, target, limited)

    monkeypatch.setattr(QuotaLever, "_through_children", below)
    result = run("v1", "container_restart")
    assert result.refused == 1 and "EINVAL" in result.refusals[0], result.refusals


@pytest.mark.kernel
def test_an_idle_qos_tier_fails_kubelet_at_start(monkeypatch: pytest.MonkeyPatch) -> None:
    """The check above can fail on v2: with the tiers made idle (the old lever), kubelet's start writes the
    BestEffort tier's weight and is refused with EINVAL, which is fatal to kubelet."""
    skip_without("v2")
    monkeypatch.setattr(WeightLever, "strongest", lambda self, group: str(self.least_for(group)))
    result = run("v2", "kubelet_start")
    assert result.refused >= 1 and any("EINVAL" in r for r in result.refusals), result.refusals
    assert any(failure.startswith("fatal:") for failure in result.failures), result.failures


@pytest.mark.parametrize(("scenario", "lever"), [("kubelet_start", "cpu.weight"), ("resize_up", "cpu.max")])
def test_an_owners_overwrite_is_counted_by_lever(scenario: str, lever: str) -> None:
    """kubelet's rewrite of a held tier's weight, and an in-place resize of a held pod, count as overwrites of that
    lever (nodeguard_lever_overwritten_total{lever}): a user sees kubelet and nodeguard disagree."""
    skip_without("v1")
    counted: dict[str, int] = {}

    def check(node: Node) -> None:
        counted.update(node.levers[lever].writer.counters.overwritten)

    run("v1", scenario, after=check)
    assert counted.get(lever, 0) >= 1, counted
