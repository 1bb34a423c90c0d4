"""Turning the gate on and off across reloads and restarts of the real daemon (``gate.enabled`` takes a restart)."""

from __future__ import annotations

import signal
from pathlib import Path

from nodeguard.gate import store
from tests.gate.state_records import record, write_state
from tests.support.daemon import DaemonProcess
from tests.support.gate import Gate
from tests.support.poll import wait_until

RESTART_ONLY = "gate.socket and gate.enabled change only on restart"


def reloaded(gate: Gate, enabled: bool) -> None:
    """SIGHUP with gate.enabled now ``enabled``, until the daemon says it took the new config."""
    gate.reconfigure({"enabled": enabled})
    gate.daemon.wait_for(lambda: gate.daemon.logged("config reloaded"), 30, "the reload")


def stopped(daemon: DaemonProcess) -> None:
    daemon.signal(signal.SIGTERM)
    assert daemon.wait(30) == 0, daemon.log_path.read_text()[-3000:]


def test_a_reload_that_turns_the_gate_on_keeps_serving_without_it_until_the_restart(tmp_path: Path) -> None:
    """SIGHUP with gate.enabled now true: the daemon warns, keeps ticking with no socket; after a restart it gates."""
    gate = Gate(tmp_path, {"enabled": False})
    daemon = gate.daemon.start()
    try:
        daemon.wait_for(lambda: len(daemon.ticks()) >= 2, 30, "two ticks with the gate off")
        reloaded(gate, True)
        ticks_at_reload = len(daemon.ticks())
        daemon.wait_for(lambda: len(daemon.ticks()) >= ticks_at_reload + 3, 30, "ticks after the reload")
        assert daemon.logged(RESTART_ONLY), "no warning that turning the gate on takes a restart"
        assert not Path(gate.socket).exists() and gate.status_if_up() is None
        assert daemon.proc is not None and daemon.proc.poll() is None
        stopped(daemon)

        daemon.start()
        status = wait_until(gate.status_if_up, 30, "the gate after the restart")
        assert status["enabled"] is True and status["serving"] is True, status
    finally:
        gate.stop()


def test_a_restart_with_the_gate_off_leaves_its_state_file_for_the_next_gate(tmp_path: Path) -> None:
    """A gate-off daemon over a state file with a starting load neither reads nor rewrites it; the next gate resumes it."""
    run = tmp_path / "run"
    run.mkdir()
    path = write_state(run, [record("held")])
    written = path.read_bytes()
    mode = path.stat().st_mode

    off = Gate(tmp_path, {"enabled": False})
    try:
        off.daemon.start().wait_for(lambda: len(off.daemon.ticks()) >= 3, 30, "three ticks with the gate off")
        stopped(off.daemon)
    finally:
        off.stop()
    assert path.read_bytes() == written and path.stat().st_mode == mode
    assert not list(run.glob(store.STATE_FILE + ".corrupt-*"))

    on = Gate(tmp_path, {"enabled": True})
    try:
        on.daemon.start()
        status = wait_until(on.status_if_up, 30, "the gate")
        assert [(load["name"], load["state"]) for load in status["loads"]] == [("held", "starting")], status
    finally:
        on.stop()


def test_a_reload_that_turns_the_gate_off_keeps_it_serving_until_the_restart(tmp_path: Path) -> None:
    """SIGHUP with gate.enabled now false: the daemon warns and the gate keeps serving, its status on; a restart
    turns it off (no socket)."""
    gate = Gate(tmp_path, {"enabled": True})
    daemon = gate.daemon
    try:
        gate.start()
        reloaded(gate, False)
        assert daemon.logged(RESTART_ONLY), "no warning that turning the gate off takes a restart"
        status = gate.status_if_up()
        assert status is not None and (status["enabled"], status["serving"]) == (True, True), status
        stopped(daemon)
        before = len(daemon.ticks())

        daemon.start()  # its log goes on in the same file
        daemon.wait_for(lambda: len(daemon.ticks()) >= before + 2, 30, "two ticks after the restart")
        assert gate.status_if_up() is None and not Path(gate.socket).exists()
    finally:
        gate.stop()
