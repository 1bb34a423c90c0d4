"""Small state files that survive a crash at any moment: written whole or not at all."""

from __future__ import annotations

import contextlib
import os
import time


def write_atomic(path: str, data: bytes, mode: int = 0o600) -> None:
    """Write to a temporary file beside ``path``, fsync, rename over it, fsync the directory.

    A crash leaves either the old file or the new one, never a mix.
    """
    directory = os.path.dirname(path) or "."
    tmp = os.path.join(directory, f".{os.path.basename(path)}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, mode)
    try:
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view) :]
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    dir_fd = os.open(directory, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


def set_aside(path: str) -> str:
    """Rename an unreadable file out of the way (never delete it) and return its new name."""
    aside = f"{path}.corrupt-{int(time.time())}"
    os.replace(path, aside)
    return aside
