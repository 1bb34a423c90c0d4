"""Ratios of counter deltas; a counter that went back means a reset, which gives no value."""

from __future__ import annotations


def fraction(part_delta: int, whole_delta: int) -> float | None:
    if whole_delta <= 0 or part_delta < 0:
        return None
    return min(1.0, part_delta / whole_delta)
