"""State files written and read without trusting their directory: real files, symlinks, FIFOs, sparse giants."""

from __future__ import annotations

import os
import stat
import time
from pathlib import Path

import pytest

from nodeguard.atomic_file import UnsafeFile, open_lock_file, read_regular_file, read_state_file, write_atomic


def test_a_symlink_planted_at_the_temporary_name_is_not_written_through(tmp_path: Path) -> None:
    """A symlink at the temporary name the writer used to use (.NAME.PID.tmp) does not redirect the write."""
    victim = tmp_path / "victim"
    victim.write_text("precious")
    state = tmp_path / "state.json"
    (tmp_path / f".state.json.{os.getpid()}.tmp").symlink_to(victim)
    write_atomic(str(state), b"new state")
    assert victim.read_text() == "precious"
    assert state.read_bytes() == b"new state" and not state.is_symlink()
    assert stat.S_IMODE(state.stat().st_mode) == 0o600


def test_a_symlink_at_the_target_is_replaced_not_followed(tmp_path: Path) -> None:
    """Writing over a path that is a symlink replaces the link; the file it pointed to is untouched."""
    victim = tmp_path / "victim"
    victim.write_text("precious")
    state = tmp_path / "state.json"
    state.symlink_to(victim)
    write_atomic(str(state), b"mine")
    assert victim.read_text() == "precious" and state.read_bytes() == b"mine" and not state.is_symlink()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["state.json", "victim"]  # no temporary left


def test_state_reads_refuse_symlinks_fifos_directories_and_giants(tmp_path: Path) -> None:
    """read_state_file reads a regular file and refuses, at once and unread, a symlink, a FIFO, a directory and an oversized file."""
    good = tmp_path / "good"
    good.write_bytes(b"{}")
    good.chmod(0o600)
    assert read_state_file(str(good), 16) == b"{}"
    link = tmp_path / "link"
    link.symlink_to(good)
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    giant = tmp_path / "giant"
    with giant.open("wb") as handle:
        handle.truncate(1 << 40)  # sparse: a terabyte that would take hours to read
    giant.chmod(0o600)
    started = time.monotonic()
    expected = {link: "symbolic link", fifo: "a FIFO", tmp_path: "a directory", giant: "more than the"}
    for path, reason in expected.items():
        with pytest.raises(UnsafeFile) as caught:
            read_state_file(str(path), 1 << 20)
        assert reason in str(caught.value), caught.value
    assert time.monotonic() - started < 5  # nothing blocked, nothing was read in full
    with pytest.raises(FileNotFoundError):
        read_state_file(str(tmp_path / "absent"), 16)


def test_config_reads_follow_symlinks_to_regular_files_only(tmp_path: Path) -> None:
    """A config read follows a symlink (config maps are symlinks) but refuses one that ends at a FIFO."""
    target = tmp_path / "config.json"
    target.write_text("{}")
    link = tmp_path / "link.json"
    link.symlink_to(target)
    assert read_regular_file(str(link), 16) == b"{}"
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    (tmp_path / "to-fifo").symlink_to(fifo)
    with pytest.raises(UnsafeFile, match="FIFO"):
        read_regular_file(str(tmp_path / "to-fifo"), 16)


def test_lock_files_are_never_opened_through_symlinks_or_as_fifos(tmp_path: Path) -> None:
    """open_lock_file creates a regular lock file, and refuses a planted symlink (its target untouched) or a FIFO."""
    fd = open_lock_file(str(tmp_path / "ledger.json.lock"))
    os.close(fd)
    assert (tmp_path / "ledger.json.lock").is_file()
    victim = tmp_path / "victim"
    (tmp_path / "planted.lock").symlink_to(victim)
    with pytest.raises(UnsafeFile, match="symbolic link"):
        open_lock_file(str(tmp_path / "planted.lock"))
    assert not victim.exists()
    os.mkfifo(tmp_path / "fifo.lock")
    with pytest.raises(UnsafeFile, match="FIFO"):
        open_lock_file(str(tmp_path / "fifo.lock"))
