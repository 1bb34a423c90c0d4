"""Every lever is crash-safe: a daemon SIGKILLed while it holds weights (and quotas) leaves a ledger that the
next daemon, or ``restore --all``, puts back exactly.

The node is test_protect_e2e's kubelet-shaped node (six Burstable burners, a
Guaranteed pod harmed by them); the crash is a real SIGKILL of ``nodeguard
run``; the kernel is this host's cgroup v1 and, marked ``kernel``, cgroup v2 in
the QEMU VM.
"""

from __future__ import annotations

import signal
from collections.abc import Iterator
from pathlib import Path

import pytest

from nodeguard.actuators.ledger import Ledger
from tests.integration.crashes import crash_holding, held
from tests.support import cgroups as rc
from tests.support.daemon import DaemonProcess
from tests.support.node import SLEEPER_SHARE, SLOW, ShapedNode, protect_config, protected_node

REPO = Path(__file__).parents[2]
HOLD = 3.0  # weightHoldSeconds of the daemons after the crash


@pytest.fixture
def node() -> Iterator[ShapedNode]:
    """Host v1 (the weights-only crashes; the VM runs the both-levers crash, within the kernel suite's budget)."""
    with protected_node(rc.v1_cpu_hierarchy()) as shaped:
        yield shaped


@pytest.fixture
def any_node(hierarchy: rc.Hierarchy) -> Iterator[ShapedNode]:
    """v1 on the host and, marked ``kernel``, v2 in the VM."""
    with protected_node(hierarchy) as shaped:
        yield shaped


def restart(node: ShapedNode, ledger: Path, tmp_path: Path, on_start: str) -> DaemonProcess:
    """The next daemon on the crashed one's ledger (a short weight hold), in its own directory.

    It puts a limit back in one step, not 50 % at a time: what these tests check is that everything comes back,
    not the pace (tests/policy/test_planner.py's), which took six pods 15 s of the VM's time.
    """
    (tmp_path / "second").mkdir()
    config = protect_config(node, ledger, weightHoldSeconds=HOLD, restoreStepPercent=100)
    config["global"]["actuation"]["onStart"] = on_start
    return DaemonProcess(config, tmp_path / "second").start()


def test_lowered_weights_are_back_at_once_with_on_start_restore(node: ShapedNode, tmp_path: Path) -> None:
    """A ledger holding only the tier's lowered weight, left by a SIGKILLed daemon, is put back by the next daemon
    before its first tick (onStart: restore), and the ledger empties."""
    node.start(burners=6, important_share=SLEEPER_SHARE)
    ledger = crash_holding(node, tmp_path, quotas=False)
    assert held(ledger) == {"cpu.max": set(), "cpu.weight": {f"{node.parent}/kubepods/burstable"}}
    assert node.changed(), "the crash left the weight down"
    node.stop_burners()

    daemon = restart(node, ledger, tmp_path, "restore")
    try:
        daemon.wait_for(lambda: daemon.logged("tick"), 20 * SLOW, "a first tick")
        events = [e.get("event") for e in daemon.events()]
        assert "restored the ledger's records" in events
        assert events.index("restored the ledger's records") < events.index("tick")
        assert not node.changed(), "every weight and limit back before the first tick"
        assert not Ledger.load(str(ledger))
    finally:
        daemon.kill()


def test_lowered_weights_come_back_within_the_hold_with_on_start_adopt(node: ShapedNode, tmp_path: Path) -> None:
    """With onStart: adopt the next daemon takes the crashed one's lowered weight as its own and, the harm gone,
    puts it back within weightHoldSeconds while it runs."""
    node.start(burners=6, important_share=SLEEPER_SHARE)
    ledger = crash_holding(node, tmp_path, quotas=False)
    tier = f"{node.parent}/kubepods/burstable"
    assert node.hierarchy.weight(tier) != node.weights[tier]
    node.stop_burners()

    daemon = restart(node, ledger, tmp_path, "adopt")
    try:
        daemon.wait_for(lambda: daemon.logged("tick"), 20 * SLOW, "a first tick")
        adopted = next(e for e in daemon.events() if e.get("event") == "re-adopted the ledger's records")
        assert adopted["cpu.weight"] == 1, adopted
        took = daemon.wait_for(lambda: not node.changed(), (HOLD + 10) * SLOW, "the weight back while running")
        assert daemon.proc is not None and daemon.proc.poll() is None, "put back by the running daemon"
        assert took <= (HOLD + 10) * SLOW
        daemon.wait_for(lambda: not Ledger.load(str(ledger)), 5 * SLOW, "the ledger emptied")
        daemon.signal(signal.SIGTERM)
        assert daemon.wait(timeout=10 * SLOW) == 0
    finally:
        daemon.kill()


def test_weights_and_quotas_both_come_back_after_a_crash(any_node: ShapedNode, tmp_path: Path) -> None:
    """A crash while both levers hold (the tier's weight and burners' quotas): the next daemon (onStart: adopt)
    puts every weight and limit back once the burners stop, and the ledger empties."""
    node = any_node
    node.start(burners=6, important_share=SLEEPER_SHARE)
    ledger = crash_holding(node, tmp_path, quotas=True)
    assert all(held(ledger).values())
    node.stop_burners()

    daemon = restart(node, ledger, tmp_path, "adopt")
    try:
        daemon.wait_for(lambda: not node.changed(), 40 * SLOW, "every weight and limit back")
        daemon.wait_for(lambda: not Ledger.load(str(ledger)), 5 * SLOW, "the ledger emptied")
    finally:
        daemon.kill()
