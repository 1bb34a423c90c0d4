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

from nodeguard.actuators.ledger import HeldValue, Ledger, LedgerUnsaved, Ownership
from nodeguard.actuators.node_lock import NodeBusy, hold_node
from nodeguard.model.samples import CpuMax
from tests.actuators.records import quota_record, weight_record

UNLIMITED = CpuMax(None)
VERSION_1 = Path(__file__).parent / "data" / "ledger-v1.json"  # written by nodeguard 0.1.0's Ledger.save


def good(group: str, original: str = "max 100000", applied: str = "20000 100000") -> dict[str, object]:
    return {
        "lever": "cpu.max",
        "group": group,
        "cgroup_version": "v2",
        "original": original,
        "applied": applied,
        "reason": "cpu_total_usage",
        "changed_at": 1.0,
    }


def test_round_trip_and_first_original_wins(tmp_path: Path) -> None:
    """Saved records load back; re-throttling keeps the very first original, of the workload and its children."""
    path = str(tmp_path / "run/ledger.json")
    ledger = Ledger.load(path)
    child = {"a/c": HeldValue(original="150000 100000", applied="50000 100000")}
    ledger.record(quota_record("a", "v1", UNLIMITED, CpuMax(50000), "r", children=child))
    lower = {"a/c": HeldValue(original="50000 100000", applied="20000 100000")}
    ledger.record(quota_record("a", "v1", CpuMax(50000), CpuMax(20000), "r", children=lower))
    ledger.record(quota_record("b", "v1", CpuMax(80000), CpuMax(20000), "r"))
    ledger.record(weight_record("a", "v1", 1024, 2))  # the same group, another lever: its own record
    ledger.save()
    again = Ledger.load(path)
    quotas = again.of("cpu.max")
    assert quotas["a"].original == "max 100000"
    assert quotas["a"].applied == "20000 100000"
    assert quotas["a"].children["a/c"] == HeldValue(original="150000 100000", applied="20000 100000")
    assert set(quotas) == {"a", "b"}
    assert again.get("cpu.weight", "a") == weight_record("a", "v1", 1024, 2)
    assert [p.name for p in (tmp_path / "run").iterdir()] == ["ledger.json"], (
        "temporary files are renamed, not left behind"
    )


def test_a_version_1_ledger_is_read_as_every_lever_and_written_as_version_2(tmp_path: Path) -> None:
    """The ledger of the previous version (quotas under entries, weights under weights, weights as numbers) loads
    whole — quota children, pending values and lowered weights — and is written back as version 2."""
    path = tmp_path / "ledger.json"
    path.write_bytes(VERSION_1.read_bytes())
    ledger = Ledger.load(str(path))
    assert ledger.rejected is None and ledger.set_aside is None
    quotas, weights = ledger.of("cpu.max"), ledger.of("cpu.weight")
    pod = quotas["kubepods/burstable/podaaaa"]
    assert (pod.original, pod.applied, pod.cgroup_version) == ("150000 100000", "30000 100000", "v1")
    assert pod.children == {"kubepods/burstable/podaaaa/c1": HeldValue("150000 100000", "30000 100000")}
    assert quotas["kubepods/besteffort/podbbbb"].pending == "10000 100000"
    assert {g: (w.original, w.applied) for g, w in weights.items()} == {
        "kubepods/besteffort": ("2", "2"),
        "kubepods/burstable": ("1228", "2"),
    }
    ledger.save()
    written = json.loads(path.read_text())
    assert written["version"] == 2 and {r["lever"] for r in written["records"]} == {"cpu.max", "cpu.weight"}
    assert Ledger.load(str(path)).records == ledger.records


def test_an_entry_without_children_reads_as_before(tmp_path: Path) -> None:
    """A record without children loads with none, and is written back without the key."""
    path = tmp_path / "ledger.json"
    path.write_text(json.dumps({"version": 2, "records": [good("a")]}))
    ledger = Ledger.load(str(path))
    assert ledger.of("cpu.max")["a"].children == {} and ledger.rejected is None
    ledger.save()
    assert "children" not in json.loads(path.read_text())["records"][0]


@pytest.mark.parametrize(
    "content",
    [
        b"{not json",
        json.dumps({"version": 99, "records": []}).encode(),
        json.dumps({"version": 2, "records": {"a": 1}}).encode(),
        json.dumps({"version": 1, "entries": {"a": 1}}).encode(),
        b'{"version": 2, "records": [\xff\xfe]}',  # not UTF-8
        b"[" * 100_000,  # nested past the parser's recursion limit
    ],
)
def test_unreadable_ledger_is_kept_aside(tmp_path: Path, content: bytes) -> None:
    """A ledger that cannot be read at all is renamed (not deleted) and the daemon starts empty."""
    path = tmp_path / "ledger.json"
    path.write_bytes(content)
    ledger = Ledger.load(str(path))
    assert not ledger
    assert ledger.set_aside is not None and Path(ledger.set_aside).read_bytes() == content
    assert not path.exists()


@pytest.mark.parametrize(
    "bad",
    [
        {**good("bad"), "original": "abc"},
        {**good("bad"), "applied": "1 0"},
        {**good("bad"), "changed_at": "yesterday"},
        {**good("bad"), "cgroup_version": "v3"},
        {**good("bad"), "lever": "memory.low"},
        {**good("bad"), "lever": "cpu.weight"},  # a quota's values are no weight
        {**good("bad"), "group": ""},
        {**good("bad"), "children": {"bad/c": {"original": "nope", "applied": "1000 100000"}}},
        {"x": 1},
        "not an object",
        good("a"),  # a duplicate of a good record
    ],
)
def test_a_bad_entry_is_set_aside_alone(tmp_path: Path, bad: object) -> None:
    """One record that fails its checks goes to a side file; every good record is kept, to be restored."""
    path = tmp_path / "ledger.json"
    path.write_text(json.dumps({"version": 2, "records": [good("a"), bad, good("b", original="150000 100000")]}))
    ledger = Ledger.load(str(path))
    assert set(ledger.of("cpu.max")) == {"a", "b"} and len(ledger.records) == 2
    assert ledger.of("cpu.max")["b"].original == "150000 100000"
    assert ledger.set_aside is None and ledger.rejected is not None
    assert json.loads(Path(ledger.rejected).read_text())["records"] == [bad], "the rejected record is kept, not lost"


def test_a_bad_version_1_weight_is_set_aside_alone(tmp_path: Path) -> None:
    """In a version 1 ledger too, a weight out of range is set aside and the quota entries are kept."""
    path = tmp_path / "ledger.json"
    entry = {k: v for k, v in good("a").items() if k not in ("lever", "group")} | {"workload_id": "a"}
    weight = {"group": "t", "cgroup_version": "v1", "original": -5, "applied": 2}
    path.write_text(json.dumps({"version": 1, "entries": [entry], "weights": [weight]}))
    ledger = Ledger.load(str(path))
    assert set(ledger.records) == {("cpu.max", "a")} and ledger.rejected is not None


def test_ledger_behind_a_symlink_or_a_fifo_is_not_followed(tmp_path: Path) -> None:
    """A symlink planted at the ledger path is not followed, and a FIFO there does not hang the load."""
    target = tmp_path / "elsewhere.json"
    target.write_text(json.dumps({"version": 2, "records": [good("a")]}))
    link = tmp_path / "ledger.json"
    link.symlink_to(target)
    ledger = Ledger.load(str(link))
    assert not ledger and ledger.set_aside == str(link)
    fifo = tmp_path / "fifo.json"
    os.mkfifo(fifo)
    assert not Ledger.load(str(fifo))


def test_ownership_tells_ours_from_a_reset_and_a_resize() -> None:
    """The recorded values tell nodeguard's own value, the original put back, and a new value apart."""
    record = HeldValue(original="150000 100000", applied="50000 100000", pending="40000 100000")
    assert record.ownership("50000 100000") is Ownership.OURS
    assert record.ownership("40000 100000") is Ownership.OURS
    assert record.ownership("150000 100000") is Ownership.ORIGINAL
    assert record.ownership("120000 100000") is Ownership.MOVED


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
    ledger.record(quota_record("a", "v2", UNLIMITED, CpuMax(1000)))
    with pytest.raises(LedgerUnsaved) as raised:
        ledger.save()
    assert raised.value.errno_name == "ENOSPC" and str(full_tmpfs / "ledger.json") in str(raised.value)
    assert set(ledger.records) == {("cpu.max", "a")}
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
