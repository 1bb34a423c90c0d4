"""A stop at any moment after exec leaves the node as it was; a reload while starting is never fatal.

A real SIGKILLed daemon leaves its ledger holding the Burstable tier's weight
and a burner's quota (test_lever_crash's node). Then, once per delay, that
crashed state is put back exactly (the ledger's bytes, and each record's
applied value written through its lever), a new ``nodeguard run`` starts on it
and gets SIGTERM that many seconds after exec. Host cgroup v1; on cgroup v2 (the
QEMU VM) the same stop at two moments of the emulated start-up.
"""

from __future__ import annotations

import functools
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from nodeguard.actuators import levers
from nodeguard.actuators.cgroup_writer import CgroupWriter
from nodeguard.actuators.ledger import Ledger
from nodeguard.model.levers import CPU_WEIGHT, LeverChange
from nodeguard.model.samples import CpuMax
from tests.integration.crashes import crash_holding, held
from tests.support import cgroups as rc
from tests.support.daemon import DaemonProcess
from tests.support.levers import executor_for, throttle_by_hand
from tests.support.node import SLEEPER_SHARE, SLOW, ShapedNode, protect_config, protected_node
from tests.support.poll import wait_until

HOST_DELAYS = (0.0, 0.02, 0.05, 0.1, 0.2, 0.35, 0.5, 1.0, 2.0, 3.0)
# In the VM: the moment nodeguard takes SIGTERM over (None: deterministic, seconds of imports before the first
# tick), and 2 s after exec (before or after the first tick, as fast as that VM is).
VM_DELAYS = (None, 2.0)


@pytest.fixture
def node() -> Iterator[ShapedNode]:
    """Host v1 (the VM's v2 run is test_a_stop_while_starting_restores_on_cgroup_v2's, within its time budget)."""
    with protected_node(rc.v1_cpu_hierarchy()) as shaped:
        yield shaped


@pytest.fixture
def crashed(node: ShapedNode, tmp_path: Path) -> tuple[Path, bytes]:
    """The ledger a SIGKILLed daemon left holding the tier's weight and a burner's quota, and its bytes; the
    burners stopped since."""
    node.start(burners=6, important_share=SLEEPER_SHARE)
    ledger = crash_holding_both(node, tmp_path)
    node.stop_burners()
    return ledger, ledger.read_bytes()


def catches(pid: int, signum: signal.Signals) -> bool:
    """Whether the process has a handler for ``signum`` now (/proc/PID/status SigCgt)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("SigCgt:"):
            return bool(int(line.split()[1], 16) >> (signum - 1) & 1)
    raise AssertionError(f"no SigCgt for {pid}")


def crash_holding_both(node: ShapedNode, tmp_path: Path) -> Path:
    """A real SIGKILLed daemon holding the tier's weight, and a burner's quota in its ledger beside it, as a
    throttle of that daemon would have left it (written through the lever, recorded in the ledger)."""
    ledger = crash_holding(node, tmp_path, quotas=False)
    pod = node.burners[0].pod
    found = Ledger.load(str(ledger))
    executor = executor_for(str(node.hierarchy.writable), node.hierarchy.version, found)
    throttle_by_hand(executor, found, pod, node.originals[pod], CpuMax(50000))
    found.save()
    assert all(held(ledger).values())
    return ledger


def put_back_the_crash(node: ShapedNode, ledger: Path, crashed: bytes) -> None:
    """The node as the SIGKILLed daemon left it: its ledger, and every record's value in the kernel."""
    ledger.write_bytes(crashed)
    built = levers.build(CgroupWriter(str(node.hierarchy.writable)), node.hierarchy.version)
    for record in Ledger.load(str(ledger)):
        lever = built[record.lever]
        _, writes = lever.plan(record.group, record.applied, {})
        lever.perform(writes)
    assert node.changed(), "the crashed daemon's values are in place"


def run_and_stop(
    node: ShapedNode, ledger: Path, workdir: Path, delay: float | None, signum: signal.Signals
) -> tuple[int, bool]:
    """A daemon on the crashed ledger, sent ``signum`` ``delay`` s after exec (None: as soon as it has taken the
    signal over): its exit code, and whether it had taken the signal over when it was sent."""
    workdir.mkdir()
    daemon = DaemonProcess(protect_config(node, ledger), workdir).start()
    assert daemon.proc is not None
    try:
        pid = daemon.proc.pid
        if delay is None:  # at once: every millisecond of the start-up is a moment this test may hit
            wait_until(lambda: catches(pid, signum), 30 * SLOW, "the signal taken over", interval=0.001,
                       give_up=daemon.exited)  # fmt: skip
        else:
            time.sleep(delay)  # the scenario: the signal this long after exec, wherever the start-up is
        caught = catches(pid, signum)
        daemon.signal(signum)
        return daemon.wait(timeout=30 * SLOW), caught
    finally:
        daemon.kill()


def test_a_stop_at_any_moment_after_exec_restores_what_a_crashed_daemon_left(
    node: ShapedNode, crashed: tuple[Path, bytes], tmp_path: Path
) -> None:
    """SIGTERM at each delay from exec to well past the first tick: the daemon exits 0 with every weight and limit
    back at its original and an empty ledger. The only exception allowed is a signal sent before the interpreter
    ran nodeguard's first line (no handler yet, /proc says so): it dies of it, and the ledger is untouched for the
    next start, which then restores everything."""
    ledger, crashed_bytes = crashed
    handled = []
    for i, delay in enumerate(HOST_DELAYS):
        put_back_the_crash(node, ledger, crashed_bytes)
        code, caught = run_and_stop(node, ledger, tmp_path / f"stop-{i}", delay, signal.SIGTERM)
        if caught or code != -signal.SIGTERM:
            assert code == 0, f"SIGTERM {delay} s after exec: exit {code}"
            assert not node.changed(), f"SIGTERM {delay} s after exec left {sorted(node.changed())}"
            assert not Ledger.load(str(ledger)), f"SIGTERM {delay} s after exec left the ledger holding"
            handled.append(delay)
        else:  # before nodeguard's first line: nothing of it ran
            assert ledger.read_bytes() == crashed_bytes
            code, caught = run_and_stop(node, ledger, tmp_path / f"again-{i}", HOST_DELAYS[-1], signal.SIGTERM)
            assert (code, caught) == (0, True) and not node.changed() and not Ledger.load(str(ledger))
    late = HOST_DELAYS[len(HOST_DELAYS) // 2 :]
    assert handled[-len(late) :] == list(late), f"handled only at {handled}"


@pytest.mark.kernel
def test_a_stop_while_starting_restores_on_cgroup_v2(tmp_path: Path) -> None:
    """cgroup v2 (the VM): a ledger holding a pod's cpu.max and its tier's lowered weight, in the ledger and the
    kernel as a crashed daemon leaves them; SIGTERM to the next daemon as soon as it takes the signal over (while
    it imports, so before its first tick, which it then never runs) and 2 s after exec: each time it exits 0
    with both back at their originals and an empty ledger (a signal before nodeguard's first line: the next
    start restores)."""
    with protected_node(rc.v2_cpu_hierarchy()) as node:
        ledger = tmp_path / "run/ledger.json"
        ledger.parent.mkdir()
        tier, pod = f"{node.parent}/kubepods/burstable", node.burners[0].pod
        found = Ledger(str(ledger))
        executor = executor_for(str(node.hierarchy.writable), node.hierarchy.version, found)
        throttle_by_hand(executor, found, pod, node.originals[pod], CpuMax(50000))
        least = executor.levers[CPU_WEIGHT.name].strongest(tier)
        lowered = LeverChange(CPU_WEIGHT.name, tier, least, None, release=False, holds_back=True, kind="reweigh",
                              metric="protected_cpu_stall", reason="by hand")  # fmt: skip
        done = executor.changer.apply([lowered])
        assert len(done.done) == 1 and not done.refused, done
        found.save()
        assert all(held(ledger).values()) and {pod, tier} <= node.changed()
        crashed_bytes = ledger.read_bytes()
        for i, delay in enumerate(VM_DELAYS):
            put_back_the_crash(node, ledger, crashed_bytes)
            code, caught = run_and_stop(node, ledger, tmp_path / f"stop-{i}", delay, signal.SIGTERM)
            if not caught and code == -signal.SIGTERM:  # before nodeguard's first line: nothing of it ran
                assert ledger.read_bytes() == crashed_bytes
                code, caught = run_and_stop(node, ledger, tmp_path / f"again-{i}", 30.0, signal.SIGTERM)
            assert code == 0, f"SIGTERM {delay} s after exec: exit {code}"
            assert not node.changed(), f"SIGTERM {delay} s after exec left {sorted(node.changed())}"
            assert not Ledger.load(str(ledger)), f"SIGTERM {delay} s after exec left the ledger holding"
            if delay is None:
                log = "".join(p.read_text() for p in (tmp_path / f"stop-{i}").glob("daemon-*.log"))
                assert "a signal arrived while starting" in log and '"event": "tick"' not in log, log


def test_a_reload_while_starting_is_applied_after_start_and_a_stop_then_restores(
    node: ShapedNode, crashed: tuple[Path, bytes], tmp_path: Path
) -> None:
    """SIGHUP at each early delay does not kill the daemon: it starts, ticks and takes the reload; a SIGTERM then
    restores everything."""
    ledger, crashed_bytes = crashed
    for i, delay in enumerate((bare_interpreter_seconds(), 0.1, 0.3, 0.6)):
        put_back_the_crash(node, ledger, crashed_bytes)
        (tmp_path / f"hup-{i}").mkdir()
        daemon = DaemonProcess(protect_config(node, ledger), tmp_path / f"hup-{i}").start()
        assert daemon.proc is not None
        try:
            time.sleep(delay)  # the scenario: SIGHUP this long after exec, wherever the start-up is
            if not catches(daemon.proc.pid, signal.SIGHUP):
                continue  # still inside the interpreter's own start: nothing of nodeguard to test yet
            daemon.signal(signal.SIGHUP)
            daemon.wait_for(functools.partial(daemon.logged, "tick"), 30 * SLOW, "a tick")
            daemon.wait_for(functools.partial(daemon.logged, "reloading config"), 10 * SLOW, "the reload taken")
            daemon.signal(signal.SIGTERM)
            assert daemon.wait(timeout=30 * SLOW) == 0
            assert not node.changed() and not Ledger.load(str(ledger))
        finally:
            daemon.kill()


def bare_interpreter_seconds() -> float:
    """How long this interpreter takes to start and exit doing nothing (the fastest of three)."""
    took = []
    for _ in range(3):
        start = time.monotonic()
        subprocess.run([sys.executable, "-c", "pass"], check=True)
        took.append(time.monotonic() - start)
    return min(took)


def test_a_stop_at_any_moment_honours_on_exit_keep(node: ShapedNode, tmp_path: Path) -> None:
    """With onExit: keep, a SIGTERM while starting keeps what the ledger holds (values and ledger as they were)
    and exits 0."""
    node.start(burners=6, important_share=SLEEPER_SHARE)
    ledger = crash_holding(node, tmp_path, quotas=False)
    node.stop_burners()
    before, changed = held(ledger), node.changed()
    config = protect_config(node, ledger)
    config["global"]["actuation"].update(onStart="adopt", onExit="keep")
    (tmp_path / "keep").mkdir()
    daemon = DaemonProcess(config, tmp_path / "keep").start()
    assert daemon.proc is not None
    try:
        pid = daemon.proc.pid
        daemon.wait_for(lambda: catches(pid, signal.SIGTERM), 10 * SLOW, "the handler taken over")
        daemon.signal(signal.SIGTERM)
        assert daemon.wait(timeout=30 * SLOW) == 0
    finally:
        daemon.kill()
    assert node.changed() == changed and held(ledger) == before
