"""The daemon's recorder: each tick's lever changes and evictions into the history, off the tick's path.

``record`` keeps the tick's (immutable) plan, snapshot and changes and
returns: a tick pays for a list append. ``flush``, called after the tick,
turns them into JSON lines and hands them to a thread of the recorder's own,
which appends them to the files (``segments``): a tick never waits for the
disk, nor for an fsync. When the thread falls behind (a disk that hangs),
what does not fit in its queue is dropped and counted, never waited for.
"""

from __future__ import annotations

import os
import queue
import threading
import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from nodeguard.actuators.changes import Done
from nodeguard.history.entries import Entry, lifecycle_entry, tick_entries
from nodeguard.history.jsonl import json_text
from nodeguard.history.segments import Segments
from nodeguard.history.settings import HistorySettings
from nodeguard.log import RateLimiter, get_logger
from nodeguard.model.snapshot import Snapshot
from nodeguard.policy.planner import Plan
from nodeguard.policy.settings import Candidates

log = get_logger("nodeguard.history")

PENDING_TICKS = 64  # ticks recorded and not flushed yet, at most: a caller that never flushes loses the oldest
QUEUE_BATCHES = 256  # batches handed to the writer and not written yet, at most
STOP_SECONDS = 5.0  # how long close waits for the writer


def unwritable(path: str) -> str | None:
    """Why the history's directory cannot be written (or made), without making it; None when it can."""
    found = path
    while not os.path.lexists(found):
        found = os.path.dirname(found)
    if not os.path.isdir(found):
        return f"{found} is not a directory"
    if not os.access(found, os.W_OK | os.X_OK):
        return f"{found} is not writable"
    return None


def encode(entry: Entry) -> bytes:
    """One entry as one line of JSON."""
    return json_text(entry).encode() + b"\n"


@dataclass
class HistoryCounters:
    entries: int = 0  # lines written
    dropped: int = 0  # lines lost: the writer's queue was full, or too many ticks were not flushed
    errors: int = 0  # writes the file system refused


@dataclass(frozen=True, slots=True)
class Pending:
    plan: Plan
    snapshot: Snapshot
    done: Sequence[Done]
    candidates: Candidates


class Recorder:
    """Records what the daemon does in the history at ``settings.path``, within ``settings.maxBytes``."""

    def __init__(self, settings: HistorySettings) -> None:
        self.settings = settings
        self.path: str | None = settings.path
        self.segments = Segments(settings.path, settings.max_bytes, settings.file_bytes)
        self.counters = HistoryCounters()
        self._pending: list[Pending] = []
        self._queue: queue.Queue[list[bytes] | None] = queue.Queue(maxsize=QUEUE_BATCHES)
        self._thread: threading.Thread | None = None
        self._errors = RateLimiter(60.0)

    def start(self) -> None:
        """Start the writer; the files are opened at the first entry (a daemon that never acts makes none). A
        directory that cannot be made or written is said now."""
        problem = unwritable(self.settings.path)
        if problem is not None:
            log.error("cannot write the decision history; the guard runs without it", path=self.settings.path,
                      problem=problem)  # fmt: skip
        self._thread = threading.Thread(target=self._run, name="history", daemon=True)
        self._thread.start()

    # --- the daemon's thread ----------------------------------------------------------

    def record(self, plan: Plan, snapshot: Snapshot, done: Sequence[Done], candidates: Candidates) -> None:
        """Keep a tick's changes for ``flush``: what it did and, in the plan and snapshot, why."""
        if done or plan.actions:
            if len(self._pending) >= PENDING_TICKS:
                self._pending.pop(0)
                self.counters.dropped += 1
            self._pending.append(Pending(plan, snapshot, done, candidates))

    def flush(self) -> None:
        """Hand the ticks recorded since the last flush to the writer, as lines. Never raises: the guard goes on
        without its history."""
        pending, self._pending = self._pending, []
        try:
            lines = [encode(e) for p in pending for e in tick_entries(p.plan, p.snapshot, p.done, p.candidates)]
        except Exception as exc:  # a bug in building entries must not stop the tick loop
            self.counters.errors += 1
            if self._errors.allow("entries"):
                log.error("cannot build decision history entries", error=str(exc), exc_info=True)
            return
        self._hand(lines)

    def lifecycle(self, kind: str, how: str, restored: Iterable[str] = (), kept: Iterable[str] = ()) -> None:
        """The daemon started or stops: which groups it put back (each lever), which it keeps holding; nothing when
        it held none. After the ticks recorded before it."""
        self.flush()
        entry = lifecycle_entry(kind, time.time(), how, restored, kept)
        if entry["restored"] or entry["kept"]:
            self._hand([encode(entry)])

    def _hand(self, lines: list[bytes]) -> None:
        if not lines:
            return
        try:
            self._queue.put_nowait(lines)
        except queue.Full:
            self.counters.dropped += len(lines)
            if self._errors.allow("full"):
                log.error("decision history falls behind; entries dropped", dropped=self.counters.dropped)

    def drain(self, timeout: float = STOP_SECONDS) -> bool:
        """Wait until the writer has written everything handed to it (tests, benchmarks); False on timeout."""
        deadline = time.monotonic() + timeout
        done = self._queue.all_tasks_done
        with done:
            while self._queue.unfinished_tasks:
                remaining = deadline - time.monotonic()
                if remaining <= 0 or self._thread is None or not self._thread.is_alive():
                    return False
                done.wait(min(remaining, 0.1))
        return True

    def close(self) -> None:
        """Write what is left, fsync and stop the writer (waiting at most STOP_SECONDS). Never started (a stop
        while starting), it starts to write what it was handed: a restore at such a stop is history too."""
        self.flush()
        if self._thread is None:
            if self._queue.empty():
                return
            self.start()
        assert self._thread is not None
        try:
            self._queue.put(None, timeout=STOP_SECONDS)
        except queue.Full:
            log.error("decision history writer does not keep up; its last entries are lost", path=self.settings.path)
            return
        self._thread.join(STOP_SECONDS)
        if self._thread.is_alive():
            log.error("decision history writer did not finish; its last entries may be lost", path=self.settings.path)
            return
        self._thread = None
        try:
            self.segments.close()
        except OSError as exc:
            log.error("cannot close the decision history", path=self.settings.path, error=str(exc))

    # --- the writer's thread ------------------------------------------------------------

    def _run(self) -> None:
        while True:
            lines = self._queue.get()
            try:
                if lines is None:
                    return
                self._write(lines)
            finally:
                self._queue.task_done()

    def _write(self, lines: list[bytes]) -> None:
        try:
            self.counters.entries += self.segments.append(lines)
        except OSError as exc:
            self.counters.errors += 1
            if self._errors.allow(f"write:{exc.errno}"):
                log.error("cannot write the decision history", path=self.settings.path, error=str(exc))
        except Exception as exc:  # a bug here must not end the writer: the next tick's lines still go
            self.counters.errors += 1
            if self._errors.allow("bug"):
                log.error("decision history writer failed", error=str(exc), exc_info=True)


class NoHistory:
    """The history off (or a dry run, which changes nothing): every call does nothing."""

    counters = HistoryCounters()
    path: str | None = None

    def start(self) -> None:
        pass

    def record(self, plan: Plan, snapshot: Snapshot, done: Sequence[Done], candidates: Candidates) -> None:
        pass

    def flush(self) -> None:
        pass

    def lifecycle(self, kind: str, how: str, restored: Iterable[str] = (), kept: Iterable[str] = ()) -> None:
        pass

    def drain(self, timeout: float = STOP_SECONDS) -> bool:
        return True

    def close(self) -> None:
        pass


def history_of(settings: HistorySettings, dry_run: bool) -> Recorder | NoHistory:
    """The daemon's recorder: none while off or in a dry run (nothing is changed, and a dry run may watch beside
    the daemon that acts, whose history this is)."""
    return Recorder(settings) if settings.enabled and not dry_run else NoHistory()
