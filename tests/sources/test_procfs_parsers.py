"""Parsers of /proc/stat, /proc/loadavg and /proc/meminfo."""

from __future__ import annotations

import pytest

from nodeguard.errors import ParseError
from nodeguard.sources.procfs import parse_loadavg, parse_meminfo, parse_proc_stat_cpu
from nodeguard.sources.readers import count_cpus

PROC_STAT = """cpu  100 5 50 1000 20 1 2 3 40 4
cpu0 50 2 25 500 10 0 1 1 20 2
cpu1 50 3 25 500 10 1 1 2 20 2
intr 12345 1 2 3
ctxt 999
"""


def test_proc_stat_total_excludes_guest_time() -> None:
    """The total is user..steal (guest is already in user); idle includes iowait."""
    cpu = parse_proc_stat_cpu(PROC_STAT)
    assert cpu.total == 100 + 5 + 50 + 1000 + 20 + 1 + 2 + 3
    assert cpu.idle == 1020
    assert cpu.busy == cpu.total - 1020


def test_proc_stat_old_kernel_with_nine_and_four_fields() -> None:
    """Old kernels write fewer cpu fields; they still parse."""
    assert parse_proc_stat_cpu("cpu  1 2 3 4 5 6 7 8 9\n").total == 36
    four = parse_proc_stat_cpu("cpu 1 2 3 4\n")
    assert (four.total, four.idle) == (10, 4)


@pytest.mark.parametrize("text", ["", "cpu0 1 2 3 4\n", "cpu  1 2\n", "cpu  a b c d\n"])
def test_proc_stat_garbage(text: str) -> None:
    """No aggregate line, too few fields or non-numbers raise ParseError."""
    with pytest.raises(ParseError):
        parse_proc_stat_cpu(text)


def test_count_cpus_from_proc_stat() -> None:
    """Per-CPU lines are counted, the aggregate line is not."""
    assert count_cpus(PROC_STAT) == 2
    assert count_cpus("cpu  1 2 3 4\n") == 1


def test_loadavg() -> None:
    """All three averages and the runnable/threads pair are read."""
    load = parse_loadavg("0.52 1.20 3.00 2/345 6789\n")
    assert (load.load1, load.load5, load.load15, load.runnable, load.threads) == (0.52, 1.2, 3.0, 2, 345)
    for bad in ("", "1 2", "a b c 1/2 3", "1 2 3 x 4"):
        with pytest.raises(ParseError):
            parse_loadavg(bad)


def test_meminfo_splits_on_any_whitespace() -> None:
    """A tab after a key (seen in one kernel release) parses like spaces; units are kB."""
    info = parse_meminfo("MemTotal:\t2048 kB\nMemFree:        512 kB\nMemAvailable:   1024 kB\nHugePages_Total: 0\n")
    assert (info.total, info.available) == (2048 * 1024, 1024 * 1024)


def test_meminfo_without_memavailable_estimates_it() -> None:
    """Kernels before 3.14 have no MemAvailable: free + buffers + cached is used."""
    info = parse_meminfo("MemTotal: 100 kB\nMemFree: 10 kB\nBuffers: 5 kB\nCached: 20 kB\n")
    assert info.available == 35 * 1024


def test_meminfo_garbage() -> None:
    """meminfo without MemTotal raises ParseError; junk lines are skipped."""
    with pytest.raises(ParseError):
        parse_meminfo("junk\nMemFree: x kB\n")
