"""The tick schedule: a grid of tickSeconds, each wake a random fraction of a period after its point."""

from __future__ import annotations

import random

import pytest

from nodeguard.tick_schedule import JITTER, next_wake


def wakes(period: float, ticks: int, draw: random.Random | None, took: float = 0.003) -> list[float]:
    """The wake times of ``ticks`` ticks that each take ``took`` s (``draw`` None: never jittered)."""
    grid = now = 1000.0
    found = []
    for _ in range(ticks):
        now += took
        grid, wake = next_wake(grid, period, now, draw.random() if draw else 0.0)
        found.append(wake)
        now = wake
    return found


def test_each_wake_is_within_the_jitter_after_its_grid_point_and_the_mean_period_is_exact() -> None:
    """Every wake lies in [grid point, grid point + 10 % of a period); over many ticks the mean period is tickSeconds."""
    period = 0.5
    found = wakes(period, 2000, random.Random(7))
    for k, wake in enumerate(found, start=1):
        point = 1000.0 + k * period
        assert point <= wake < point + JITTER * period
    assert (found[-1] - found[0]) / (len(found) - 1) == pytest.approx(period, rel=1e-3)


def test_ticks_do_not_stay_at_one_phase_of_a_periodic_workload() -> None:
    """A 0.5 s tick lands at every phase of a 10 ms loop, where a plain grid lands at one phase every time."""

    def phases(found: list[float]) -> set[int]:
        return {int((wake % 0.010) * 1000) for wake in found}  # which millisecond of the loop's 10

    assert len(phases(wakes(0.5, 200, random.Random(1)))) == 10
    assert len(phases(wakes(0.5, 200, None))) == 1


def test_a_tick_that_overran_skips_the_missed_ticks_instead_of_bunching_them() -> None:
    """After a tick that took 3.2 periods, the next wake is a period (plus jitter) after it, not at once."""
    grid, wake = next_wake(100.0, 1.0, now=103.2, draw=0.5)
    assert grid == pytest.approx(104.2)
    assert wake == pytest.approx(104.2 + 0.5 * JITTER)
