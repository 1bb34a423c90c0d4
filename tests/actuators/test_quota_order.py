"""The order of limit writes over a workload and its children: one that cgroup v1 accepts, lowering or raising."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from nodeguard.actuators.levers.cpu_quota import LimitWrite, capped, ordered_writes, rate_above
from nodeguard.model.samples import CpuMax

POD = "kubepods/burstable/pod1"
C1 = f"{POD}/c1"
C1_INNER = f"{POD}/c1/container"
C2 = f"{POD}/c2"


def test_lowering_caps_children_deepest_first_then_the_pod() -> None:
    """kubelet's shape (pod 1.5, containers 1.5 and 0.5): the child above the target and its own child go first."""
    children = {C1: (CpuMax(150000), CpuMax(150000)), C1_INNER: (CpuMax(120000), CpuMax(120000)),
                C2: (CpuMax(50000), CpuMax(50000))}  # fmt: skip
    writes = ordered_writes(POD, CpuMax(150000), CpuMax(60000), children)
    assert writes == [
        LimitWrite(C1_INNER, CpuMax(120000), CpuMax(60000)),
        LimitWrite(C1, CpuMax(150000), CpuMax(60000)),
        LimitWrite(POD, CpuMax(150000), CpuMax(60000)),
    ]


def test_raising_writes_the_pod_first_and_gives_children_their_originals_back() -> None:
    """Restoring: the pod goes up first, then each child back to its own original, shallowest first."""
    children = {C1: (CpuMax(60000), CpuMax(150000)), C1_INNER: (CpuMax(60000), CpuMax(120000))}
    writes = ordered_writes(POD, CpuMax(60000), CpuMax(150000), children)
    assert writes == [
        LimitWrite(POD, CpuMax(60000), CpuMax(150000)),
        LimitWrite(C1, CpuMax(60000), CpuMax(150000)),
        LimitWrite(C1_INNER, CpuMax(60000), CpuMax(120000)),
    ]


def test_a_child_in_another_period_is_capped_at_the_same_rate_rounded_down() -> None:
    """A child with a 50 ms period under a pod at 0.333 cores gets 16666 µs of 50000: never above the pod."""
    assert capped(CpuMax(100000, 50000), CpuMax(33333, 100000)) == CpuMax(16666, 50000)
    assert capped(CpuMax(None), CpuMax(33333)) == CpuMax(None), "unlimited inherits the parent's limit on v1"
    assert capped(CpuMax(20000, 100000), CpuMax(1000, 100000)) == CpuMax(1000, 100000)
    assert capped(CpuMax(20000, 50000), CpuMax(1000, 100000)) == CpuMax(1000, 100000), "not under 1 ms"
    assert capped(CpuMax(20000), CpuMax(33333)) == CpuMax(20000)
    assert capped(CpuMax(20000), CpuMax(None)) == CpuMax(20000)


limits = st.builds(CpuMax, st.one_of(st.none(), st.integers(1000, 400_000)), st.sampled_from([50_000, 100_000]))


@given(
    current=limits,
    target=limits,
    originals=st.lists(limits, min_size=1, max_size=4),
    depths=st.lists(st.integers(1, 3), min_size=4, max_size=4),
)
def test_every_step_keeps_each_child_at_or_under_its_parent(
    current: CpuMax, target: CpuMax, originals: list[CpuMax], depths: list[int]
) -> None:
    """Replaying the writes on a tree that starts valid, no step ever leaves a child above its parent (v1's rule)."""
    # A chain or fan of children, each starting at its original capped under its parent's current limit.
    paths: list[str] = []
    for index, depth in enumerate(depths[: len(originals)]):
        parent = next((p for p in reversed(paths) if p.count("/") == POD.count("/") + depth - 1), POD)
        paths.append(f"{parent}/c{index}")
    limit: dict[str, CpuMax] = {POD: current}
    children: dict[str, tuple[CpuMax, CpuMax]] = {}
    for path, original in zip(paths, originals, strict=False):
        now = capped(original, limit[path.rsplit("/", 1)[0]])
        limit[path] = now
        children[path] = (now, original)

    def valid() -> bool:
        # An unlimited child is fine anywhere: v1 lets it inherit its parent's limit.
        return not any(
            value.quota_us is not None and rate_above(value, limit[path.rsplit("/", 1)[0]])
            for path, value in limit.items()
            if path != POD
        )

    assert valid()
    for write in ordered_writes(POD, current, target, children):
        assert limit[write.path] == write.before
        limit[write.path] = write.after
        assert valid(), f"after {write}: {limit}"
    assert limit[POD] == target
    for path, (_, original) in children.items():
        assert not rate_above(limit[path], original), "a child never goes above its own original"
