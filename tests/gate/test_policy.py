"""The admission policy as a pure function: counts, the maxRate bucket, load signals and minRate."""

from __future__ import annotations

from nodeguard.gate.policy import Limits, Rates, Signals, SignalWindow, admitted, decide

HOT = Signals(load1=10.0, cpu_percent=95.0, samples=3)
CALM = Signals(load1=0.5, cpu_percent=10.0, samples=3)


def test_counts_hold_even_when_min_rate_is_due() -> None:
    """maxStarting holds the next load even though minRate is overdue: minRate overrides load signals only."""
    limits = Limits(cores=4, max_starting=2, min_rate=10.0, max_load_multiplier=1.0)
    rates = Rates(tokens=1, refilled_at=0, last_admit=0)
    decision = decide(2, HOT, limits, rates, now=100.0)
    assert not decision.admit and decision.reason == "maxStarting: 2 of 2 starting"
    assert decision.retry_at is None  # only a freed slot lifts it


def test_per_core_limit_rounds_down_but_allows_one() -> None:
    """maxStartingPerCore x cores rounds down, and a small node still gets one slot."""
    assert Limits(cores=2, max_starting_per_core=0.25).slots == 1
    assert Limits(cores=8, max_starting_per_core=0.5, max_starting=3).slots == 3
    decision = decide(1, CALM, Limits(cores=2, max_starting_per_core=0.25), Rates(1, 0, 0), now=1.0)
    assert not decision.admit and decision.reason.startswith("maxStartingPerCore: 1 of 1")


def test_max_rate_bucket_allows_a_burst_then_holds_until_a_token_refills() -> None:
    """maxRate 2/s with a burst of 2: two admissions back to back, then a hold that lifts in half a second."""
    limits = Limits(cores=4, max_rate=2.0, burst=2)
    rates = Rates.initial(limits, now=0.0)
    for _ in range(2):
        assert decide(0, CALM, limits, rates, now=0.0).admit
        rates = admitted(rates, limits, now=0.0)
    held = decide(0, CALM, limits, rates, now=0.0)
    assert not held.admit and held.reason == "maxRate: 2/s" and held.retry_at == 0.5
    assert decide(0, CALM, limits, rates, now=0.5).admit


def test_signals_hold_and_min_rate_admits_once_its_interval_has_passed() -> None:
    """Load over the limit holds until 1/minRate after the last admission, then admits one and says why."""
    limits = Limits(cores=2, max_load_multiplier=1.5, min_rate=0.5)
    rates = Rates(tokens=1, refilled_at=0, last_admit=10.0)
    held = decide(0, HOT, limits, rates, now=11.0)
    assert not held.admit and held.reason == "maxLoadAverageMultiplier: load1 10.00 > 3" and held.retry_at == 12.0
    forced = decide(0, HOT, limits, rates, now=12.0)
    assert forced.admit and forced.reason.startswith("minRate 0.5/s despite maxLoadAverageMultiplier")
    assert decide(0, CALM, limits, rates, now=11.0).admit


def test_a_signal_without_a_sample_holds_without_min_rate() -> None:
    """maxCPU with no CPU sample yet holds (the worst is assumed); with minRate 0 nothing but new signals lifts it."""
    limits = Limits(cores=2, max_cpu=80.0, min_rate=0.0)
    decision = decide(0, Signals(load1=0.1), limits, Rates(1, 0, 0), now=50.0)
    assert not decision.admit and decision.reason == "maxCPU: no CPU sample yet" and decision.retry_at is None


def test_signal_window_averages_recent_samples_and_keeps_the_newest() -> None:
    """The window averages the samples of its last seconds, ignores missing CPU values, and keeps the newest sample when all are old."""
    window = SignalWindow(seconds=10)
    window.add(0.0, 4.0, None)
    window.add(5.0, 2.0, 50.0)
    window.add(9.0, 3.0, 70.0)
    assert window.signals(9.0) == Signals(load1=3.0, cpu_percent=60.0, samples=3)
    assert window.signals(14.0) == Signals(load1=2.5, cpu_percent=60.0, samples=2)
    assert window.signals(100.0) == Signals(load1=3.0, cpu_percent=70.0, samples=1)
