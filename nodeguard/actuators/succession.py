"""A successor takes over; only an uninstall gives back: how the node passes from one nodeguard to the next.

The daemon that acts holds the node lock (node_lock.py) and, around it, a lock
on ``<ledger>.lock``: taken before the node lock and let go after it. A daemon
that finds the node held and that lock free knows the holder keeps another
ledger: a second nodeguard beside this one (a systemd unit next to a DaemonSet
pod), and it refuses, as always. One that finds it held wants the same ledger:
it is the holder's successor (a rolling update's new pod), and it waits.

- A successor waits holding ``<ledger>.successor`` (a flock: the kernel lets it
  go with its holder, so a successor that died leaves no mark behind; a second
  successor queues behind the first), then on ``<ledger>.lock`` itself, in a
  thread blocked in ``flock``: it has the lock the moment it is let go.
- A daemon that stops while ``<ledger>.successor`` is held hands over: it saves
  the ledger, writes ``<ledger>.handover`` (its pid and this boot's id) and lets
  both locks go. The successor removes the note once it holds the node, and
  adopts the records whatever ``onStart`` says. The stopping daemon waits for
  that: if its successor goes away first (stopped too, as in an uninstall
  during a rollout, or dead), it takes the node back and gives back as
  ``onExit`` says.
- Before it even gets here, a successor asked the holder for room to start in
  (``<ledger>.starting``, nodeguard/successor_start.py), so that its start's
  CPU does not push the node over a waterline.
- A daemon that stops with no successor waiting gives back as ``onExit`` says. A
  daemon killed outright leaves the ledger as it was; the next start restores or
  adopts it as ``onStart`` says (or adopts it, if a handover note is there).
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import json
import os
import threading
import time
from dataclasses import dataclass
from enum import Enum
from typing import Any

from nodeguard.actuators.node_lock import holder, lock_node
from nodeguard.atomic_file import UnsafeFile, boot_id, open_lock_file, read_state_file, write_atomic
from nodeguard.log import get_logger

log = get_logger("nodeguard.succession")

LOCK_SUFFIX, SUCCESSOR_SUFFIX, HANDOVER_SUFFIX = ".lock", ".successor", ".handover"
MAX_NOTE_BYTES = 4096
# How often a daemon that handed over looks whether its successor has the node: from the first, then slower.
FIRST_LOOK, LONGEST_LOOK = 0.002, 0.05


class Taken(Enum):
    """What became of a handover."""

    TAKEN = "taken"  # the successor holds the node and has the records
    BACK = "back"  # the successor went away first: this daemon holds the node again, and gives back
    LEFT = "left"  # not taken in time (or the node went to another nodeguard): the ledger and the note stay


@dataclass(frozen=True, slots=True)
class Handover:
    """A predecessor's note: it stopped and left its holds to this daemon."""

    pid: int
    at: float  # wall-clock seconds


class Succession:
    """This daemon's hold on the node, and its place in the line of daemons that keep one ledger."""

    def __init__(self, root: str, ledger_path: str, proc_root: str = "/proc") -> None:
        self.root = root
        self.ledger_path = ledger_path
        self.proc_root = proc_root
        self.handovers = True  # False when the files beside the ledger cannot be had: the node lock alone
        self._node: int | None = None
        self._ledger: int | None = None
        self._mark: int | None = None  # <ledger>.successor, while this daemon waits and until it has read the note
        self._waiter: _Waiter | None = None

    def path(self, suffix: str) -> str:
        return self.ledger_path + suffix

    @property
    def holding(self) -> bool:
        return self._node is not None

    def holder(self) -> str:
        """Who holds the node now ("pid N (command line)")."""
        try:
            return holder(self.root, self.proc_root)
        except OSError:
            return "another process"

    # --- taking the node ------------------------------------------------------------

    def claim(self) -> bool:
        """Take the node now (True), or False when a daemon on this ledger holds it (``wait`` for it).

        NodeBusy, naming the holder, when another nodeguard (another ledger) holds the node.
        """
        try:
            os.makedirs(os.path.dirname(self.ledger_path) or ".", mode=0o750, exist_ok=True)
            ledger = open_lock_file(self.path(LOCK_SUFFIX), 0o600)
        except OSError as exc:  # UnsafeFile included
            self.handovers = False
            log.warning(
                "cannot lock beside the ledger: this daemon neither waits for a predecessor nor hands over to a "
                "successor",
                path=self.path(LOCK_SUFFIX),
                error=str(exc),
            )
            self._node = lock_node(self.root, self.proc_root)
            return True
        try:
            fcntl.flock(ledger, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(ledger)
            self._mark_now()
            return False
        try:
            self._node = lock_node(self.root, self.proc_root)
        except BaseException:
            os.close(ledger)
            raise
        self._ledger = ledger
        return True

    def _mark_now(self) -> None:
        """Take this daemon's place as the successor at once when nobody waits before it (else ``wait`` queues):
        from here on, a stop of the holder hands over to it."""
        try:
            mark = open_lock_file(self.path(SUCCESSOR_SUFFIX), 0o600)
        except OSError:
            return  # ``wait`` says why
        try:
            fcntl.flock(mark, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(mark)
        else:
            self._mark = mark

    async def wait(self, stopping: asyncio.Event) -> bool:
        """Wait for the node: True once this daemon holds it; False when ``stopping`` came first (nothing held).

        NodeBusy if another nodeguard took the node in the moment between; OSError if the files cannot be opened.
        """
        waiter = _Waiter(self._mark, self.path(SUCCESSOR_SUFFIX), self.path(LOCK_SUFFIX), asyncio.get_running_loop())
        self._mark, self._waiter = None, waiter  # the waiter's now
        waiter.start()
        stop: asyncio.Future[Any] = asyncio.ensure_future(stopping.wait())
        either: set[asyncio.Future[Any]] = {waiter.done, stop}
        try:
            await asyncio.wait(either, return_when=asyncio.FIRST_COMPLETED)
        finally:
            stop.cancel()
        error = waiter.done.exception() if waiter.done.done() else None
        if stopping.is_set() or not waiter.done.done() or error is not None:
            waiter.abandon()
            self._waiter = None
            if error is not None and not stopping.is_set():
                raise error
            return False
        self._waiter = None
        mark, ledger = waiter.take()
        try:
            self._node = lock_node(self.root, self.proc_root)
        except BaseException:
            os.close(ledger)
            os.close(mark)
            raise
        self._ledger, self._mark = ledger, mark
        return True

    def handover(self) -> Handover | None:
        """The note a predecessor left when it handed its holds over (read once and removed: that tells it the node
        is taken), or None; this daemon's place in the line is let go either way."""
        note = self.path(HANDOVER_SUFFIX)
        found: Handover | None = None
        if self.handovers:
            try:
                data = json.loads(read_state_file(note, MAX_NOTE_BYTES))
                if data.get("boot") == boot_id():
                    found = Handover(int(data["pid"]), float(data["at"]))
                else:
                    log.warning("a handover note of another boot; not taken as one", path=note)
            except FileNotFoundError:
                pass
            except (OSError, UnsafeFile, ValueError, TypeError, KeyError, AttributeError) as exc:
                log.warning("handover note unreadable; not taken as one", path=note, error=str(exc))
            with contextlib.suppress(FileNotFoundError):
                os.unlink(note)
        if self._mark is not None:
            os.close(self._mark)
            self._mark = None
        return found

    # --- leaving it -------------------------------------------------------------------

    def successor_waits(self) -> bool:
        """Whether a successor waits for the node (it holds ``<ledger>.successor``)."""
        if not self.handovers or self._node is None:
            return False
        try:
            mark = open_lock_file(self.path(SUCCESSOR_SUFFIX), 0o600)
        except OSError:
            return False
        try:
            fcntl.flock(mark, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return True
        finally:
            os.close(mark)
        return False

    def hand_over(self) -> None:
        """Leave the node to the successor that waits (the caller saved the ledger): the note written, the locks
        let go. OSError, with nothing let go, when the note cannot be written."""
        note = json.dumps({"pid": os.getpid(), "boot": boot_id(), "at": time.time()})
        write_atomic(self.path(HANDOVER_SUFFIX), note.encode())
        self.release()

    def taken(self, timeout: float) -> Taken:
        """After ``hand_over``: wait until the successor holds the node (TAKEN), or went away first (BACK: this
        daemon holds the node again and the note is gone), or ``timeout`` passed (LEFT)."""
        deadline = time.monotonic() + timeout
        pause = FIRST_LOOK
        while True:
            if not os.path.lexists(self.path(HANDOVER_SUFFIX)):
                return Taken.TAKEN
            found = self._take_back()
            if found is not None:
                return found
            if time.monotonic() >= deadline:
                return Taken.LEFT
            time.sleep(pause)
            pause = min(LONGEST_LOOK, pause * 2)

    def _take_back(self) -> Taken | None:
        """The node again if no successor waits and none took it; None while one waits or is taking it."""
        try:
            mark = open_lock_file(self.path(SUCCESSOR_SUFFIX), 0o600)
        except OSError:
            return Taken.LEFT
        try:
            fcntl.flock(mark, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(mark)
            return None  # a successor still waits: it takes the lock once it runs
        try:
            if not os.path.lexists(self.path(HANDOVER_SUFFIX)):
                return Taken.TAKEN
            ledger = open_lock_file(self.path(LOCK_SUFFIX), 0o600)
            try:
                fcntl.flock(ledger, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(ledger)
                return None  # the successor holds it and is about to read the note
            try:
                self._node = lock_node(self.root, self.proc_root)
            except Exception:  # another nodeguard took the node: the note stays for whoever keeps this ledger next
                os.close(ledger)
                return Taken.LEFT
            self._ledger = ledger
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.path(HANDOVER_SUFFIX))
            return Taken.BACK
        except OSError:
            return Taken.LEFT
        finally:
            os.close(mark)

    def release(self) -> None:
        """Let go of everything: the node lock first, then the ledger's (see the module docstring), the mark."""
        for name in ("_node", "_ledger", "_mark"):
            fd = getattr(self, name)
            if fd is not None:
                setattr(self, name, None)
                os.close(fd)
        if self._waiter is not None:
            self._waiter.abandon()
            self._waiter = None


class _Waiter:
    """A thread blocked in ``flock``: on ``<ledger>.successor`` unless it holds it already (behind another
    successor), then on ``<ledger>.lock``. It cannot be interrupted: abandoned, it lets go of what it gets as
    soon as it gets it."""

    def __init__(self, mark: int | None, mark_path: str, lock_path: str, loop: asyncio.AbstractEventLoop) -> None:
        self.mark, self.mark_path, self.lock_path = mark, mark_path, lock_path
        self.loop = loop
        self.done: asyncio.Future[None] = loop.create_future()
        self._mutex = threading.Lock()
        self._abandoned = False
        self._got: tuple[int, int] | None = None

    def start(self) -> None:
        threading.Thread(target=self._run, name="node-lock-wait", daemon=True).start()

    def _run(self) -> None:
        held: list[int] = []
        try:
            if self.mark is None:
                held.append(open_lock_file(self.mark_path, 0o600))
                fcntl.flock(held[0], fcntl.LOCK_EX)
            else:
                held.append(self.mark)
            held.append(open_lock_file(self.lock_path, 0o600))
            fcntl.flock(held[1], fcntl.LOCK_EX)
        except BaseException as exc:
            for fd in held:
                os.close(fd)
            self._report(exc)
            return
        with self._mutex:
            if self._abandoned:
                for fd in held:
                    os.close(fd)
                return
            self._got = (held[0], held[1])
        self._report(None)

    def _report(self, exc: BaseException | None) -> None:
        def finish() -> None:
            if self.done.done() or (exc is not None and self._abandoned):
                return
            if exc is None:
                self.done.set_result(None)
            else:
                self.done.set_exception(exc)

        with contextlib.suppress(RuntimeError):  # the loop is closed: nobody waits any more
            self.loop.call_soon_threadsafe(finish)

    def take(self) -> tuple[int, int]:
        """The descriptors holding the mark and the ledger's lock, now the caller's."""
        with self._mutex:
            got, self._got, self._abandoned = self._got, None, True
        assert got is not None
        return got

    def abandon(self) -> None:
        """Let go of what the thread holds, and of what it gets later."""
        with self._mutex:
            got, self._got, self._abandoned = self._got, None, True
        for fd in got or ():
            os.close(fd)
