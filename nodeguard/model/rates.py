"""Rates from monotonic counter deltas; a counter that went back means a reset."""

from __future__ import annotations


def per_second(previous: int, current: int, seconds: float) -> float | None:
    if seconds <= 0 or current < previous:
        return None
    return (current - previous) / seconds


def fraction(part_delta: int, whole_delta: int) -> float | None:
    if whole_delta <= 0 or part_delta < 0:
        return None
    return min(1.0, part_delta / whole_delta)
