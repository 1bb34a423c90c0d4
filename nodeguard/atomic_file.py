"""Small state files that survive a crash at any moment, written and read without trusting their directory.

Writes go to a fresh temporary file (``O_EXCL | O_NOFOLLOW``: never an existing
file, never through a symlink someone planted), then are renamed over the
target (a rename replaces a symlink at the target, it does not follow it).
Reads of state files never follow a symlink, never block on a FIFO or device,
refuse files larger than asked and files another user could have written.
"""

from __future__ import annotations

import contextlib
import errno
import os
import secrets
import stat
import time

from nodeguard.errors import NodeguardError

_TEMP_ATTEMPTS = 8


class UnsafeFile(NodeguardError):
    """A file that is not read: not a regular file, a symlink, too large, or writable by someone else."""

    def __init__(self, path: str, reason: str) -> None:
        super().__init__(f"{path}: {reason}")
        self.path = path
        self.reason = reason


def boot_id() -> str | None:
    """The kernel's boot id: a state file that records it is known to be of this boot (None where unknown)."""
    try:
        with open("/proc/sys/kernel/random/boot_id", encoding="ascii") as handle:
            return handle.read().strip() or None
    except OSError:
        return None


def write_atomic(path: str, data: bytes, mode: int = 0o600, *, durable: bool = True) -> None:
    """Write to a new temporary file beside ``path``, fsync, rename over it, fsync the directory.

    A crash leaves either the old file or the new one, never a mix. ``durable``
    False skips the fsyncs: the file survives a crash of the process (the page
    cache holds it), not one of the machine; for state that records the boot id
    and is distrusted after a reboot anyway.
    """
    directory = os.path.dirname(path) or "."
    fd, tmp = _create_temporary(directory, os.path.basename(path), mode)
    try:
        try:
            os.fchmod(fd, mode)  # the umask may have taken bits away; the caller's mode is the one meant
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view) :]
            if durable:
                os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    if not durable:
        return
    dir_fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


def _create_temporary(directory: str, base: str, mode: int) -> tuple[int, str]:
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
    for _ in range(_TEMP_ATTEMPTS):
        tmp = os.path.join(directory, f".{base}.{os.getpid()}.{secrets.token_hex(6)}.tmp")
        try:
            return os.open(tmp, flags, mode), tmp
        except FileExistsError:  # a name someone else took (or planted): pick another
            continue
    raise FileExistsError(errno.EEXIST, f"no free temporary name in {directory} after {_TEMP_ATTEMPTS} attempts")


def read_state_file(path: str, max_bytes: int) -> bytes:
    """The bytes of a state file nodeguard wrote itself.

    FileNotFoundError if there is none; UnsafeFile if it is a symlink, not a
    regular file, larger than ``max_bytes``, or owned (or writable) by a user
    other than root and this process's; OSError otherwise.
    """
    return read_regular_file(path, max_bytes, follow_symlinks=False, own_only=True)


def read_regular_file(path: str, max_bytes: int, *, follow_symlinks: bool = True, own_only: bool = False) -> bytes:
    """The bytes of a regular file, opened so that a FIFO, socket or device never blocks or is read.

    ``follow_symlinks`` False refuses a symlink (a config map's mounted files
    are symlinks, state files never are). ``own_only`` refuses files whose
    owner is not root or this process's user, or that others may write.
    """
    try:
        before = os.stat(path, follow_symlinks=follow_symlinks)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise UnsafeFile(path, "too many levels of symbolic links") from None
        raise
    _check(path, before, max_bytes, own_only)
    flags = os.O_RDONLY | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC | (0 if follow_symlinks else os.O_NOFOLLOW)
    try:
        fd = os.open(path, flags)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise UnsafeFile(path, "is a symbolic link; state files are never read through one") from None
        raise
    try:
        found = os.fstat(fd)
        _check(path, found, max_bytes, own_only)  # what was opened, not what was looked at before
        chunks, size = [], 0
        while size <= max_bytes:
            chunk = os.read(fd, min(1 << 20, max_bytes + 1 - size))
            if not chunk:
                break
            chunks.append(chunk)
            size += len(chunk)
    finally:
        os.close(fd)
    if size > max_bytes:
        raise UnsafeFile(path, f"larger than {max_bytes} bytes; not read")
    return b"".join(chunks)


def open_lock_file(path: str, mode: int = 0o640) -> int:
    """A descriptor of the lock file at ``path``, created if missing; never through a symlink, never a FIFO or device.

    The caller flocks it and closes it. UnsafeFile if ``path`` is not a regular file.
    """
    flags = os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC
    try:
        fd = os.open(path, flags, mode)
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise UnsafeFile(path, "is a symbolic link; a lock file is never opened through one") from None
        raise
    found = os.fstat(fd)
    if not stat.S_ISREG(found.st_mode):
        os.close(fd)
        raise UnsafeFile(path, f"is not a regular file ({_kind(found.st_mode)})")
    return fd


def _check(path: str, found: os.stat_result, max_bytes: int, own_only: bool) -> None:
    if stat.S_ISLNK(found.st_mode):
        raise UnsafeFile(path, "is a symbolic link; state files are never read through one")
    if not stat.S_ISREG(found.st_mode):
        raise UnsafeFile(path, f"is not a regular file ({_kind(found.st_mode)}); not read")
    if found.st_size > max_bytes:
        raise UnsafeFile(path, f"is {found.st_size} bytes, more than the {max_bytes} allowed; not read")
    if own_only:
        if found.st_uid not in (0, os.geteuid()):
            raise UnsafeFile(path, f"belongs to uid {found.st_uid}, not to nodeguard's user; not trusted")
        if found.st_mode & 0o022:
            raise UnsafeFile(path, f"is writable by others (mode {stat.S_IMODE(found.st_mode):04o}); not trusted")


def _kind(mode: int) -> str:
    for test, name in (
        (stat.S_ISDIR, "a directory"),
        (stat.S_ISFIFO, "a FIFO"),
        (stat.S_ISSOCK, "a socket"),
        (stat.S_ISCHR, "a character device"),
        (stat.S_ISBLK, "a block device"),
    ):
        if test(mode):
            return name
    return f"mode {mode:o}"


def set_aside(path: str) -> str:
    """Rename an unreadable file out of the way (never delete it) and return its new name."""
    aside = _aside_name(path)
    os.replace(path, aside)
    return aside


def keep_copy(path: str, max_bytes: int = 64 << 20) -> str:
    """Copy a partly unreadable state file aside (the original stays, to be rewritten); return the copy's name."""
    aside = _aside_name(path)
    write_atomic(aside, read_state_file(path, max_bytes))
    return aside


def _aside_name(path: str) -> str:
    base = f"{path}.corrupt-{int(time.time())}"
    aside, n = base, 1
    while os.path.lexists(aside):  # two in the same second: keep both
        aside, n = f"{base}-{n}", n + 1
    return aside
