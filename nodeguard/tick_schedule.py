"""When the next tick runs: on a grid of ``tickSeconds``, each tick a random fraction of a period after its point.

The guard's own work (a few ms of CPU a tick) lands beside the node's
workloads. On a plain grid a 0.5 s tick falls at the same phase of a 10 ms
control loop every time, so when that phase is the loop's busy part the same
unit is delayed every tick: up to 2 % of its units, past its p99
(bench/protect.py's probe showed it as a daemon_tail_ratio over 1.2 in about
one run in four). A random offset spreads the ticks over every phase, as
kubelet jitters its housekeeping; the grid keeps the mean period exact.
"""

from __future__ import annotations

JITTER = 0.1  # each wake is up to this fraction of a period after its grid point


def next_wake(grid: float, period: float, now: float, draw: float) -> tuple[float, float]:
    """(the next grid point, when to wake for it): ``draw`` in [0, 1) places the wake within the jitter.

    Ticks missed while one overran are skipped, not bunched: the grid restarts a period after ``now``.
    """
    grid += period
    if grid < now:
        grid = now + period
    return grid, grid + draw * JITTER * period
