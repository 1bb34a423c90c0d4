"""Gaps: how far each metric is past its waterline, one map per direction.

The three directions are separate fields and never share a map: crane merged
them into one and its precise throttling silently stopped firing. A metric is
in a map only when its gap is positive and its sample is present.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from nodeguard.policy.metrics import Metric
from nodeguard.policy.waterlines import ActionKind, Waterline


@dataclass(frozen=True, slots=True)
class Gaps:
    throttle_down: Mapping[Metric, float]  # usage - lowest throttle waterline
    throttle_up: Mapping[Metric, float]  # restore waterline - usage, while something is throttled
    evict: Mapping[Metric, float]  # usage - lowest evict waterline


def compute_gaps(
    readings: Mapping[Metric, float | None],
    lines: Mapping[tuple[Metric, ActionKind], Waterline],
    throttled: bool,
) -> Gaps:
    """Gaps in each metric's own unit; ``throttled``: does the guard hold any throttle now."""
    down: dict[Metric, float] = {}
    up: dict[Metric, float] = {}
    evict: dict[Metric, float] = {}
    for (metric, action), line in lines.items():
        value = readings.get(metric)
        if value is None:
            continue
        if value > line.threshold:
            (down if action == "throttle" else evict)[metric] = value - line.threshold
        elif throttled and line.restore_below is not None and value < line.restore_below:
            up[metric] = line.restore_below - value
    return Gaps(down, up, evict)
