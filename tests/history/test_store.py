"""The history's files: within their bound at every write and across runs, older lines never rewritten, malformed
lines skipped and counted."""

from __future__ import annotations

import os
from dataclasses import replace
from pathlib import Path

import pytest

from nodeguard.history.query import respond
from nodeguard.history.reading import directory_bytes, scan
from nodeguard.history.recorder import Recorder, encode
from nodeguard.history.segments import Segments, history_files
from nodeguard.history.settings import HistorySettings
from nodeguard.model.workloads import QosClass
from tests.history.files import FileNode, why, why_json
from tests.policy.builders import GiB, at, mem, mem_throttle, settings

KiB = 1 << 10


def line(number: int, pad: int = 200) -> bytes:
    """A well-formed entry of about ``pad`` bytes, numbered."""
    return encode({"v": 1, "at": 1_700_000_000.0 + number, "kind": "throttle", "lever": "cpu.max",
                   "group": f"kp/pod{number}", "n": number, "pad": "x" * pad})  # fmt: skip


def numbers(directory: Path) -> list[int]:
    return [r.data["n"] for r in scan(str(directory)).records]


def test_a_soak_of_ten_thousand_lines_stays_within_the_bound_at_every_write(tmp_path: Path) -> None:
    """10,000 lines of varied length into 256 KiB shared by 4 files: after every write the files take at most the
    bound, never more than the 4 files (and the one being started) exist, and the newest lines are all there."""
    bound = 256 * KiB
    segments = Segments(str(tmp_path), bound, bound // 4)
    segments.open()
    most = 0
    for number in range(10_000):
        segments.append([line(number, pad=50 + number % 700)])
        size = directory_bytes(str(tmp_path))
        assert size <= bound, f"{size} bytes after line {number}"
        most = max(most, size)
        assert len(history_files(str(tmp_path))) <= 5
    segments.close()
    kept = numbers(tmp_path)
    assert kept == list(range(kept[0], 10_000)), "the newest lines, in order, none missing"
    assert most > bound * 0.7, "the bound is used, not wasted"
    assert segments.deleted > 0 and scan(str(tmp_path)).malformed == 0


def test_ten_thousand_actions_through_the_recorder_stay_within_the_bound(tmp_path: Path) -> None:
    """10,000 memory.high actions planned, made and recorded by the daemon's recorder (its writer thread): the
    history never takes more than history.maxBytes, and its newest entries read back whole."""
    node = FileNode(tmp_path, maxBytes="256Ki", files=4)
    workloads = [mem(f"kubepods/burstable/pod{i}", 2 * GiB, qos=QosClass.BURSTABLE) for i in range(4)]
    node.add(workloads)
    guard = settings(mem_throttle(), step=100.0)
    settled = node.tick(at(14 * GiB, *workloads), guard)
    assert len(settled.done) == 1
    bound = node.history.max_bytes
    for first in range(1, 10_000, 10):  # ten ticks a flush, as a daemon that fell a little behind
        for action in range(first, min(first + 10, 10_000)):
            snapshot = replace(settled.snapshot, wall_time=settled.snapshot.wall_time + action)
            node.recorder.record(settled.plan, snapshot, settled.done, guard.candidates)
        node.recorder.flush()
        assert node.recorder.drain()
        assert directory_bytes(node.history.path) <= bound
    node.close()
    found = scan(node.history.path)
    assert found.malformed == 0 and node.recorder.counters.dropped == 0
    assert found.bytes <= bound and len(found.records) > 50
    assert node.recorder.counters.entries == 10_000
    assert found.records[-1].at == round(settled.snapshot.wall_time + 9_999, 3), "the last action is the last line"


def test_a_smaller_bound_at_the_next_start_deletes_the_oldest_files_first(tmp_path: Path) -> None:
    """Written within 1 MiB, reopened with 256 KiB: at once within the new bound, the newest lines kept."""
    big = Segments(str(tmp_path), 1 << 20, (1 << 20) // 4)
    big.open()
    big.append([line(n) for n in range(4000)])
    big.close()
    assert directory_bytes(str(tmp_path)) > 512 * KiB
    small = Segments(str(tmp_path), 256 * KiB, 64 * KiB)
    small.open()
    assert directory_bytes(str(tmp_path)) <= 256 * KiB
    small.append([line(4000)])
    small.close()
    assert directory_bytes(str(tmp_path)) <= 256 * KiB
    kept = numbers(tmp_path)
    assert kept[-1] == 4000 and kept == list(range(kept[0], 4001))


def test_a_line_cut_by_a_crash_stays_one_malformed_line(tmp_path: Path) -> None:
    """A crash mid-line leaves a cut line at the end of the newest file: the next run ends it and writes on, so the
    lines before and after read back and the cut one is skipped and counted."""
    first = Segments(str(tmp_path), 1 << 20, 256 * KiB)
    first.open()
    first.append([line(0), line(1)])
    first.close()
    (_, newest), *_ = reversed(history_files(str(tmp_path)))
    with open(newest, "ab") as handle:
        handle.write(line(2)[:40])
    before = Path(newest).read_bytes()
    again = Segments(str(tmp_path), 1 << 20, 256 * KiB)
    again.open()
    again.append([line(3)])
    again.close()
    assert Path(newest).read_bytes().startswith(before), "nothing written before is rewritten"
    found = scan(str(tmp_path))
    assert [r.data["n"] for r in found.records] == [0, 1, 3] and found.malformed == 1


def test_a_line_being_written_is_not_counted_as_malformed(tmp_path: Path) -> None:
    """The newest file's last line without its newline is still being written: left out, not counted."""
    (tmp_path / "history-0000000001.jsonl").write_bytes(line(0) + line(1)[:30])
    found = scan(str(tmp_path))
    assert [r.data["n"] for r in found.records] == [0] and found.malformed == 0


def test_a_line_longer_than_a_file_is_skipped_and_counted(tmp_path: Path) -> None:
    segments = Segments(str(tmp_path), 256 * KiB, 64 * KiB)
    assert segments.append([line(0), line(1, pad=70 * KiB), line(2)]) == 2
    segments.close()
    assert segments.too_large == 1 and numbers(tmp_path) == [0, 2]


MALFORMED = [
    b'{"v":1,"at":1700000000.5,"kind":"throttle","lever":"cpu.max","group":"kp/pod',  # cut short
    b"\xff\xfe not utf-8 \x00\x01",
    b"\x00" * 64,  # a power loss's zeroed tail
    b"[" * 100_000 + b"]" * 100_000,  # nested past the parser's depth
    b"[1, 2, 3]",
    b'"text"',
    b"{}",
    b'{"v":2,"at":1700000000,"kind":"throttle","lever":"cpu.max","group":"kp/pod0"}',
    b'{"v":1,"at":"yesterday","kind":"throttle","lever":"cpu.max","group":"kp/pod0"}',
    b'{"v":1,"at":1e999,"kind":"throttle","lever":"cpu.max","group":"kp/pod0"}',
    b'{"v":1,"at":NaN,"kind":"throttle","lever":"cpu.max","group":"kp/pod0"}',
    b'{"v":1,"at":-5,"kind":"throttle","lever":"cpu.max","group":"kp/pod0"}',
    b'{"v":1,"at":1700000000,"kind":7,"lever":"cpu.max","group":"kp/pod0"}',
    b'{"v":1,"at":1700000000,"kind":"throttle","lever":"cpu.max","group":null,"workload":{"id":"kp/pod0","name":"x"}}',
    b'{"v":1,"at":1700000000,"kind":"throttle","lever":"cpu.max","group":"kp/pod0","workload":5}',
    b'{"v":1,"at":1700000000,"kind":"reweigh","lever":"cpu.weight","group":"kp","workload":null,"workloads":[1,2]}',
    b'{"v":1,"at":1700000000,"kind":"stop","lever":null,"group":null,"restored":"kp/pod0"}',
    b'{"v":1,"at":1700000000,"kind":"throttle","lever":"cpu.max","group":"kp/pod0","holds_back":"yes"}',
    b'{"v":true,"at":1700000000,"kind":"throttle","lever":"cpu.max","group":"kp/pod0"}',
]


def test_malformed_lines_are_skipped_and_counted_by_why(tmp_path: Path) -> None:
    """Every kind of malformed line among good ones: `nodeguard why` (text and JSON) and /history skip each and
    count it, and show the good entries; no traceback. A line that cannot concern the pod asked about is not
    parsed: it counts when it does not even look whole (cut short, garbage)."""
    good = [line(0), line(1)]
    (tmp_path / "history-0000000001.jsonl").write_bytes(good[0] + b"\n".join(MALFORMED) + b"\n" + good[1])
    found = scan(str(tmp_path))
    assert found.malformed == len(MALFORMED) and [r.data["n"] for r in found.records] == [0, 1]
    status, everything = respond(str(tmp_path), {})
    assert status == 200 and isinstance(everything, dict) and everything["history"]["malformed"] == len(MALFORMED)

    answer = why_json("kp/pod0", "--history", str(tmp_path))
    assert answer["history"]["malformed"] == len(MALFORMED), "every one names kp/pod0 or does not look whole"
    assert [e["n"] for e in answer["entries"]] == [0] and answer["history"]["entries"] == 2
    other = why_json("kp/pod1", "--history", str(tmp_path))
    assert [e["n"] for e in other["entries"]] == [1] and 0 < other["history"]["malformed"] <= len(MALFORMED)
    shown = why("kp/pod0", "--history", str(tmp_path))
    assert shown.returncode == 0 and not shown.stderr, shown
    assert f"{len(MALFORMED)} malformed lines skipped" in shown.stdout and "throttle" in shown.stdout


def test_an_unwritable_history_is_logged_and_the_recorder_goes_on(tmp_path: Path) -> None:
    """history.path where a file is: the recorder logs, counts the failed writes and never raises into the tick."""
    blocker = tmp_path / "file"
    blocker.write_text("not a directory")
    recorder = Recorder(HistorySettings(path=str(blocker / "history")))
    recorder.start()
    recorder.lifecycle("stop", "restore", restored=["kp/pod0"])
    assert recorder.drain()
    recorder.close()
    assert recorder.counters.errors == 1 and recorder.counters.entries == 0


def test_the_files_are_private_to_root(tmp_path: Path) -> None:
    """The directory is 0750 and each file 0640 (pod names and decisions, like the ledger)."""
    segments = Segments(str(tmp_path / "history"), 256 * KiB, 64 * KiB)
    segments.append([line(0)])
    segments.close()
    ((_, path),) = history_files(str(tmp_path / "history"))
    assert os.stat(path).st_mode & 0o777 == 0o640 & ~_umask()
    assert os.stat(tmp_path / "history").st_mode & 0o777 == 0o750 & ~_umask()


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def test_history_settings_refuse_a_file_too_small_for_a_line() -> None:
    """maxBytes shared between files must leave each 64 KiB: the error names both keys' values."""
    with pytest.raises(ValueError, match="maxBytes 262144 shared between 8 files"):
        HistorySettings.model_validate({"maxBytes": "256Ki", "files": 8})
    assert HistorySettings.model_validate({"maxBytes": "1Mi", "files": 16}).file_bytes == 64 * KiB


def test_a_stop_before_the_start_still_records_what_it_restored(tmp_path: Path) -> None:
    """A daemon stopped while starting restores the ledger before its recorder ever started: close writes it."""
    recorder = Recorder(HistorySettings(path=str(tmp_path / "history")))
    recorder.lifecycle("stop", "restore", restored=["kp/pod0"])
    recorder.close()
    (record,) = scan(str(tmp_path / "history")).records
    assert record.kind == "stop" and record.restored == ("kp/pod0",)
    idle = Recorder(HistorySettings(path=str(tmp_path / "idle")))
    idle.close()
    assert not (tmp_path / "idle").exists(), "nothing handed, nothing made"
