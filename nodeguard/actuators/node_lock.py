"""One nodeguard acts on a node: an exclusive lock on the cgroup hierarchy it writes.

The lock is a ``flock`` on the hierarchy's root directory itself, not on a
file beside the ledger: a systemd unit and a DaemonSet pod (which mounts the
host's ``/sys/fs/cgroup``) see the same directory whatever their ledger paths,
and nobody can delete it. The kernel drops the lock when the holder exits,
however it exits. /proc/locks names the holder.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
from collections.abc import Iterator
from pathlib import Path

from nodeguard.errors import NodeguardError


class NodeBusy(NodeguardError):
    """Another nodeguard process acts on this node."""


def _locker(info: os.stat_result, proc_root: str) -> int | None:
    """The pid of another process that holds a flock on the file ``info`` describes, as /proc/locks tells."""
    inode = f"{os.major(info.st_dev):02x}:{os.minor(info.st_dev):02x}:{info.st_ino}"
    try:
        lines = Path(proc_root, "locks").read_text().splitlines()
    except OSError:
        return None
    for line in lines:
        fields = line.split()
        # "1: FLOCK  ADVISORY  WRITE 32683 00:1d:1 0 EOF"; a blocked waiter's line has "->" first
        if len(fields) >= 6 and fields[1] == "FLOCK" and fields[5] == inode and fields[4].isdigit():
            pid = int(fields[4])
            if pid != os.getpid() and pid != 0:
                return pid
    return None


def _holder(directory_fd: int, proc_root: str) -> str:
    """Who holds a flock on the directory: "pid N (command line)", as well as /proc/locks tells."""
    if not Path(proc_root, "locks").exists():
        return "another process"
    pid = _locker(os.fstat(directory_fd), proc_root)
    if pid is None:
        return "another process (not visible from here)"
    try:
        raw = Path(proc_root, str(pid), "cmdline").read_bytes()
        command = raw.replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        command = "?"
    return f"pid {pid} ({command})"


def holder_pid(path: str, proc_root: str = "/proc") -> int | None:
    """The pid of another process holding a flock on ``path`` (None: nobody, or not visible); takes no lock."""
    return _locker(os.stat(path), proc_root) if os.path.exists(path) else None


def holder(root: str, proc_root: str = "/proc") -> str:
    """Who holds the node's lock now, as /proc/locks tells ("pid N (command line)")."""
    fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        return _holder(fd, proc_root)
    finally:
        os.close(fd)


def lock_node(root: str, proc_root: str = "/proc") -> int:
    """Take the node's lock: the descriptor that holds it (closing it lets go); NodeBusy naming the holder."""
    fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        busy = NodeBusy(f"another nodeguard acts on this node: {_holder(fd, proc_root)} holds the lock on {root}")
        os.close(fd)
        raise busy from None
    except BaseException:
        os.close(fd)
        raise
    return fd


@contextlib.contextmanager
def hold_node(root: str, proc_root: str = "/proc") -> Iterator[None]:
    """Hold the node's lock for the ``with`` block; NodeBusy naming the holder when another has it."""
    fd = lock_node(root, proc_root)
    try:
        yield
    finally:
        os.close(fd)
