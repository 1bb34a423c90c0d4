"""The probe of tests/support/workloads.py, which e2e tests and bench/protect.py read a service level from."""

from __future__ import annotations

import itertools
from pathlib import Path

import pytest

from tests.support.poll import wait_until
from tests.support.workloads import CPU_UNITS, probe_iterations, probe_lateness, start_probe


@pytest.mark.parametrize("iterations", [0, CPU_UNITS], ids=["calibrated", "cpu_time"])
def test_probe_reports_one_lateness_per_released_unit(tmp_path: Path, iterations: int) -> None:
    """A real probe (calibrated work, or 4 ms of CPU) reports per 10 ms release a lateness of at least its work."""
    out = tmp_path / "probe.txt"
    probe = start_probe(out, iterations)
    try:
        wait_until(lambda: len(probe_lateness(out.read_text() if out.exists() else "")) >= 20, 20, "20 units",
                   interval=0.1, give_up=lambda: probe.poll() is not None,
                   detail=lambda: out.read_text()[:300] if out.exists() else "")  # fmt: skip
    finally:
        probe.terminate()
        probe.wait(5)
    text = out.read_text()
    calibrated = probe_iterations(text)
    assert (calibrated is not None and calibrated > 0) if iterations == 0 else calibrated is None
    lateness = probe_lateness(text)
    assert min(lateness) >= 1.0, "every unit is late by at least its work (4 ms alone; 1 ms leaves room for turbo)"
    releases = [
        int(line.split()[0]) for line in text.splitlines() if not line.startswith("#") and len(line.split()) == 2
    ]
    steps = {b - a for a, b in itertools.pairwise(releases)}
    assert steps <= {9_999, 10_000, 10_001}, f"releases are 10 ms apart (±1 µs rounding), none skipped: {steps}"


def test_probe_lateness_slices_by_release_and_skips_torn_lines() -> None:
    """Units are kept by release time in [since, until); comments and a torn last line are skipped."""
    text = "# iterations 5\n1000 4000\n11000 6500\n21000 12000\n31000 9"
    assert probe_lateness(text) == [4.0, 6.5, 12.0]
    assert probe_lateness(text, since_us=11000, until_us=21000) == [6.5]
    assert probe_iterations(text) == 5
    assert probe_iterations("1000 4000\n") is None
