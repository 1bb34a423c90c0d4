"""Throttling a pod whose containers carry their own limits, as kubelet writes them, on real kernels.

cgroup v1 (this host) refuses a parent quota below a child's: nodeguard caps the
children first and raises them after the pod. cgroup v2 (the VM) takes the
tightest limit on the path: the pod's limit alone holds.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from nodeguard.actuators.cgroup_writer import CgroupWriter
from nodeguard.actuators.ledger import HeldValue, Ledger
from nodeguard.actuators.levers.base import WriteRefused
from nodeguard.actuators.levers.cpu_quota import QuotaLever
from nodeguard.actuators.restore import Outcome, restore_all
from nodeguard.model.samples import CpuMax
from nodeguard.sources.cgroupfs import parse_cpu_max, parse_cpu_stat_v1
from tests.actuators.records import quota_record
from tests.support import cgroups as rc

KUBELET_LIMIT = CpuMax(150000, 100000)  # 1.5 cores at the pod and the container
THROTTLE = CpuMax(30000, 100000)


@pytest.fixture(params=["v1", pytest.param("v2", marks=pytest.mark.kernel)])
def hierarchy(request: pytest.FixtureRequest) -> rc.Hierarchy:
    return rc.v1_cpu_hierarchy() if request.param == "v1" else rc.v2_cpu_hierarchy()


@pytest.fixture
def pod(hierarchy: rc.Hierarchy) -> Iterator[rc.KubeletPod]:
    with rc.kubelet_pod(hierarchy, rc.unique_name(), "burstable", KUBELET_LIMIT) as shaped:
        yield shaped


def cores(hierarchy: rc.Hierarchy, rel: str, seconds: float) -> float:
    def usage_usec() -> int:
        if hierarchy.version == "v2":
            for line in (hierarchy.writable / rel / "cpu.stat").read_text().splitlines():
                if line.startswith("usage_usec "):
                    return int(line.split()[1])
            raise AssertionError("no usage_usec")
        return parse_cpu_stat_v1("", (hierarchy.roots[-1] / rel / "cpuacct.usage").read_text()).usage_usec

    before, t0 = usage_usec(), time.monotonic()
    time.sleep(seconds)
    return (usage_usec() - before) / 1e6 / (time.monotonic() - t0)


def test_pod_with_container_limits_is_throttled_and_restored_exactly(
    hierarchy: rc.Hierarchy, pod: rc.KubeletPod, tmp_path: Path
) -> None:
    """The hold is accepted and enforced; restore puts the pod's and its containers' limits back. On v1, with the
    container's own limit above the hold, the pod is held through its containers (the pod's limit stays, so the
    runtime's write of the container's limit at a restart still succeeds); v2 lowers the pod alone."""
    quota = QuotaLever(CgroupWriter(str(hierarchy.writable)), hierarchy.version)
    busy = pod.start_busy()
    try:
        current, writes = quota.plan(pod.pod, THROTTLE.render_v2(), {})
        children = {w.path: HeldValue(original=w.before, applied=w.after)
                    for w in writes if w.path != pod.pod}  # fmt: skip
        quota.perform(writes)
        if hierarchy.version == "v1":
            assert {w.path for w in writes} == {pod.container, pod.sandbox}, "the containers share the hold"
            assert hierarchy.limit(pod.pod) == KUBELET_LIMIT
            assert hierarchy.limit(pod.sandbox) == CpuMax(1000), "the pause container at the kernel's least"
            assert hierarchy.limit(pod.container) == CpuMax(29000), "the rest to the container, up to the hold"
            assert hierarchy.held_rate(pod.pod) == pytest.approx(0.3)
        else:
            assert [w.path for w in writes] == [pod.pod], "v2 takes the tightest limit: children stay"
            assert hierarchy.limit(pod.pod) == THROTTLE
            assert hierarchy.limit(pod.container) == KUBELET_LIMIT
        assert 0.2 < cores(hierarchy, pod.pod, 1.0) < 0.4, "the kernel enforces the hold"

        ledger = Ledger(str(tmp_path / "ledger.json"))
        ledger.record(
            quota_record(pod.pod, hierarchy.version, parse_cpu_max(current), THROTTLE, "test", children=children)
        )
        assert restore_all(ledger, {"cpu.max": quota}) == {Outcome.RESTORED: [pod.pod]}
        assert hierarchy.limit(pod.pod) == KUBELET_LIMIT
        assert hierarchy.limit(pod.container) == KUBELET_LIMIT
        assert hierarchy.limit(pod.inner) == CpuMax(None), "a child without a limit is never touched"
        assert hierarchy.limit(pod.sandbox) == CpuMax(None)
    finally:
        rc.stop(busy)


@pytest.fixture
def v1_pod() -> Iterator[rc.KubeletPod]:
    """Only cgroup v1 makes nodeguard change a child's limit (v2 never needs to)."""
    with rc.kubelet_pod(rc.v1_cpu_hierarchy(), rc.unique_name(), "burstable", KUBELET_LIMIT) as shaped:
        yield shaped


def test_a_child_resized_behind_nodeguard_keeps_its_new_limit_on_restore(v1_pod: rc.KubeletPod, tmp_path: Path) -> None:
    """A container limit changed by someone else since nodeguard capped it is theirs: restore leaves it, and puts
    back the other container's."""
    pod, hierarchy = v1_pod, v1_pod.hierarchy
    quota = QuotaLever(CgroupWriter(str(hierarchy.writable)), hierarchy.version)
    current, writes = quota.plan(pod.pod, THROTTLE.render_v2(), {})
    quota.perform(writes)
    ledger = Ledger(str(tmp_path / "ledger.json"))
    children = {w.path: HeldValue(original=w.before, applied=w.after) for w in writes}
    ledger.record(quota_record(pod.pod, "v1", parse_cpu_max(current), KUBELET_LIMIT, "test", children=children))
    resized = CpuMax(20000, 100000)
    hierarchy.set_limit(pod.container, resized)  # under the pod's limit: v1 accepts it
    assert restore_all(ledger, {"cpu.max": quota}) == {Outcome.RESTORED: [pod.pod]}
    assert hierarchy.limit(pod.pod) == KUBELET_LIMIT
    assert hierarchy.limit(pod.container) == resized
    assert hierarchy.limit(pod.sandbox) == CpuMax(None)


def test_a_refused_write_leaves_nothing_half_done(v1_pod: rc.KubeletPod) -> None:
    """v1 refuses the pod's quota under a limited descendant nodeguard does not look at (deeper than it walks):
    the refusal names errno and file, and the children already capped are put back."""
    shaped, hierarchy = v1_pod, v1_pod.hierarchy
    deep = f"{shaped.inner}/a/b"
    with hierarchy.groups(deep):
        hierarchy.set_limit(f"{shaped.inner}/a", KUBELET_LIMIT)
        hierarchy.set_limit(deep, KUBELET_LIMIT)  # depth 4 below the pod: past DESCENDANT_DEPTH
        quota = QuotaLever(CgroupWriter(str(hierarchy.writable)), "v1")
        _, writes = quota.plan(shaped.pod, THROTTLE.render_v2(), {})
        assert writes[0].path == f"{shaped.inner}/a", "the deepest first"
        assert {w.path for w in writes[1:]} == {shaped.container, shaped.sandbox}
        with pytest.raises(WriteRefused) as refused:
            quota.perform(writes)
        assert (refused.value.error, refused.value.file) == ("EINVAL", "cpu.cfs_quota_us")
        assert refused.value.path == f"{shaped.inner}/a"
        assert hierarchy.limit(shaped.pod) == KUBELET_LIMIT
        assert hierarchy.limit(shaped.container) == KUBELET_LIMIT
        assert hierarchy.limit(shaped.sandbox) == CpuMax(None)
