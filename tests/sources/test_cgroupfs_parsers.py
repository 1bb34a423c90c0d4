"""Parsers of cgroup v2 and v1 files on kernel-format text, including odd values."""

from __future__ import annotations

import pytest

from nodeguard.errors import ParseError
from nodeguard.model.samples import CpuMax
from nodeguard.sources.cgroupfs import (
    parse_cfs_quota,
    parse_cgroup_events,
    parse_cpu_max,
    parse_cpu_stat,
    parse_cpu_stat_v1,
    parse_cpu_weight,
    parse_flat_keyed,
    parse_int_or_max,
    parse_memory_limit_v1,
    parse_pids,
    parse_psi,
    parse_psi_totals,
)

CPU_STAT_6_1 = """usage_usec 1042
user_usec 600
system_usec 442
core_sched.force_idle_usec 0
nr_periods 10
nr_throttled 3
throttled_usec 2500
nr_bursts 0
burst_usec 0
"""
CPU_STAT_NEWER = """usage_usec 77
user_usec 70
system_usec 7
nice_usec 5
core_sched.force_idle_usec 0
nr_periods 4
nr_throttled 1
throttled_usec 9
nr_bursts 0
burst_usec 0
some_future_key 12
"""


def test_cpu_stat_reads_keys_wherever_they_stand() -> None:
    """cpu.stat is read by key, so keys inserted before the throttling keys change nothing."""
    stat = parse_cpu_stat(CPU_STAT_6_1)
    assert (stat.usage_usec, stat.nr_periods, stat.nr_throttled, stat.throttled_usec) == (1042, 10, 3, 2500)
    newer = parse_cpu_stat(CPU_STAT_NEWER)
    assert (newer.usage_usec, newer.user_usec, newer.nr_throttled, newer.throttled_usec) == (77, 70, 1, 9)


def test_cpu_stat_without_cpu_controller_has_zero_throttling() -> None:
    """A cgroup without the cpu controller shows only base keys; throttling counters read as zero."""
    stat = parse_cpu_stat("usage_usec 5\nuser_usec 3\nsystem_usec 2\nnice_usec 0\n")
    assert stat.usage_usec == 5
    assert (stat.nr_periods, stat.nr_throttled, stat.throttled_usec) == (0, 0, 0)


@pytest.mark.parametrize(
    "text",
    ["", "user_usec 3\n", "usage_usec\n", "usage_usec abc\n", "usage_usec 1 user_usec", "\x00\x01"],
)
def test_cpu_stat_garbage_is_a_parse_error(text: str) -> None:
    """Missing usage_usec, odd field counts and non-numbers raise ParseError, not something else."""
    with pytest.raises(ParseError):
        parse_cpu_stat(text)


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("max 100000\n", CpuMax(None, 100000)),
        ("20000 100000\n", CpuMax(20000, 100000)),
        ("150000 100000", CpuMax(150000, 100000)),
        ("max", CpuMax(None, 100000)),
        ("  50000   50000  \n\n", CpuMax(50000, 50000)),
    ],
)
def test_cpu_max_forms(text: str, expected: CpuMax) -> None:
    """cpu.max parses quota and period, "max" as unlimited, and tolerates whitespace."""
    assert parse_cpu_max(text) == expected


@pytest.mark.parametrize("text", ["", "max max", "-1 100000", "0 100000", "1 2 3", "abc 100000", "100 0"])
def test_cpu_max_garbage(text: str) -> None:
    """Malformed or non-positive cpu.max values raise ParseError."""
    with pytest.raises(ParseError):
        parse_cpu_max(text)


def test_cpu_max_renders_back() -> None:
    """A CpuMax renders in the kernel's own cpu.max format and reports cores."""
    assert CpuMax(None, 100000).render_v2() == "max 100000"
    assert CpuMax(25000, 100000).render_v2() == "25000 100000"
    assert CpuMax(25000, 100000).cores == 0.25
    assert CpuMax(None).cores is None


PSI_FULL = "some avg10=1.50 avg60=0.25 avg300=0.00 total=123456\nfull avg10=0.75 avg60=0.10 avg300=0.00 total=6543\n"


def test_psi_some_and_full() -> None:
    """PSI averages are floats in percent and totals integer microseconds."""
    psi = parse_psi(PSI_FULL)
    assert psi.some is not None and psi.full is not None
    assert (psi.some.avg10, psi.some.avg60, psi.some.total_usec) == (1.5, 0.25, 123456)
    assert (psi.full.avg10, psi.full.total_usec) == (0.75, 6543)


def test_psi_without_full_line_and_irq_without_some() -> None:
    """cpu.pressure before 5.13 has no full line; /proc/pressure/irq has only full."""
    old = parse_psi("some avg10=0.00 avg60=0.00 avg300=0.00 total=0\n")
    assert old.full is None and old.some is not None
    irq = parse_psi("full avg10=0.10 avg60=0.00 avg300=0.00 total=17\n")
    assert irq.some is None and irq.full is not None and irq.full.total_usec == 17


def test_psi_tolerates_extra_fields_and_unknown_lines() -> None:
    """Unknown keys in a PSI line and unknown line kinds are ignored."""
    psi = parse_psi("some avg10=1.00 avg60=2.00 avg300=3.00 total=4 avg1=9.99\nwhatever x=1\n\n")
    assert psi.some is not None and (psi.some.avg300, psi.some.total_usec) == (3.0, 4)


@pytest.mark.parametrize(
    "text", ["", "some avg10=x avg60=0 avg300=0 total=0", "some avg10=1 avg60=1", "some garbage", "noise\n"]
)
def test_psi_garbage(text: str) -> None:
    """PSI text without usable lines raises ParseError."""
    with pytest.raises(ParseError):
        parse_psi(text)


def test_memory_values_and_limits() -> None:
    """memory.max may be the word max; other single values are integers."""
    assert parse_int_or_max("max\n", "memory.max") is None
    assert parse_int_or_max("1073741824\n", "memory.max") == 1 << 30
    with pytest.raises(ParseError):
        parse_int_or_max("lots", "memory.max")


def test_memory_events_known_and_new_keys() -> None:
    """memory.events keeps every key, including ones newer kernels add."""
    events = parse_flat_keyed("low 0\nhigh 2\nmax 3\noom 1\noom_kill 1\noom_group_kill 0\nsock_throttled 4\n")
    assert events["oom_kill"] == 1 and events["sock_throttled"] == 4


def test_cgroup_procs_and_events() -> None:
    """cgroup.procs is a list of pids; cgroup.events may lack frozen on old kernels."""
    assert parse_pids("12\n345\n") == (12, 345)
    assert parse_pids("") == ()
    with pytest.raises(ParseError):
        parse_pids("12\nx\n")
    events = parse_cgroup_events("populated 1\nfrozen 0\n")
    assert events.populated is True and events.frozen is False
    assert parse_cgroup_events("populated 0\n").frozen is None


def test_cpu_weight_bounds() -> None:
    """cpu.weight must be 1..10000."""
    assert parse_cpu_weight("100\n") == 100
    for bad in ("0", "10001", "max", "x"):
        with pytest.raises(ParseError):
            parse_cpu_weight(bad)


def test_v1_quota_minus_one_is_unlimited() -> None:
    """cfs_quota_us -1 means no limit; other values pair with the period."""
    assert parse_cfs_quota("-1\n", "100000\n") == CpuMax(None, 100000)
    assert parse_cfs_quota("50000\n", "100000\n") == CpuMax(50000, 100000)
    for quota, period in (("0", "100000"), ("-2", "100000"), ("x", "1"), ("1000", "0")):
        with pytest.raises(ParseError):
            parse_cfs_quota(quota, period)


def test_v1_cpu_stat_converts_nanoseconds() -> None:
    """v1 throttled_time and cpuacct.usage are nanoseconds; the sample is in microseconds."""
    stat = parse_cpu_stat_v1("nr_periods 7\nnr_throttled 2\nthrottled_time 5000000\n", "3000000000\n")
    assert (stat.usage_usec, stat.nr_periods, stat.nr_throttled, stat.throttled_usec) == (3_000_000, 7, 2, 5000)
    burst = parse_cpu_stat_v1("nr_periods 1\nnr_throttled 0\nthrottled_time 0\nnr_bursts 0\nburst_time 0\n", "0")
    assert burst.usage_usec == 0
    with pytest.raises(ParseError):
        parse_cpu_stat_v1("", "n/a")


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("9223372036854771712\n", None),  # 4 KiB pages
        ("9223372036854710272\n", None),  # 64 KiB pages
        ("536870912\n", 536870912),
    ],
)
def test_v1_memory_limit_close_to_2_63_is_unlimited(text: str, expected: int | None) -> None:
    """Any v1 memory limit close to 2**63 means unlimited, whatever the page size."""
    assert parse_memory_limit_v1(text) == expected


def test_psi_totals_read_by_key() -> None:
    """The per-tick PSI reading takes each line's total by key, tolerating extra fields."""
    assert parse_psi_totals(PSI_FULL) == (123456, 6543)
    assert parse_psi_totals("some avg10=0.00 avg60=0.00 avg300=0.00 total=5 extra=1\n") == (5, None)
    assert parse_psi_totals("full avg10=0.00 total=9\n") == (None, 9)
    for bad in ("", "some avg10=0.00\n", "some total=x\n"):
        with pytest.raises(ParseError):
            parse_psi_totals(bad)
