"""The ledger of originals: atomic, first original kept, each entry checked alone, never stranding a throttle."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from nodeguard.actuators.ledger import Ledger, LedgerEntry, LedgerUnsaved, LimitRecord, Ownership, entry
from nodeguard.actuators.node_lock import NodeBusy, hold_node
from nodeguard.model.samples import CpuMax

UNLIMITED = CpuMax(None)


def good(workload: str, original: str = "max 100000", applied: str = "20000 100000") -> dict[str, object]:
    return {"workload_id": workload, "cgroup_version": "v2", "original": original, "applied": applied,
            "reason": "cpu_total_usage", "changed_at": 1.0}


def test_round_trip_and_first_original_wins(tmp_path: Path) -> None:
    """Saved entries load back; re-throttling keeps the very first original, of the workload and its children."""
    path = str(tmp_path / "run/ledger.json")
    ledger = Ledger.load(path)
    child = {"a/c": LimitRecord(original="150000 100000", applied="50000 100000")}
    ledger.record(entry("a", "v1", UNLIMITED, CpuMax(50000), "r", children=child))
    lower = {"a/c": LimitRecord(original="50000 100000", applied="20000 100000")}
    ledger.record(entry("a", "v1", CpuMax(50000), CpuMax(20000), "r", children=lower))
    ledger.record(entry("b", "v1", CpuMax(80000), CpuMax(20000), "r"))
    ledger.save()
    again = Ledger.load(path)
    assert again.entries["a"].original == "max 100000"
    assert again.entries["a"].applied == "20000 100000"
    assert again.entries["a"].children["a/c"] == LimitRecord(original="150000 100000", applied="20000 100000")
    assert set(again.entries) == {"a", "b"}
    assert [p.name for p in (tmp_path / "run").iterdir()] == ["ledger.json"], "temporary files are renamed, not left behind"


def test_an_entry_without_children_reads_as_before(tmp_path: Path) -> None:
    """A ledger written before children existed loads unchanged, and is written back in the same shape."""
    path = tmp_path / "ledger.json"
    path.write_text(json.dumps({"version": 1, "entries": [good("a")]}))
    ledger = Ledger.load(str(path))
    assert ledger.entries["a"].children == {} and ledger.rejected is None
    ledger.save()
    assert "children" not in json.loads(path.read_text())["entries"][0]


@pytest.mark.parametrize(
    "content",
    [
        b"{not json",
        json.dumps({"version": 99, "entries": []}).encode(),
        json.dumps({"version": 1, "entries": {"a": 1}}).encode(),
        b'{"version": 1, "entries": [\xff\xfe]}',  # not UTF-8
        b"[" * 100_000,  # nested past the parser's recursion limit
    ],
)
def test_unreadable_ledger_is_kept_aside(tmp_path: Path, content: bytes) -> None:
    """A ledger that cannot be read at all is renamed (not deleted) and the daemon starts empty."""
    path = tmp_path / "ledger.json"
    path.write_bytes(content)
    ledger = Ledger.load(str(path))
    assert ledger.entries == {}
    assert ledger.set_aside is not None and Path(ledger.set_aside).read_bytes() == content
    assert not path.exists()


@pytest.mark.parametrize(
    "bad",
    [
        {**good("bad"), "original": "abc"},
        {**good("bad"), "applied": "1 0"},
        {**good("bad"), "changed_at": "yesterday"},
        {**good("bad"), "cgroup_version": "v3"},
        {**good("bad"), "children": {"bad/c": {"original": "nope", "applied": "1000 100000"}}},
        {"x": 1},
        "not an object",
        good("a"),  # a duplicate of a good entry
    ],
)
def test_a_bad_entry_is_set_aside_alone(tmp_path: Path, bad: object) -> None:
    """One entry that fails its checks goes to a side file; every good entry is kept, to be restored."""
    path = tmp_path / "ledger.json"
    path.write_text(json.dumps({"version": 1, "entries": [good("a"), bad, good("b", original="150000 100000")]}))
    ledger = Ledger.load(str(path))
    assert set(ledger.entries) == {"a", "b"}
    assert ledger.entries["b"].original_limit == CpuMax(150000)
    assert ledger.set_aside is None and ledger.rejected is not None
    assert json.loads(Path(ledger.rejected).read_text())["entries"] == [bad], "the rejected entry is kept, not lost"


def test_ledger_behind_a_symlink_or_a_fifo_is_not_followed(tmp_path: Path) -> None:
    """A symlink planted at the ledger path is not followed, and a FIFO there does not hang the load."""
    target = tmp_path / "elsewhere.json"
    target.write_text(json.dumps({"version": 1, "entries": [good("a")]}))
    link = tmp_path / "ledger.json"
    link.symlink_to(target)
    ledger = Ledger.load(str(link))
    assert ledger.entries == {} and ledger.set_aside == str(link)
    fifo = tmp_path / "fifo.json"
    os.mkfifo(fifo)
    assert Ledger.load(str(fifo)).entries == {}


def test_ownership_tells_ours_from_a_reset_and_a_resize() -> None:
    """The recorded values tell nodeguard's own limit, the original put back, and a new limit apart."""
    record = LimitRecord(original="150000 100000", applied="50000 100000", pending="40000 100000")
    assert record.ownership(CpuMax(50000)) is Ownership.OURS
    assert record.ownership(CpuMax(40000)) is Ownership.OURS
    assert record.ownership(CpuMax(150000)) is Ownership.ORIGINAL
    assert record.ownership(CpuMax(120000)) is Ownership.MOVED


@pytest.fixture
def full_tmpfs(tmp_path: Path) -> Iterator[Path]:
    """A 64 KiB tmpfs, filled up."""
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    mount = tmp_path / "small"
    mount.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(mount)], check=True)
    try:
        with open(mount / "filler", "wb") as filler, contextlib.suppress(OSError):
            filler.write(b"x" * (1 << 20))
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=True)


def test_a_full_filesystem_raises_a_clear_error_and_keeps_memory(full_tmpfs: Path) -> None:
    """Saving onto a full filesystem names the file and errno; the in-memory entries stay as they were."""
    ledger = Ledger(str(full_tmpfs / "ledger.json"))
    ledger.record(LedgerEntry(original="max 100000", applied="1000 100000", workload_id="a"))
    with pytest.raises(LedgerUnsaved) as raised:
        ledger.save()
    assert raised.value.errno_name == "ENOSPC" and str(full_tmpfs / "ledger.json") in str(raised.value)
    assert set(ledger.entries) == {"a"}
    assert sorted(p.name for p in full_tmpfs.iterdir()) == ["filler"], "no temporary file left behind"


def test_one_nodeguard_per_node_whatever_its_paths(tmp_path: Path) -> None:
    """A second holder of the node is refused and told which process holds it; the lock ends with its holder."""
    root = tmp_path / "cgroup"
    root.mkdir()
    holder = subprocess.Popen(
        [sys.executable, "-c",
         "import sys; from nodeguard.actuators.node_lock import hold_node\n"
         f"with hold_node({str(root)!r}):\n print('held', flush=True); sys.stdin.readline()"],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert holder.stdout is not None and holder.stdout.readline().strip() == "held"
        with pytest.raises(NodeBusy) as busy, hold_node(str(root)):
            pass
        assert f"pid {holder.pid}" in str(busy.value) and "hold_node" in str(busy.value)
    finally:
        assert holder.stdin is not None
        holder.stdin.close()
        holder.wait(10)
    with hold_node(str(root)):
        pass
