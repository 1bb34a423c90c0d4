"""When the guard's next tick is due: on a fixed grid of periods, each tick a random share of a period late."""

from __future__ import annotations

import random
from collections.abc import Callable

# Ticks at an exact multiple of a periodic workload's period (1 s against 10 ms) land on the same phase of it every
# time, so whatever a tick costs that workload falls on the same part of its work every tick. A random delay of up to
# this share of a period, never carried to the next tick, spreads the ticks over its phases instead. (On the test
# host the protected probe's late units turned out not to sit at the ticks: docs/performance.md.)
TICK_JITTER = 0.1


def next_tick(grid: float, now: float, period: float, draw: Callable[[], float] = random.random) -> tuple[float, float]:
    """The next grid point after ``grid`` (or a period from ``now`` after an overrun) and when its tick is due."""
    grid += period
    if grid < now:  # overran: skip the missed ticks rather than bunch them
        grid = now + period
    return grid, grid + draw() * TICK_JITTER * period
