"""Turning the gate on and off across reloads and restarts of the real daemon (``gate.enabled`` takes a restart)."""

from __future__ import annotations

import json
import signal
from pathlib import Path
from typing import Any

from nodeguard.gate import store
from tests.daemon_proc import DaemonProcess
from tests.gate.helpers import QUIET, Session, wait_until
from tests.gate.test_state_file import record, write_state


def config(run: Path, *, enabled: bool) -> dict[str, Any]:
    return {
        "global": {
            "sensing": {"kubepods": False, "tickSeconds": 0.2},
            "actuation": {"ledgerPath": str(run / "ledger.json"), "dryRun": True},
            "gate": {"enabled": enabled, "socket": str(run / "gate.sock")},
            **QUIET,
        }
    }


def ticked(daemon: DaemonProcess, count: int) -> bool:
    return sum(e.get("event") == "tick" for e in daemon.events()) >= count


def gate_status(socket: str) -> dict[str, Any] | None:
    """The gate's status over its socket; None while nothing answers there."""
    try:
        session = Session(socket)
    except OSError:
        return None
    try:
        return dict(session.request({"op": "status"})["gate"])
    finally:
        session.close()


def stopped(daemon: DaemonProcess) -> None:
    daemon.signal(signal.SIGTERM)
    assert daemon.wait(30) == 0, daemon.log_path.read_text()[-3000:]


def test_a_reload_that_turns_the_gate_on_keeps_serving_without_it_until_the_restart(tmp_path: Path) -> None:
    """SIGHUP with gate.enabled now true: the daemon warns, keeps ticking with no socket; after a restart it gates."""
    run = tmp_path / "run"
    run.mkdir()
    socket = str(run / "gate.sock")
    daemon = DaemonProcess(config(run, enabled=False), tmp_path).start()
    try:
        daemon.wait_for(lambda: ticked(daemon, 2), 30, "two ticks with the gate off")
        daemon.config_path.write_text(json.dumps(config(run, enabled=True)))
        daemon.signal(signal.SIGHUP)
        daemon.wait_for(lambda: any(e.get("event") == "config reloaded" for e in daemon.events()), 30, "the reload")
        ticks_at_reload = sum(e.get("event") == "tick" for e in daemon.events())
        daemon.wait_for(lambda: ticked(daemon, ticks_at_reload + 3), 30, "ticks after the reload")
        warnings = [
            e for e in daemon.events() if e.get("event") == "gate.socket and gate.enabled change only on restart"
        ]
        assert warnings, "no warning that turning the gate on takes a restart"
        assert not Path(socket).exists() and gate_status(socket) is None
        assert daemon.proc is not None and daemon.proc.poll() is None
        stopped(daemon)

        daemon.start()
        status = wait_until(lambda: gate_status(socket), 30, "the gate after the restart")
        assert status["enabled"] is True and status["serving"] is True, status
    finally:
        daemon.kill()


def test_a_restart_with_the_gate_off_leaves_its_state_file_for_the_next_gate(tmp_path: Path) -> None:
    """A gate-off daemon over a state file with a starting load neither reads nor rewrites it; the next gate resumes it."""
    run = tmp_path / "run"
    run.mkdir()
    path = write_state(run, [record("held")])
    written = path.read_bytes()
    mode = path.stat().st_mode

    off = DaemonProcess(config(run, enabled=False), tmp_path).start()
    try:
        off.wait_for(lambda: ticked(off, 3), 30, "three ticks with the gate off")
        stopped(off)
    finally:
        off.kill()
    assert path.read_bytes() == written and path.stat().st_mode == mode
    assert not list(run.glob(store.STATE_FILE + ".corrupt-*"))

    on = DaemonProcess(config(run, enabled=True), tmp_path).start()
    try:
        status = wait_until(lambda: gate_status(str(run / "gate.sock")), 30, "the gate")
        assert [(load["name"], load["state"]) for load in status["loads"]] == [("held", "starting")], status
    finally:
        on.kill()


def test_a_reload_that_turns_the_gate_off_keeps_it_serving_until_the_restart(tmp_path: Path) -> None:
    """SIGHUP with gate.enabled now false: the daemon warns and the gate keeps serving, its status on; a restart
    turns it off (no socket)."""
    run = tmp_path / "run"
    run.mkdir()
    socket = str(run / "gate.sock")
    daemon = DaemonProcess(config(run, enabled=True), tmp_path).start()
    try:
        wait_until(lambda: gate_status(socket), 30, "the gate")
        daemon.config_path.write_text(json.dumps(config(run, enabled=False)))
        daemon.signal(signal.SIGHUP)
        daemon.wait_for(lambda: any(e.get("event") == "config reloaded" for e in daemon.events()), 30, "the reload")
        warnings = [
            e for e in daemon.events() if e.get("event") == "gate.socket and gate.enabled change only on restart"
        ]
        assert warnings, "no warning that turning the gate off takes a restart"
        status = gate_status(socket)
        assert status is not None and (status["enabled"], status["serving"]) == (True, True), status
        stopped(daemon)
        before = sum(e.get("event") == "tick" for e in daemon.events())

        daemon.start()  # its log goes on in the same file
        daemon.wait_for(lambda: ticked(daemon, before + 2), 30, "two ticks after the restart")
        assert gate_status(socket) is None and not Path(socket).exists()
    finally:
        daemon.kill()
