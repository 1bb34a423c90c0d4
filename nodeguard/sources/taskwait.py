"""How long a cgroup's threads waited to run: the run-queue delay in ``/proc/<tid>/schedstat``.

Each thread's schedstat gives the nanoseconds it ran and the nanoseconds it
was runnable but not running (CFS bandwidth throttling counted: a throttled
thread is runnable). Summed over the threads of a workload's subtree (the
``tasks`` files on v1, ``cgroup.threads`` on v2), a tick's deltas divided by
the tick are in cores:

- ``waited``: all of it. For a workload nodeguard protects this is harm
  (its work is late), wake-up latency included.
- ``starved``: only the wait of threads that were runnable the whole tick.
  A thread that slept part of it got the CPU it asked for in the end (given
  more, it would finish sooner and sleep more); one that never sleeps is
  work that would take whatever CPU a throttle elsewhere frees.

The descendants' own CFS throttling is summed too (``cpu.stat``): kubelet
limits a container as well as its pod, and a container throttled by its own
limit waits for no one else; the workload's own ``cpu.stat`` does not count it.

The threads' and the descendants' cpu.stat descriptors are kept open (the kernel regenerates the text on
every pread). v1 caches a ``tasks`` list per open file for a second, so its
lists are opened afresh each time; v2's ``cgroup.threads`` is read through a
kept-open descriptor. A thread first seen counts from its second tick on.
"""

from __future__ import annotations

import errno
import os
import time
from collections.abc import Callable, Iterable
from typing import NamedTuple

_OPEN_FLAGS = os.O_RDONLY | os.O_CLOEXEC
_GONE = frozenset({errno.ENOENT, errno.ESRCH, errno.ENODEV})
# Kept-open thread descriptors across all workloads; past this, threads are opened per read.
MAX_KEPT_OPEN = 4096
# Runnable (running or waiting) for this share of the tick: a thread that does not sleep.
ALWAYS_RUNNABLE = 0.9


class Waits(NamedTuple):
    """Nanoseconds of run-queue wait over ``interval_ns``: of every thread, and of threads that never slept;
    and the nanoseconds the descendants' own CFS limits held them back."""

    waited_ns: int
    starved_ns: int
    interval_ns: int
    throttled_ns: int = 0


class TaskWait:
    """The run-queue waits of the threads in a set of cgroup directories, per call."""

    kept_open = 0  # across all instances

    def __init__(
        self,
        directories: Iterable[str],
        proc_root: str = "/proc",
        list_name: str = "tasks",
        clock: Callable[[], int] = time.monotonic_ns,
    ) -> None:
        self.proc_root = proc_root
        self.list_name = list_name
        self._clock = clock
        self._keep_lists = list_name != "tasks"  # v1's "tasks" goes stale when kept open
        # cpu.stat's throttled time: nanoseconds on v1, microseconds on v2.
        v1 = list_name == "tasks"
        self._throttled_key, self._throttled_ns = (b"throttled_time", 1) if v1 else (b"throttled_usec", 1000)
        # Descendant directory -> (kept-open cpu.stat descriptor, cumulative throttled ns or -1 before the first).
        self._throttled: dict[str, tuple[int, int]] = {}
        self._lists: dict[str, int] = {}  # path -> kept-open descriptor, or -1
        self._threads: dict[int, tuple[int, int, int]] = {}  # tid -> (descriptor or -1, run ns, wait ns)
        self._last: int | None = None
        self.watch(directories)

    def watch(self, directories: Iterable[str]) -> None:
        """Follow these directories' thread lists (the workload first, then its descendants, as found now)."""
        directories = list(directories)
        wanted = {f"{directory}/{self.list_name}" for directory in directories}
        for path in self._lists.keys() - wanted:
            self._close_list(path)
        descendants = set(directories[1:])  # the first is the workload: its own cpu.stat is read already
        for directory in self._throttled.keys() - descendants:
            os.close(self._throttled.pop(directory)[0])
        for directory in descendants - self._throttled.keys():
            try:
                self._throttled[directory] = (os.open(f"{directory}/cpu.stat", _OPEN_FLAGS), -1)
            except OSError as exc:
                if exc.errno not in _GONE:
                    raise
        for path in wanted - self._lists.keys():
            fd = -1
            if self._keep_lists:
                try:
                    fd = os.open(path, _OPEN_FLAGS)
                except OSError as exc:
                    if exc.errno not in _GONE:
                        raise
                    continue
            self._lists[path] = fd

    def _close_list(self, path: str) -> None:
        fd = self._lists.pop(path)
        if fd >= 0:
            os.close(fd)

    def _tids(self) -> set[int]:
        tids: set[int] = set()
        for path, fd in list(self._lists.items()):
            try:
                if fd >= 0:
                    data = _pread_all(fd)
                else:
                    with open(path, "rb") as handle:
                        data = handle.read()
            except OSError as exc:
                if exc.errno not in _GONE:
                    raise
                self._close_list(path)  # a container that left
                continue
            tids.update(int(tid) for tid in data.split())
        return tids

    def sample(self) -> Waits | None:
        """The waits since the last call; None on the first (or after ``pause``)."""
        now = self._clock()
        tids = self._tids()
        for tid in self._threads.keys() - tids:
            self._forget(tid)
        last = self._last
        interval = 0 if last is None else now - last
        waited = starved = 0
        for tid in tids:
            held = self._threads.get(tid)
            read = self._read(tid, held[0] if held is not None else -1)
            if read is None:
                if held is not None:
                    self._forget(tid)
                continue
            fd, run, wait = read
            if held is not None and run >= held[1] and wait >= held[2]:
                ran, queued = run - held[1], wait - held[2]
                waited += queued
                if interval > 0 and ran + queued >= ALWAYS_RUNNABLE * interval:
                    starved += queued
            self._threads[tid] = (fd, run, wait)
        self._last = now
        throttled = self._descendants_throttled()
        return None if last is None else Waits(waited, starved, interval, throttled)

    def _descendants_throttled(self) -> int:
        """Nanoseconds the descendants' own limits throttled them since the last call."""
        total = 0
        for directory, (fd, before) in list(self._throttled.items()):
            try:
                text = os.pread(fd, 4096, 0)
            except OSError:
                os.close(self._throttled.pop(directory)[0])  # a container that left
                continue
            start = text.find(self._throttled_key)
            if start < 0:
                continue
            value = text[start + len(self._throttled_key) :].split(maxsplit=1)
            if value and value[0].isdigit():
                now = int(value[0]) * self._throttled_ns
                if 0 <= before <= now:
                    total += now - before
                self._throttled[directory] = (fd, now)
        return total

    def pause(self) -> None:
        """Stop following the threads (an idle workload): the next sample starts afresh."""
        if self._threads:
            for tid in list(self._threads):
                self._forget(tid)
        self._last = None

    def _read(self, tid: int, fd: int) -> tuple[int, int, int] | None:
        path = f"{self.proc_root}/{tid}/schedstat"
        try:
            if fd < 0 and TaskWait.kept_open < MAX_KEPT_OPEN:
                fd = os.open(path, _OPEN_FLAGS)
                TaskWait.kept_open += 1
            if fd >= 0:
                text = os.pread(fd, 128, 0)
            else:
                with open(path, "rb") as handle:
                    text = handle.read(128)
        except OSError as exc:
            if exc.errno in _GONE:
                return None  # the thread exited between the list and the read
            raise
        fields = text.split()
        if len(fields) < 2:
            return None
        return fd, int(fields[0]), int(fields[1])

    def _forget(self, tid: int) -> None:
        fd, _, _ = self._threads.pop(tid)
        if fd >= 0:
            os.close(fd)
            TaskWait.kept_open -= 1

    def close(self) -> None:
        self.pause()
        for path in list(self._lists):
            self._close_list(path)
        for fd, _ in self._throttled.values():
            os.close(fd)
        self._throttled.clear()


def subtree(directory: str, depth: int = 3) -> list[str]:
    """The directory and its descendants down to ``depth`` levels (pod, container, crun's subgroup)."""
    found = [directory]
    if depth == 0:
        return found
    try:
        with os.scandir(directory) as entries:
            children = sorted(e.path for e in entries if e.is_dir(follow_symlinks=False))
    except OSError:
        return found
    for child in children:
        found += subtree(child, depth - 1)
    return found


def _pread_all(fd: int) -> bytes:
    chunks: list[bytes] = []
    offset = 0
    while chunk := os.pread(fd, 65536, offset):
        chunks.append(chunk)
        offset += len(chunk)
    return b"".join(chunks)
