"""Real processes for guard tests: duty-cycled burners that use a set share of one core."""

from __future__ import annotations

import math
import subprocess
import sys
from pathlib import Path

from tests.support.cgroups import start_in

# Spins for `share` of every 100 ms window and sleeps the rest, by wall time, so
# it uses about `share` of a core on any machine speed until a quota holds it back.
DUTY_CYCLE = """
import sys, time
share = float(sys.argv[1])
period = 0.1
while True:
    start = time.monotonic()
    while time.monotonic() - start < share * period:
        pass
    rest = period - (time.monotonic() - start)
    if rest > 0:
        time.sleep(rest)
"""


def start_duty_cycle(share: float, *groups: Path, announce: bool = False) -> subprocess.Popen[bytes]:
    """``share`` of a core, in every given group; ``announce``: see cgroups.ANNOUNCE."""
    return start_in(groups, DUTY_CYCLE, str(share), announce=announce)


# The probe: a fixed unit of CPU work released every PROBE_PERIOD_S (at t0 + k * period; a late
# unit starts at once, no release is skipped), writing one line per unit: its release and its
# lateness (finish - release, its response time), both in µs of CLOCK_MONOTONIC (shared with the
# reader, which slices a measured window by release time). argv: output file, loop iterations of
# one unit; 0 calibrates first (the median of 100 tries of a 4 ms unit) and writes a
# "# iterations N" line the caller can reuse so every run does the same work; -1 (CPU_UNITS) makes
# each unit spin until the process has used 4 ms of CPU: on a VM whose vCPU speed swings with its
# host's load (here 2x within minutes), a fixed count of iterations is not a fixed CPU demand, and
# a demand over the pod's limit makes the probe throttle itself.
PROBE_UNIT_S = 0.004
PROBE_PERIOD_S = 0.010
CPU_UNITS = -1
PROBE = """
import signal, sys, time
out = open(sys.argv[1], "a", buffering=1)
iterations = int(sys.argv[2])
unit, period = float(sys.argv[3]), float(sys.argv[4])
signal.signal(signal.SIGTERM, lambda *_: (out.flush(), sys.exit(0)))
def work(n):
    x = 0
    for i in range(n):
        x += i
    return x
if iterations < 0:
    def work(_):
        end = time.thread_time() + unit
        while time.thread_time() < end:
            for i in range(200):
                pass
elif iterations == 0:
    def timed(n):
        start = time.perf_counter()
        work(n)
        return time.perf_counter() - start
    n = 20000
    while timed(n) < unit / 4:
        n *= 2
    best = sorted(timed(n) for _ in range(100))[50]
    iterations = max(1, round(n * unit / best))
    out.write(f"# iterations {iterations}\\n")
t0 = time.monotonic()
k = 0
while True:
    release = t0 + k * period
    now = time.monotonic()
    if now < release:
        time.sleep(release - now)
    work(iterations)
    finish = time.monotonic()
    out.write(f"{round(release * 1e6)} {round((finish - release) * 1e6)}\\n")
    k += 1
"""


def start_probe(out: Path, iterations: int, *groups: Path) -> subprocess.Popen[bytes]:
    """The probe in the given groups, placed before it calibrates or works: it waits for its stdin to close."""
    args = [str(out), str(iterations), str(PROBE_UNIT_S), str(PROBE_PERIOD_S)]
    proc = subprocess.Popen(
        [sys.executable, "-c", "import sys; sys.stdin.read()\n" + PROBE, *args], stdin=subprocess.PIPE
    )
    for group in groups:
        (group / "cgroup.procs").write_text(str(proc.pid))
    assert proc.stdin is not None
    proc.stdin.close()  # placed: it may start
    return proc


def probe_iterations(text: str) -> int | None:
    """The calibrated work of one unit, from a probe's output."""
    for line in text.splitlines():
        if line.startswith("# iterations "):
            return int(line.split()[2])
    return None


def probe_lateness(text: str, since_us: int = 0, until_us: int | None = None) -> list[float]:
    """Lateness in ms of the units released in [since_us, until_us) (monotonic µs); a torn last line is skipped."""
    found = []
    for line in text.split("\n")[:-1]:  # the last piece is empty or a line still being written
        fields = line.split()
        if len(fields) != 2 or line.startswith("#") or not all(f.lstrip("-").isdigit() for f in fields):
            continue
        release, lateness = int(fields[0]), int(fields[1])
        if release >= since_us and (until_us is None or release < until_us):
            found.append(lateness / 1000)
    return found


def p99(values: list[float]) -> float | None:
    """Nearest-rank 99th percentile; None for no values."""
    if not values:
        return None
    ordered = sorted(values)
    return ordered[max(0, math.ceil(0.99 * len(ordered)) - 1)]


def p99_windows(text: str, since_us: int, until_us: int, span: float, step: float) -> list[float]:
    """The p99 lateness (ms) of every ``span``-second stretch of a probe's output in [since_us, until_us), ``step``
    seconds apart (stretches without a unit left out)."""
    found, start = [], since_us
    while start + span * 1e6 <= until_us + 1:
        worst = p99(probe_lateness(text, start, round(start + span * 1e6)))
        if worst is not None:
            found.append(worst)
        start += round(step * 1e6)
    return found
