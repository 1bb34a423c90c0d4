"""The guard's tick schedule: a fixed grid, each tick a random share of a period late, never carried over."""

from __future__ import annotations

import itertools
import random

from nodeguard.tick_schedule import TICK_JITTER, next_tick


def test_ticks_keep_to_the_grid_whatever_each_one_drew() -> None:
    """The k-th grid point is k periods from the start and each tick is due within its jitter after it."""
    draws = itertools.cycle([0.0, 0.99, 0.5, 1.0, 0.25])
    grid, period = 100.0, 1.0
    for k in range(1, 1001):
        now = grid + 0.05  # each tick took 50 ms
        grid, due = next_tick(grid, now, period, lambda: next(draws))
        assert abs(grid - (100.0 + k * period)) < 1e-6
        assert grid <= due <= grid + TICK_JITTER * period


def test_an_overrun_skips_the_missed_ticks() -> None:
    """A tick that overran by several periods starts the grid again a period from now, not in a burst."""
    grid, due = next_tick(10.0, 13.5, 1.0, lambda: 0.0)
    assert (grid, due) == (14.5, 14.5)


def test_ticks_do_not_lock_onto_a_periodic_workload_s_phase() -> None:
    """At a 1 s tick, the ticks fall across every millisecond of a 10 ms workload cycle, not on one phase of it."""
    rng = random.Random(21)
    grid, phases = 0.0, set()
    for _ in range(200):
        grid, due = next_tick(grid, grid + 0.003, 1.0, rng.random)
        phases.add(int(due * 1000) % 10)
    assert phases == set(range(10))
