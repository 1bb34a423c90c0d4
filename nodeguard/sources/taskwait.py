"""How long a cgroup's threads waited to run: the run-queue delay in ``/proc/<tid>/schedstat``.

cgroup v1 has no per-cgroup CPU pressure, so the wait is summed over the
threads of the workload's subtree (the ``tasks`` files list them): the second
field of each thread's schedstat is the nanoseconds it was runnable but not
running. The sum of a tick's deltas, divided by the tick, is in cores: how
much more CPU the workload would have used had it been given it (with CFS
bandwidth throttling counted too: a throttled thread is runnable).

The threads' schedstat descriptors are kept open (the kernel regenerates the
text on every pread); the ``tasks`` lists are opened afresh each time, as v1
caches a list per open file for a second and a kept-open one goes stale. A
thread first seen contributes from its second tick on, so a new thread's whole
life is never counted as one tick's wait.
"""

from __future__ import annotations

import errno
import os
from collections.abc import Iterable

_OPEN_FLAGS = os.O_RDONLY | os.O_CLOEXEC
_GONE = frozenset({errno.ENOENT, errno.ESRCH, errno.ENODEV})
# Kept-open thread descriptors across all workloads; past this, threads are opened per read.
MAX_KEPT_OPEN = 4096


class TaskWait:
    """Sum of the run-queue waits of the threads in a set of cgroup directories, per call."""

    kept_open = 0  # across all instances

    def __init__(self, directories: Iterable[str], proc_root: str = "/proc") -> None:
        self.proc_root = proc_root
        self._lists: list[str] = []
        self._threads: dict[int, tuple[int, int]] = {}  # tid -> (descriptor or -1, last wait in ns)
        self.watch(directories)

    def watch(self, directories: Iterable[str]) -> None:
        """Follow these directories' ``tasks`` files (the workload and its descendants, as found now)."""
        self._lists = [f"{directory}/tasks" for directory in directories]

    def _tids(self) -> set[int]:
        tids: set[int] = set()
        for path in list(self._lists):
            try:
                with open(path, "rb") as handle:
                    data = handle.read()
            except OSError as exc:
                if exc.errno not in _GONE:
                    raise
                self._lists.remove(path)  # a container that left
                continue
            tids.update(int(tid) for tid in data.split())
        return tids

    def waited_ns(self) -> int:
        """Nanoseconds the threads waited since the last call (0 on the first)."""
        tids = self._tids()
        for tid in self._threads.keys() - tids:
            self._forget(tid)
        total = 0
        for tid in tids:
            held = self._threads.get(tid)
            wait = self._read(tid, held[0] if held is not None else -1)
            if wait is None:
                if held is not None:
                    self._forget(tid)
                continue
            fd, value = wait
            if held is not None and value >= held[1]:
                total += value - held[1]
            self._threads[tid] = (fd, value)
        return total

    def _read(self, tid: int, fd: int) -> tuple[int, int] | None:
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
        return fd, int(fields[1]) if len(fields) > 1 else 0

    def _forget(self, tid: int) -> None:
        fd, _ = self._threads.pop(tid)
        if fd >= 0:
            os.close(fd)
            TaskWait.kept_open -= 1

    def close(self) -> None:
        for tid in list(self._threads):
            self._forget(tid)
        self._lists.clear()


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

