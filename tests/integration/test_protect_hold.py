"""Weights come back on the competitors' demand, not on a timer: the real daemon, a hold far shorter than the
contention, and a protected pod whose service level is measured the whole time.

test_protect_e2e's kubelet-shaped node (six Burstable burners at equal weights,
a Guaranteed pod), the protected pod running the probe of tests/support/workloads.py (a
4 ms unit of CPU every 10 ms; its lateness is its service level) under a 1-core
limit, so that its tail is what the burners and the daemon do to it, not its own
quota. cgroup v1 on this host (the VM's emulation is too slow for a test this long within the suite's budget).
"""

from __future__ import annotations

import signal
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from nodeguard.actuators.ledger import Ledger
from nodeguard.model.samples import CpuMax
from tests.kernel.vm import IN_VM
from tests.support import cgroups as rc
from tests.support.daemon import DaemonProcess
from tests.support.node import SLOW, ShapedNode, protect_config, protected_node
from tests.support.poll import wait_until
from tests.support.workloads import CPU_UNITS, p99, p99_windows, probe_lateness, start_probe

HOLD = 3.0  # weightHoldSeconds: a fifth of a measured window
WINDOW = 15.0  # seconds of each window whose p99 is judged
CONTENTION = 20.0  # seconds measured under contention, after the weight came down: two 15 s windows, 5 s apart
ALONE = 8.0  # 800 units: the p99 is the 8th latest
WARM_UP = 100  # units a fresh probe reports before its measured window starts (a second)
PROTECTED_LIMIT = CpuMax(100000)  # 1 core at the pod and its container: the probe's 0.4 core never hits it
# What the test tells apart: the lever held (0.8-1.7x alone on this host, CI's noisiest window 1.71x) from the
# probe re-exposed by a restore (12x over 15 s when measured, issue 21). bench/protect.py measures the tail itself.
HOST_BOUND = 3.0
# The emulated VM: static levers measured 1.6-4.5x alone there (docs/performance.md, bench/protect.py --levers).
VM_BOUND = 5.0


def wait_units(out: Path, units: int) -> None:
    """Until the probe writing ``out`` has reported ``units`` units: what it does first is not measured."""
    wait_until(lambda: len(probe_lateness(out.read_text() if out.exists() else "")) >= units, 30 * SLOW,
               f"the probe's first {units} units")  # fmt: skip


@pytest.fixture
def node() -> Iterator[ShapedNode]:
    # Host v1 only: under the VM's emulation this minute-long test alone would take most of the kernel suite's
    # time budget. On v2 (the VM) test_protect_e2e keeps the burners three holds past the harm's close and checks
    # the weight stays down; the probe's tail there is the emulation's (static levers 1.6-4.5x alone).
    with protected_node(rc.v1_cpu_hierarchy(), PROTECTED_LIMIT) as shaped:
        yield shaped


def test_weights_stay_down_under_lasting_contention_and_come_back_when_it_ends(
    node: ShapedNode, tmp_path: Path
) -> None:
    """With a 3 s hold and burners that never stop, the tier's weight stays down (no restore while they run) and
    the protected probe's p99 in every 15 s window stays within 3x its p99 alone, far from the 10-1000x of a
    re-exposed probe (in the emulated VM, within VM_BOUND); once the burners stop, the weight is back within the
    hold and the ledger is empty."""
    alone_out, out = tmp_path / "alone.txt", tmp_path / "probe.txt"
    probe = start_probe(alone_out, CPU_UNITS, *node.hierarchy.dirs(node.important.inner))
    daemon = DaemonProcess(protect_config(node, tmp_path / "run/ledger.json", weightHoldSeconds=HOLD), tmp_path)
    try:
        wait_units(alone_out, WARM_UP)
        since = time.monotonic()
        time.sleep(ALONE)  # kept: the scenario's measured window alone
        alone = p99(probe_lateness(alone_out.read_text(), round(since * 1e6), round(time.monotonic() * 1e6)))
        assert alone is not None, "the probe reported no unit"

        node.start_burners()
        tier = f"{node.parent}/kubepods/burstable"
        daemon.start()
        daemon.wait_for(lambda: node.hierarchy.weight(tier) != node.weights[tier], 30 * SLOW, "the weight lowered")
        time.sleep(HOLD)  # past the hold: a timer alone would put the weight back from here on
        # A fresh probe: the one that ran through the harm before the weight came down would still be catching up.
        rc.stop(probe)
        probe = start_probe(out, CPU_UNITS, *node.hierarchy.dirs(node.important.inner))
        wait_units(out, WARM_UP)
        since = time.monotonic()
        lowered_throughout = True
        while time.monotonic() - since < CONTENTION:
            lowered_throughout &= node.hierarchy.weight(tier) != node.weights[tier]
            time.sleep(0.5)  # kept: samples of the scenario's measured window under contention
        until = time.monotonic()
        restored = [e for e in daemon.events() if e.get("event") == "reweigh" and e.get("restored")]
        assert not restored, f"weights put back while the burners ran: {restored}"
        assert lowered_throughout
        found = p99_windows(out.read_text(), round(since * 1e6), round(until * 1e6), WINDOW, 5.0)
        ratios = [round(w / alone, 2) for w in found]
        assert len(ratios) >= 2
        bound = VM_BOUND if IN_VM else HOST_BOUND
        assert max(ratios) <= bound, f"p99 per 15 s window over {alone:.2f} ms alone: {ratios}"

        node.stop_burners()
        stopped = time.monotonic()
        daemon.wait_for(lambda: node.hierarchy.weight(tier) == node.weights[tier], (HOLD + 10) * SLOW,
                        "the weight back once the burners stopped")  # fmt: skip
        assert time.monotonic() - stopped <= (HOLD + 10) * SLOW
        daemon.wait_for(lambda: not node.changed(), 10 * SLOW, "every weight and limit back")
        daemon.wait_for(lambda: not Ledger.load(str(tmp_path / "run/ledger.json")), 5 * SLOW, "the ledger emptied")
        daemon.signal(signal.SIGTERM)
        assert daemon.wait(timeout=10 * SLOW) == 0
    finally:
        daemon.kill()
        rc.stop(probe)
