"""Waiting longer after each failure in a row: the one back-off of nodeguard.

Used by the gate's supervisor, the Kubernetes metadata refresh, refused
evictions (a PodDisruptionBudget's 429), workloads held back after a refused
quota write, and the MQTT reconnects. Jitter spreads a fleet of nodes that
failed together, so they do not retry in step.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable


def doubling(first: float, longest: float, failures: int) -> float:
    """The wait after ``failures`` failures in a row (at least one): ``first``, twice that, … at most ``longest``."""
    return min(longest, first * 2.0 ** min(max(failures, 1) - 1, 60))


class Backoff:
    """Exponential back-off on the monotonic clock, with optional jitter (a fraction of each wait)."""

    def __init__(
        self,
        first: float = 1.0,
        longest: float = 300.0,
        *,
        jitter: float = 0.0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.first = first
        self.longest = longest
        self.jitter = jitter
        self.clock = clock
        self.failures = 0
        self.until = float("-inf")

    def failed(self) -> float:
        """Record a failure; returns the wait until the next attempt."""
        self.failures += 1
        delay = doubling(self.first, self.longest, self.failures)
        if self.jitter:
            delay *= 1.0 + random.uniform(-self.jitter, self.jitter)
        self.until = self.clock() + delay
        return delay

    def succeeded(self) -> None:
        self.failures = 0
        self.until = float("-inf")

    def remaining(self) -> float:
        return max(0.0, self.until - self.clock())
