"""The single writer of cgroup files.

Every write nodeguard makes to a cgroup goes through ``CgroupWriter.write``:
it accepts only the files of the registered levers and of eviction, refuses any path that resolves
outside the hierarchy root (symlinks, ``..``, odd workload names), and in dry
run logs the exact write instead of making it.
"""

from __future__ import annotations

import errno
import os
from collections import Counter
from dataclasses import dataclass, field

from nodeguard.actuators.levers import lever_files
from nodeguard.errors import ActuationRefused, CgroupGone
from nodeguard.log import get_logger

log = get_logger("nodeguard.writer")

EVICTION_FILES = frozenset({"cgroup.freeze", "cgroup.kill"})
_GONE = frozenset({errno.ENOENT, errno.ENODEV, errno.ESTALE})
# Refusals that mean nodeguard cannot write at all (not root, a read-only mount), not one workload's trouble.
_NOT_PERMITTED = frozenset({errno.EACCES, errno.EPERM, errno.EROFS})


@dataclass
class WriteCounters:
    writes: int = 0
    dry_run_writes: int = 0
    skipped_unchanged: int = 0
    drift: int = 0  # values of nodeguard's someone put back to the original, re-asserted (any lever)
    # Values of nodeguard's another owner changed (kubelet, the runtime, systemd), by lever: re-asserted, or taken
    # as a new original (a resize).
    overwritten: Counter[str] = field(default_factory=Counter)
    refused: int = 0
    errors: Counter[str] = field(default_factory=Counter)  # by errno name


def writable_files() -> frozenset[str]:
    """The allow-list: what the registered levers write, and eviction's files."""
    return lever_files() | EVICTION_FILES


class CgroupWriter:
    def __init__(self, root: str, dry_run: bool = False) -> None:
        self.files = writable_files()
        self.root = os.path.realpath(root)
        self.dry_run = dry_run
        self.counters = WriteCounters()
        self._refused: str | None = None  # the last write refused for want of permission, until one succeeds

    def path_of(self, workload_id: str, filename: str) -> str:
        """The checked absolute path of a cgroup file, or ActuationRefused."""
        if filename not in self.files:
            self.counters.refused += 1
            raise ActuationRefused(f"nodeguard never writes {filename!r}")
        return os.path.join(self.dir_of(workload_id), filename)

    def dir_of(self, workload_id: str) -> str:
        """The checked absolute path of a cgroup directory, or ActuationRefused."""
        if not workload_id or workload_id.startswith("/") or "\x00" in workload_id:
            self.counters.refused += 1
            raise ActuationRefused(f"bad workload path {workload_id!r}")
        directory = os.path.realpath(os.path.join(self.root, workload_id))
        if os.path.commonpath([self.root, directory]) != self.root or directory == self.root:
            self.counters.refused += 1
            raise ActuationRefused(f"{workload_id!r} resolves to {directory}, outside the cgroup root {self.root}")
        return directory

    def read(self, workload_id: str, filename: str) -> str:
        path = self.path_of(workload_id, filename)
        try:
            with open(path, encoding="ascii") as handle:
                return handle.read().strip()
        except OSError as exc:
            if exc.errno in _GONE:
                raise CgroupGone(path) from None
            raise

    def exists(self, workload_id: str) -> bool:
        """Whether the group's directory is there (a checked path, like every read and write)."""
        return os.path.isdir(self.dir_of(workload_id))

    def write(self, workload_id: str, filename: str, value: str, **context: object) -> bool:
        """Write ``value``; True when written (or logged, in dry run). Kernel refusals raise OSError."""
        path = self.path_of(workload_id, filename)
        if self.dry_run:
            self.counters.dry_run_writes += 1
            log.info("dry run: would write", path=path, value=value, **context)
            return True
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CLOEXEC)
            try:
                os.write(fd, value.encode("ascii"))
            finally:
                os.close(fd)
        except OSError as exc:
            self._count_error(exc, path)
            if exc.errno in _GONE:
                raise CgroupGone(path) from None
            raise
        self._refused = None
        self.counters.writes += 1
        log.debug("wrote", path=path, value=value, **context)
        return True

    def problem(self) -> str | None:
        """Why writes fail (permission refused, read-only) since the last one that succeeded; None if they work."""
        return self._refused

    def _count_error(self, exc: OSError, path: str) -> None:
        name = errno.errorcode.get(exc.errno or 0, str(exc.errno))
        self.counters.errors[name] += 1
        if exc.errno in _NOT_PERMITTED:
            self._refused = f"cgroup writes refused: {name} ({exc.strerror}) writing {path}"
