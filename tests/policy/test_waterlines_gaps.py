"""Waterlines from objectives, and gaps per direction."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from nodeguard.policy.gaps import compute_gaps
from nodeguard.policy.metrics import CAPABILITIES, Metric
from nodeguard.policy.waterlines import resolve_waterlines, waterlines_for
from tests.policy.builders import GiB, cpu_throttle, guard, node

CPU = Metric.CPU_TOTAL_USAGE
MEM = Metric.MEMORY_TOTAL_USAGE


def test_lowest_threshold_wins() -> None:
    """Two throttle objectives on one metric give one waterline at the lower threshold, restoring below both."""
    settings = guard(
        cpu_throttle(7.0, 6.5, name="loose", triggerAfter=5, restoreAfter=2),
        cpu_throttle(6.0, 5.5, name="tight", triggerAfter=3, restoreAfter=4),
        cpu_throttle(6.8, 3.0, name="deep", restoreAfter=1),
    )
    lines = resolve_waterlines(settings.objectives, node())
    assert list(lines) == [(CPU, "throttle")]
    line = lines[CPU, "throttle"]
    assert (line.threshold, line.objective, line.trigger_after) == (6.0, "tight", 3)
    assert line.restore_below == 3.0
    assert line.restore_after == 4


def test_waterlines_are_resolved_again_on_a_reload_or_a_resized_node_and_kept_otherwise() -> None:
    """A calm tick reuses the last waterlines; new objectives (a reload) or a node whose capacity changed (a
    percentage threshold on more memory) get their own."""
    memory = {"metric": "memory_total_usage", "threshold": "50%", "action": "evict"}
    settings = guard(cpu_throttle(6.0, 5.0), memory)
    first = waterlines_for(settings.objectives, node(memory_total=16 * GiB))
    assert waterlines_for(settings.objectives, node(memory_total=16 * GiB)) is first
    resized = waterlines_for(settings.objectives, node(memory_total=32 * GiB))
    assert resized[MEM, "evict"].threshold == 16 * GiB and first[MEM, "evict"].threshold == 8 * GiB
    reloaded = waterlines_for(guard(cpu_throttle(4.0, 3.0), memory).objectives, node(memory_total=32 * GiB))
    assert reloaded[CPU, "throttle"].threshold == 4.0
    assert dict(reloaded) == resolve_waterlines(
        guard(cpu_throttle(4.0, 3.0), memory).objectives, node(memory_total=32 * GiB)
    )


def test_throttle_and_evict_lines_are_separate() -> None:
    """The same metric with two actions gives two waterlines."""
    settings = guard(cpu_throttle(6.0, 5.0), {"metric": "cpu_total_usage", "threshold": 7.5, "action": "evict"})
    lines = resolve_waterlines(settings.objectives, node())
    assert lines[CPU, "throttle"].threshold == 6.0
    assert lines[CPU, "evict"].threshold == 7.5


@pytest.mark.parametrize(
    ("objective", "expected"),
    [
        pytest.param(cpu_throttle("75%", "50%"), 6.0, id="cores: percent of node cores"),
        pytest.param({"metric": "memory_total_usage", "threshold": "50%", "action": "evict"}, 8 * GiB, id="bytes"),
        pytest.param({"metric": "memory_total_usage", "threshold": "2Gi", "action": "evict"}, 2 * GiB, id="absolute"),
        pytest.param({"metric": "cpu_pressure", "threshold": 40, "action": "evict"}, 40.0, id="percent metric"),
        pytest.param({"metric": "load_average", "threshold": "150%", "action": "evict"}, 1.5, id="load per core"),
    ],
)
def test_thresholds_resolve_against_capacity(objective: dict[str, object], expected: float) -> None:
    """A percentage threshold is a percentage of the metric's capacity on this node."""
    settings = guard(objective)
    (line,) = resolve_waterlines(settings.objectives, node(cpus=8, memory_total=16 * GiB)).values()
    assert line.threshold == pytest.approx(expected)


def test_gap_directions_are_separate_maps() -> None:
    """Down, up and evict gaps land in their own maps only."""
    settings = guard(
        cpu_throttle(6.0, 5.0),
        {"metric": "memory_total_usage", "threshold": "8Gi", "action": "evict"},
        {"metric": "load_average", "threshold": 3, "restoreBelow": 2, "action": "throttle"},
    )
    n = node(cores_used=7.0, memory_used=10 * GiB, load1=8.0)  # 1 per core
    gaps = compute_gaps(
        {m: c.read(n) for m, c in CAPABILITIES.items()}, resolve_waterlines(settings.objectives, n), True
    )
    assert gaps.throttle_down == {CPU: pytest.approx(1.0)}
    assert gaps.evict == {MEM: pytest.approx(2 * GiB)}
    assert gaps.throttle_up == {Metric.LOAD_AVERAGE: pytest.approx(1.0)}


def test_no_up_gap_when_nothing_is_throttled() -> None:
    """Below the restore waterline there is an up gap only while the guard holds a throttle."""
    settings = guard(cpu_throttle(6.0, 5.0))
    n = node(cores_used=1.0)
    readings = {m: c.read(n) for m, c in CAPABILITIES.items()}
    lines = resolve_waterlines(settings.objectives, n)
    assert compute_gaps(readings, lines, False).throttle_up == {}
    assert compute_gaps(readings, lines, True).throttle_up == {CPU: pytest.approx(4.0)}


def test_missing_sample_has_no_gap() -> None:
    """A metric without a sample appears in no gap map."""
    settings = guard(cpu_throttle(6.0, 5.0))
    n = node(cores_used=None)
    gaps = compute_gaps(
        {m: c.read(n) for m, c in CAPABILITIES.items()}, resolve_waterlines(settings.objectives, n), True
    )
    assert (gaps.throttle_down, gaps.throttle_up, gaps.evict) == ({}, {}, {})


@given(st.floats(0, 64), st.floats(0, 64), st.floats(0.1, 60))
def test_larger_usage_never_gives_smaller_gap(low: float, high: float, threshold: float) -> None:
    """Raising usage never shrinks the down or evict gap, and never grows the up gap."""
    low, high = min(low, high), max(low, high)
    settings = guard(
        cpu_throttle(threshold, threshold / 2), {"metric": "cpu_total_usage", "threshold": threshold, "action": "evict"}
    )
    lines = resolve_waterlines(settings.objectives, node(cpus=64))

    def gaps(value: float) -> tuple[float, float, float]:
        g = compute_gaps({CPU: value}, lines, True)
        return g.throttle_down.get(CPU, 0.0), g.throttle_up.get(CPU, 0.0), g.evict.get(CPU, 0.0)

    (down_lo, up_lo, evict_lo), (down_hi, up_hi, evict_hi) = gaps(low), gaps(high)
    assert down_hi >= down_lo
    assert evict_hi >= evict_lo
    assert up_hi <= up_lo
