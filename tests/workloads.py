"""Real processes for guard tests: duty-cycled burners that use a set share of one core."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

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


def start_duty_cycle(share: float, *groups: Path) -> subprocess.Popen[bytes]:
    proc = subprocess.Popen([sys.executable, "-c", DUTY_CYCLE, str(share)])
    for group in groups:
        (group / "cgroup.procs").write_text(str(proc.pid))
    return proc
