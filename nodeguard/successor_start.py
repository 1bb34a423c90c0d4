"""A successor's start, announced before it costs anything: the daemon that holds the node makes room for it.

A new daemon's start (its imports and the config's validation) costs about
0.2 s of CPU. On a node held just under a CPU waterline, the second it starts
in would read over the waterline, on every rolling update. So ``nodeguard
run`` looks first, before anything slow is imported, whether a daemon holds
its ledger's lock (``/proc/locks``: no lock is taken). If one does, it writes
``<ledger>.starting`` (its pid) and waits, at most ``ROOM_WAIT_TICKS`` of
its ticks, until the holder notes ``room`` in it. The holder counts ``START_RESERVE_CORES`` more
node CPU while a live successor's note is there, so that its CPU waterlines
hold that much more back once their ``triggerAfter`` is met, and notes the room
once a tick reads every CPU waterline met with the room counted. The successor
removes the note once it holds the node (or gives up); a note whose writer is
gone or that is older than ``NOTE_SECONDS`` is ignored and removed.

A holder that knows nothing of the note (an older version) never answers: the
successor starts after the wait. Standard library only.
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass

from nodeguard.actuators.node_lock import holder_pid
from nodeguard.atomic_file import UnsafeFile, read_state_file, write_atomic

STARTING_SUFFIX = ".starting"
DEFAULT_LEDGER = "/run/nodeguard/ledger.json"  # actuation.ledgerPath's default (actuators/settings.py)
DEFAULT_TICK_SECONDS = 1.0  # sensing.tickSeconds' default (sources/settings.py)
# What a start costs within its first second (its imports and the config's validation: 0.22 s of CPU), and
# room for a tick's noise in the node's reading (about 0.1 core on a 2-core node held under a waterline).
START_RESERVE_CORES = 0.4
# Ticks the successor waits for room: a waterline's default triggerAfter (2), the tick that acts, the tick that
# measures the room, and two more for a node that does not settle at once. Past that (or MAX_ROOM_WAIT_SECONDS)
# the holder is taken not to answer: an older version, or a gap its candidates cannot close.
ROOM_WAIT_TICKS = 6
MAX_ROOM_WAIT_SECONDS = 10.0
# A note older than this is a start that went wrong: the room it asked for is given back.
NOTE_SECONDS = 30.0
POLL_SECONDS = 0.02
MAX_NOTE_BYTES = 512


@dataclass(frozen=True, slots=True)
class Starting:
    """A successor's note: who starts, since when (wall clock), and whether the holder made room."""

    pid: int
    at: float
    room: bool = False


@dataclass(frozen=True, slots=True)
class Start:
    """What ``nodeguard run`` asks for room with: its ledger, and how long it waits for the answer."""

    ledger_path: str
    wait_seconds: float


def start_of(argv: Sequence[str]) -> Start | None:
    """The ledger ``nodeguard run ARGV`` will use and its wait, read with the standard library from ``global``;
    None for a dry run (it waits for no one and takes no room) or a config the daemon will refuse anyway."""
    args = list(argv)
    if "--dry-run" in args:
        return None
    config: str | None = None
    for index, word in enumerate(args):
        if word in ("--config", "-c") and index + 1 < len(args):
            config = args[index + 1]
        elif word.startswith("--config="):
            config = word.split("=", 1)[1]
    if config is None:
        return _start(DEFAULT_LEDGER, DEFAULT_TICK_SECONDS)
    try:
        with open(config, encoding="utf-8") as handle:
            settings = json.load(handle).get("global", {})  # a perNode rule's is not known before start
        actuation, sensing = settings.get("actuation", {}), settings.get("sensing", {})
        if actuation.get("dryRun") is True:
            return None
        path = actuation.get("ledgerPath", DEFAULT_LEDGER)
        tick = float(sensing.get("tickSeconds", DEFAULT_TICK_SECONDS))
    except (OSError, ValueError, TypeError, AttributeError):
        return None  # the daemon's own validation says what is wrong with it; nothing is announced
    if not isinstance(path, str) or not path or not tick > 0:
        return None
    return _start(path, tick)


def _start(ledger_path: str, tick_seconds: float) -> Start:
    return Start(ledger_path, min(ROOM_WAIT_TICKS * tick_seconds, MAX_ROOM_WAIT_SECONDS))


def read_note(ledger_path: str) -> Starting | None:
    """The successor's note beside the ledger, or None (none, unreadable or malformed)."""
    try:
        data = json.loads(read_state_file(ledger_path + STARTING_SUFFIX, MAX_NOTE_BYTES))
        return Starting(int(data["pid"]), float(data["at"]), data.get("room") is True)
    except (OSError, UnsafeFile, ValueError, TypeError, KeyError):
        return None


def _write(ledger_path: str, note: Starting) -> None:
    body = {"pid": note.pid, "at": note.at, "room": note.room}
    write_atomic(ledger_path + STARTING_SUFFIX, json.dumps(body).encode(), durable=False)


def remove_note(ledger_path: str, pid: int) -> None:
    """Remove ``pid``'s note (read again: another successor's may have replaced it meanwhile)."""
    note = read_note(ledger_path)
    if note is None or note.pid != pid:
        return
    with contextlib.suppress(OSError):
        os.unlink(ledger_path + STARTING_SUFFIX)


def announce(ledger_path: str, wait_seconds: float, proc_root: str = "/proc") -> bool:
    """Ask the daemon that holds this ledger for room, and wait for it (or ``wait_seconds``); False when no daemon
    holds the ledger, and nothing was asked."""
    try:
        if holder_pid(ledger_path + ".lock", proc_root) is None:
            return False
        _write(ledger_path, Starting(os.getpid(), time.time()))
    except OSError:
        return False  # the daemon's own start says what is wrong with the ledger's directory
    deadline = time.monotonic() + wait_seconds
    while time.monotonic() < deadline:
        note = read_note(ledger_path)
        if note is None or note.pid != os.getpid() or note.room:
            break
        time.sleep(POLL_SECONDS)
    return True


def successor_starting(ledger_path: str, proc_root: str = "/proc", now: float | None = None) -> Starting | None:
    """For the daemon that holds the node: a live successor's note, for which room is held; a stale note
    (its writer gone, too old, or this daemon's own) is removed."""
    note = read_note(ledger_path)
    if note is None:
        return None
    age = (time.time() if now is None else now) - note.at
    if note.pid == os.getpid() or not 0 <= age <= NOTE_SECONDS or not _alive(note.pid, proc_root):
        remove_note(ledger_path, note.pid)
        return None
    return note


def _alive(pid: int, proc_root: str) -> bool:
    """Whether the process runs (a zombie, dead but not yet reaped, does not)."""
    try:
        with open(f"{proc_root}/{pid}/stat", encoding="ascii", errors="replace") as handle:
            state = handle.read().rpartition(")")[2].split()[:1]
    except OSError:
        return False
    return bool(state) and state[0] not in ("Z", "X")


def note_room(ledger_path: str, note: Starting) -> None:
    """Tell the successor that room is made (after a tick acted with it), unless its note changed meanwhile."""
    if note.room or read_note(ledger_path) != note:
        return
    with contextlib.suppress(OSError):
        _write(ledger_path, Starting(note.pid, note.at, room=True))
