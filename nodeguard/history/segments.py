"""The history's files: lines appended in order to a few files that together stay within a size bound.

Files are named ``history-NNNNNNNNNN.jsonl``, numbered in the order written.
Lines go to the newest; a line that would take it past its share of the
bound (``maxBytes / files``) starts the next file, and before anything is
written the oldest files are deleted until the write fits within
``maxBytes`` with every file left. So the files never take more than
``maxBytes`` together, whatever happens: a crash leaves at most what was
written, and a bound made smaller since the last run deletes the oldest
files first. Older history is never rewritten: files are only appended to
(the newest) or deleted whole (the oldest); nothing else in the directory is
touched. A line a crash cut short is ended with a newline before the next
one, so it stays one malformed line, which readers skip and count.

Writes are not fsynced one by one: the kernel writes them back within its
own period (about 30 s), so a power loss may lose the last lines of that
time, and a crash of the daemon alone loses nothing written. A file is
fsynced when it is full, and at close.
"""

from __future__ import annotations

import contextlib
import os
import re
from collections.abc import Iterable

FILE_NAME = re.compile(r"history-(\d{10})\.jsonl")
FILE_MODE = 0o640
DIR_MODE = 0o750


def file_name(number: int) -> str:
    return f"history-{number:010d}.jsonl"


def history_files(directory: str) -> list[tuple[int, str]]:
    """The history's regular files in ``directory``, oldest first, by number; none when it does not exist."""
    try:
        names = os.listdir(directory)
    except (FileNotFoundError, NotADirectoryError):
        return []
    found = []
    for name in names:
        match = FILE_NAME.fullmatch(name)
        if match is None:
            continue
        path = os.path.join(directory, name)
        with contextlib.suppress(OSError):
            if os.path.isfile(path) and not os.path.islink(path):
                found.append((int(match.group(1)), path))
    return sorted(found)


class OverBound(OSError):
    """The oldest file cannot be deleted: writing would take the history past its bound."""


class Segments:
    """Appends lines to the history's files, the oldest deleted to keep them within ``max_bytes``."""

    def __init__(self, directory: str, max_bytes: int, file_bytes: int) -> None:
        assert 0 < file_bytes <= max_bytes
        self.directory = directory
        self.max_bytes = max_bytes
        self.file_bytes = file_bytes
        self.sizes: dict[int, int] = {}  # file number -> bytes, oldest first; the last one is written to
        self.fd: int | None = None
        self.torn = False  # the newest file ends in a line cut short: end it before writing the next
        self.deleted = 0  # files deleted to stay within the bound
        self.too_large = 0  # lines longer than a file: not written

    @property
    def total(self) -> int:
        return sum(self.sizes.values())

    def open(self) -> None:
        """Find the files, keep the bound (a smaller one than last time deletes the oldest) and open the newest."""
        os.makedirs(self.directory, mode=DIR_MODE, exist_ok=True)
        self.sizes = {number: os.stat(path).st_size for number, path in history_files(self.directory)}
        if not self.sizes:
            self._start(1)
            return
        newest = max(self.sizes)
        self.fd = os.open(self._path(newest), os.O_RDWR | os.O_APPEND | os.O_NOFOLLOW | os.O_CLOEXEC)
        size = self.sizes[newest] = os.fstat(self.fd).st_size
        self.torn = size > 0 and os.pread(self.fd, 1, size - 1) != b"\n"
        if size >= self.file_bytes:
            self._next()
        self._make_room(0)

    def _path(self, number: int) -> str:
        return os.path.join(self.directory, file_name(number))

    def _start(self, number: int) -> None:
        flags = os.O_RDWR | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC
        self.fd = os.open(self._path(number), flags, FILE_MODE)
        self.sizes[number] = os.fstat(self.fd).st_size
        self.torn = False

    def _next(self) -> None:
        """Close the newest file (fsynced: it is complete) and start the next."""
        number = max(self.sizes)
        self._close_file()
        self._start(number + 1)

    def _make_room(self, size: int) -> None:
        """Delete the oldest files until ``size`` more bytes fit within the bound (the newest is kept)."""
        while self.total + size > self.max_bytes and len(self.sizes) > 1:
            oldest = min(self.sizes)
            try:
                os.unlink(self._path(oldest))
            except FileNotFoundError:
                pass
            except OSError as exc:
                raise OverBound(exc.errno, f"cannot delete the oldest history file: {exc.strerror}") from exc
            del self.sizes[oldest]
            self.deleted += 1
        if self.total + size > self.max_bytes:
            raise OverBound(f"{size} bytes do not fit within {self.max_bytes}")

    def append(self, lines: Iterable[bytes]) -> int:
        """Write lines (each ending in a newline) in order; how many were written. OSError when the file system
        refuses: what was written stays, and the next write starts on a line of its own."""
        if self.fd is None:
            self.open()
        chunk = bytearray()
        written = 0
        for line in lines:
            if len(line) + 1 > self.file_bytes:
                self.too_large += 1
                continue
            newest = max(self.sizes)
            if self.sizes[newest] + self.torn + len(chunk) + len(line) > self.file_bytes:
                self._write(chunk)
                chunk.clear()
                self._next()
            chunk += line
            written += 1
        self._write(chunk)
        return written

    def _write(self, chunk: bytes | bytearray) -> None:
        if not chunk:
            return
        assert self.fd is not None
        data = b"\n" + chunk if self.torn else bytes(chunk)
        self._make_room(len(data))
        newest = max(self.sizes)
        view = memoryview(data)
        try:
            while view:
                view = view[os.write(self.fd, view) :]
        except OSError:
            self.torn = True  # part of a line may be there: the next write starts on a new line
            with contextlib.suppress(OSError):
                self.sizes[newest] = os.fstat(self.fd).st_size
            raise
        self.sizes[newest] += len(data)
        self.torn = False

    def sync(self) -> None:
        if self.fd is not None:
            os.fsync(self.fd)

    def _close_file(self) -> None:
        if self.fd is None:
            return
        fd, self.fd = self.fd, None
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    def close(self) -> None:
        self._close_file()
