"""Comparators and their composition: who is acted on first."""

from __future__ import annotations

import math
import random

import pytest
from hypothesis import given
from hypothesis import strategies as st

from nodeguard.model.snapshot import WorkloadUsage
from nodeguard.model.workloads import QosClass
from nodeguard.policy.metrics import CAPABILITIES
from nodeguard.policy.ranking import (
    COMPARATORS,
    CPU_USAGE_SORTER,
    GENERAL_SORTER,
    Ordering,
    class_and_priority,
    cpu_usage,
    ext_cpu_usage,
    memory_usage,
    ordered_by,
    ordering,
    running_time,
)
from tests.policy.builders import usage


def ids(usages: list[WorkloadUsage]) -> list[str]:
    return [u.workload.id for u in usages]


@pytest.mark.parametrize(
    ("sorter", "workloads", "expected"),
    [
        pytest.param(
            ordered_by(class_and_priority),
            [
                usage("g", qos=QosClass.GUARANTEED),
                usage("bu", qos=QosClass.BURSTABLE),
                usage("be", qos=QosClass.BEST_EFFORT),
            ],
            ["be", "bu", "g"],
            id="BestEffort before Burstable before Guaranteed",
        ),
        pytest.param(
            ordered_by(class_and_priority),
            [usage("high", priority=100), usage("low", priority=-5), usage("mid", priority=0)],
            ["low", "mid", "high"],
            id="lower priority first",
        ),
        pytest.param(
            ordered_by(class_and_priority),
            [usage("be-high", priority=1000), usage("bu-low", qos=QosClass.BURSTABLE, priority=-1000)],
            ["be-high", "bu-low"],
            id="class before priority",
        ),
        pytest.param(
            ordered_by(cpu_usage),
            [usage("a", cores=0.5), usage("b", cores=3.0), usage("c", cores=1.0)],
            ["b", "c", "a"],
            id="higher CPU usage first",
        ),
        pytest.param(
            ordered_by(ext_cpu_usage),
            [usage("within", cores=2.0, request=2.0), usage("beyond", cores=1.5, request=0.5)],
            ["beyond", "within"],
            id="more CPU beyond the request first",
        ),
        pytest.param(
            ordered_by(ext_cpu_usage),
            [usage("requested", cores=1.0, request=0.8), usage("no-request", cores=0.5)],
            ["no-request", "requested"],
            id="a missing request counts as zero",
        ),
        pytest.param(
            ordered_by(memory_usage),
            [usage("small", memory=1), usage("big", memory=10)],
            ["big", "small"],
            id="more memory first",
        ),
        pytest.param(
            ordered_by(running_time),
            [usage("old", started_at=100.0), usage("new", started_at=900.0), usage("unknown", started_at=None)],
            ["new", "old", "unknown"],
            id="most recently started first, unknown last",
        ),
        pytest.param(
            ordered_by(class_and_priority),
            [usage("b"), usage("c"), usage("a")],
            ["a", "b", "c"],
            id="ties broken by workload id",
        ),
        pytest.param(
            GENERAL_SORTER,
            [usage("old", started_at=1.0), usage("new", started_at=2.0), usage("g", qos=QosClass.GUARANTEED)],
            ["new", "old", "g"],
            id="GeneralSorter: class and priority, then running time",
        ),
        pytest.param(
            CPU_USAGE_SORTER,
            [
                usage("busy-bu", qos=QosClass.BURSTABLE, cores=6.0),
                usage("idle-be", cores=0.1),
                usage("busy-be", cores=2.0),
            ],
            ["busy-be", "idle-be", "busy-bu"],
            id="CpuUsageSorter: class first, then CPU",
        ),
    ],
)
def test_orders(sorter: Ordering, workloads: list[WorkloadUsage], expected: list[str]) -> None:
    """Each comparator puts the least important workload first."""
    assert ids(sorter.sort(workloads)) == expected


def test_ordering_by_names_matches_composition() -> None:
    """An ordering named in the config sorts like the composed comparators."""
    workloads = [usage(f"w{i}", cores=i % 3, priority=i % 2, started_at=float(i)) for i in range(9)]
    assert ids(ordering(CPU_USAGE_SORTER.names).sort(workloads)) == ids(CPU_USAGE_SORTER.sort(workloads))


def test_unknown_comparator_name() -> None:
    """An unknown comparator name is refused and named."""
    with pytest.raises(ValueError, match="'fastest'"):
        ordering(["class_and_priority", "fastest"])


def test_capabilities_name_known_comparators() -> None:
    """Every metric's default order uses registered comparators only."""
    for cap in CAPABILITIES.values():
        assert set(cap.sort_by) <= COMPARATORS.keys(), cap.metric


def test_sort_keys_end_with_the_id() -> None:
    """key() gives each comparator's part, the id last."""
    assert CPU_USAGE_SORTER.key(usage("a", cores=2.0, started_at=5.0)) == ((-2, 0), -2.0, -2.0, -5.0, "a")


workload_lists = st.lists(
    st.builds(
        lambda n, qos, prio, cores, req, start: usage(
            f"w{n}", qos=qos, priority=prio, cores=cores, request=req, started_at=start
        ),
        st.integers(0, 10_000),
        st.sampled_from(list(QosClass)),
        st.integers(-3, 3),
        st.one_of(st.none(), st.floats(0, 16)),
        st.one_of(st.none(), st.floats(0, 4)),
        st.one_of(st.none(), st.floats(1, 1e9)),
    ),
    max_size=40,
    unique_by=lambda u: u.workload.id,
)


@given(workload_lists, st.randoms(use_true_random=False), st.sampled_from(list(COMPARATORS)))
def test_sort_is_a_permutation_independent_of_input_order(
    workloads: list[WorkloadUsage], rnd: random.Random, extra: str
) -> None:
    """Sorting returns the same workloads, in the order of their keys whatever order they came in."""
    sorter = ordered_by(COMPARATORS[extra], *CPU_USAGE_SORTER.comparators)
    shuffled = list(workloads)
    rnd.shuffle(shuffled)
    first, second = sorter.sort(workloads), sorter.sort(shuffled)
    assert sorted(ids(first)) == sorted(ids(workloads))
    assert ids(first) == ids(second) == ids(sorted(workloads, key=sorter.key))


@given(workload_lists)
def test_class_never_inverted(workloads: list[WorkloadUsage]) -> None:
    """With class_and_priority first, no more important class precedes a less important one."""
    ranks = {QosClass.BEST_EFFORT: 0, QosClass.BURSTABLE: 1, QosClass.GUARANTEED: 2}
    order = [ranks[u.workload.qos_class] for u in CPU_USAGE_SORTER.sort(workloads)]
    assert order == sorted(order)


@given(st.one_of(st.none(), st.floats(0, 16)), st.one_of(st.none(), st.floats(0, 4)))
def test_ext_cpu_usage_is_the_usage_past_the_request_negated(cores: float | None, request: float | None) -> None:
    """ext_cpu_usage is -max(0, cores - request) with None as 0, down to the sign of a zero the trace prints."""
    expected = -max(0.0, (cores or 0.0) - (request or 0.0))
    found = ext_cpu_usage(usage("w", cores=cores, request=request))
    assert (found, math.copysign(1.0, found)) == (expected, math.copysign(1.0, expected))
