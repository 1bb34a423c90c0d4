"""A successor asks the daemon that holds the node for room before its start costs CPU (nodeguard.successor_start)."""

from __future__ import annotations

import fcntl
import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from nodeguard.model.snapshot import NodeUsage
from nodeguard.successor_start import (
    DEFAULT_LEDGER,
    NOTE_SECONDS,
    Start,
    Starting,
    announce,
    note_room,
    read_note,
    start_of,
    successor_starting,
)


@pytest.fixture
def ledger(tmp_path: Path) -> str:
    return str(tmp_path / "ledger.json")


@pytest.fixture
def holder(ledger: str) -> Iterator[int]:
    """Another process holding ``<ledger>.lock``, as the daemon that holds the node does."""
    script = (
        "import fcntl, os, sys\n"
        "fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT, 0o600)\n"
        "fcntl.flock(fd, fcntl.LOCK_EX)\n"
        "print('held', flush=True)\n"
        "sys.stdin.read()\n"
    )
    proc = subprocess.Popen([sys.executable, "-c", script, ledger + ".lock"], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE)  # fmt: skip
    assert proc.stdout is not None and proc.stdout.readline() == b"held\n"
    try:
        yield proc.pid
    finally:
        proc.kill()
        proc.wait()


def write_note(ledger: str, pid: int, at: float, room: bool = False) -> None:
    Path(ledger + ".starting").write_text(json.dumps({"pid": pid, "at": at, "room": room}))


def test_the_ledger_and_the_wait_come_from_the_config_or_the_defaults(tmp_path: Path) -> None:
    """The ledger is global.actuation.ledgerPath of --config (the default without one), the wait six of its ticks
    (at most 10 s), and nothing is asked for a dry run or a config the daemon will refuse."""
    config = tmp_path / "config.json"
    config.write_text(json.dumps({"global": {"actuation": {"ledgerPath": "/run/x/ledger.json"}}}))
    assert start_of(["run", "--config", str(config)]) == Start("/run/x/ledger.json", 6.0)
    assert start_of(["--log-level", "debug", "run", f"--config={config}"]) == Start("/run/x/ledger.json", 6.0)
    config.write_text(json.dumps({"global": {"sensing": {"tickSeconds": 0.5}}}))
    assert start_of(["run", "-c", str(config)]) == Start(DEFAULT_LEDGER, 3.0)
    config.write_text(json.dumps({"global": {"sensing": {"tickSeconds": 30}}}))
    assert start_of(["run", "-c", str(config)]) == Start(DEFAULT_LEDGER, 10.0)
    assert start_of(["run"]) == Start(DEFAULT_LEDGER, 6.0)
    assert start_of(["run", "--dry-run"]) is None
    for refused in ({"global": {"actuation": {"dryRun": True}}}, {"global": {"sensing": {"tickSeconds": "x"}}},
                    {"global": {"actuation": {"ledgerPath": 3}}}, []):  # fmt: skip
        config.write_text(json.dumps(refused))
        assert start_of(["run", "-c", str(config)]) is None, refused
    config.write_text("{not json")
    assert start_of(["run", "-c", str(config)]) is None
    assert start_of(["run", "-c", str(tmp_path / "missing.json")]) is None


def test_no_holder_no_note(ledger: str) -> None:
    """With no daemon holding the ledger's lock, nothing is asked and no note is written."""
    Path(ledger + ".lock").touch()
    assert not announce(ledger, wait_seconds=0.5)
    assert not Path(ledger + ".starting").exists()


def test_a_holder_that_never_answers_costs_the_wait_only(ledger: str, holder: int) -> None:
    """An older holder never notes room: the successor asks, waits its bound, and starts."""
    started = time.monotonic()
    assert announce(ledger, wait_seconds=0.3)
    assert time.monotonic() - started >= 0.3
    note = read_note(ledger)
    assert note is not None and note.pid == os.getpid() and not note.room


def test_the_successor_starts_once_room_is_made(ledger: str, holder: int) -> None:
    """The successor waits until the holder notes room, then goes on at once."""
    answered = threading.Event()

    def holder_tick() -> None:
        deadline = time.monotonic() + 5
        while (note := read_note(ledger)) is None and time.monotonic() < deadline:
            time.sleep(0.01)
        assert note is not None
        note_room(ledger, note)
        answered.set()

    thread = threading.Thread(target=holder_tick)
    thread.start()
    started = time.monotonic()
    assert announce(ledger, wait_seconds=10)
    took = time.monotonic() - started
    thread.join()
    assert answered.is_set() and took < 5, took
    note = read_note(ledger)
    assert note is not None and note.room


def test_the_holder_ignores_and_removes_stale_notes(ledger: str) -> None:
    """A note of a process that is gone (or a zombie), one too old, and the daemon's own are removed, and no room is
    held; a live successor's is kept."""
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, check=True)
    for pid, at in ((int(gone.stdout), time.time()), (os.getppid(), time.time() - NOTE_SECONDS - 1),
                    (os.getpid(), time.time())):  # fmt: skip
        write_note(ledger, pid, at)
        assert successor_starting(ledger) is None
        assert not Path(ledger + ".starting").exists()
    zombie = subprocess.Popen([sys.executable, "-c", "pass"])  # dead, not reaped until wait()
    try:
        deadline = time.monotonic() + 10
        while Path(f"/proc/{zombie.pid}/stat").read_text().rpartition(")")[2].split()[0] != "Z":
            assert time.monotonic() < deadline
            time.sleep(0.01)
        write_note(ledger, zombie.pid, time.time())
        assert successor_starting(ledger) is None and not Path(ledger + ".starting").exists()
    finally:
        zombie.wait()
    write_note(ledger, os.getppid(), time.time())
    assert successor_starting(ledger) == read_note(ledger) != None  # noqa: E711


def test_room_is_noted_only_on_the_note_it_was_made_for(ledger: str) -> None:
    """A note replaced meanwhile (another successor) is not marked answered."""
    write_note(ledger, os.getppid(), 100.0)
    note_room(ledger, Starting(os.getppid() + 1, 100.0))
    assert read_note(ledger) == Starting(os.getppid(), 100.0, room=False)
    note_room(ledger, Starting(os.getppid(), 100.0))
    assert read_note(ledger) == Starting(os.getppid(), 100.0, room=True)


def test_reserved_cores_count_in_both_cpu_readings() -> None:
    """Room for a start reads as that much more CPU busy, in cores and in percent of the node."""
    node = NodeUsage(4, None, 2.0, 50.0, None, None, None, None, None)
    reserved = node.with_cores_reserved(0.25)
    assert reserved.cores_used == 2.25 and reserved.cpu_utilization == pytest.approx(56.25)
    first = NodeUsage(4, None, None, None, None, None, None, None, None)
    assert first.with_cores_reserved(0.25) == first


def test_the_lock_holder_is_found_without_taking_the_lock(ledger: str, holder: int) -> None:
    """The lock check reads /proc/locks only: the holder keeps its lock, and no one else is seen holding it."""
    from nodeguard.actuators.node_lock import holder_pid

    assert holder_pid(ledger + ".lock") == holder
    fd = os.open(ledger + ".lock", os.O_RDWR)
    try:
        with pytest.raises(BlockingIOError):
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    finally:
        os.close(fd)
    assert holder_pid(ledger + ".missing") is None


def test_room_is_made_once_no_node_cpu_waterline_is_past() -> None:
    """The holder answers only on a tick that read every node CPU waterline met with the room counted; memory and
    protected-stall gaps do not keep a successor waiting."""
    from types import SimpleNamespace
    from typing import Any

    from nodeguard.handover import room_made
    from nodeguard.policy.metrics import Metric

    def plan(*past: Metric) -> Any:
        return SimpleNamespace(gaps=SimpleNamespace(throttle_down=dict.fromkeys(past, 1.0)))

    assert room_made(plan())
    assert not room_made(plan(Metric.CPU_TOTAL_UTILIZATION))
    assert not room_made(plan(Metric.CPU_TOTAL_USAGE, Metric.MEMORY_TOTAL_USAGE))
    assert room_made(plan(Metric.MEMORY_TOTAL_UTILIZATION, Metric.PROTECTED_CPU_STALL))


def test_the_defaults_read_before_start_are_the_settings_defaults() -> None:
    """What the successor assumes without a config is what the daemon's settings default to."""
    from nodeguard.actuators.settings import ActuationSettings
    from nodeguard.sources.settings import SensingSettings

    assert ActuationSettings().ledger_path == DEFAULT_LEDGER
    assert start_of(["run"]) == Start(DEFAULT_LEDGER, 6 * SensingSettings().tick_seconds)
