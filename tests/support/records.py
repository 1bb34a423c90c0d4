"""What real loads record about themselves, one ``EVENT NAME MONOTONIC`` line each (slow_server.py here,
tests/coordination/notify_load.py), and how many of them overlapped."""

from __future__ import annotations

from pathlib import Path


def read_records(log: Path) -> dict[str, dict[str, float]]:
    """name -> event -> its CLOCK_MONOTONIC time; empty while nothing has written the log yet."""
    found: dict[str, dict[str, float]] = {}
    if log.exists():
        for line in log.read_text().splitlines():
            event, name, at = line.split()
            found.setdefault(name, {})[event] = float(at)
    return found


def max_overlap(intervals: list[tuple[float, float]]) -> int:
    """The most intervals open at one instant."""
    events = sorted([(start, 1) for start, _ in intervals] + [(end, -1) for _, end in intervals])
    # At equal times an end sorts before a start (-1 < 1): touching intervals do not overlap.
    current = peak = 0
    for _, delta in events:
        current += delta
        peak = max(peak, current)
    return peak
