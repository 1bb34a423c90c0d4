"""The gate's state file under attack and corruption: real files, a real GateService reading them at start."""

from __future__ import annotations

import json
import os
import stat
import tempfile
import time
from pathlib import Path
from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from nodeguard.gate import store
from nodeguard.gate.readiness import ExecProbe
from tests.gate.served import ServedGate, ping, served
from tests.gate.state_records import BOOT, record, write_state
from tests.support.gate import Session
from tests.support.poll import wait_until


def corrupt_copies(directory: Path) -> list[Path]:
    return sorted(directory.glob(store.STATE_FILE + ".corrupt-*"))


def test_invalid_utf8_is_set_aside_and_never_overwritten(tmp_path: Path) -> None:
    """A state file that is not UTF-8 is renamed aside intact at start; the gate's next write does not touch it."""
    garbage = b'{"version":1,"loads":[\xff\xfe\xfd]}'
    write_state(tmp_path, [], raw=garbage)
    with served(tmp_path) as gate:
        wait_until(lambda: ping(gate.socket), 10, "the gate")
        (aside,) = corrupt_copies(tmp_path)
        assert aside.read_bytes() == garbage
        session = Session(gate.socket)
        assert session.request({"op": "submit", "name": "after", "detach": True})["ok"]
        session.close()
        wait_until(lambda: b"after" in (tmp_path / store.STATE_FILE).read_bytes(), 10, "the state written")
    assert aside.read_bytes() == garbage


def test_deadlines_that_are_not_finite_times_are_not_restored(tmp_path: Path) -> None:
    """Records with an infinite, huge or future time are dropped (a copy kept aside); the status stays strict JSON."""
    good = record("good", seq=1)
    loads = [
        record("inf", seq=2, deadline=float("inf")),
        record("huge", seq=3, deadline=1e308),
        record("nan", seq=4, admittedAt=float("nan")),
        record("future", seq=5, admittedAt=time.monotonic() + 3600),
        good,
    ]
    write_state(tmp_path, loads)  # json.dumps writes Infinity and NaN, which json.loads reads back
    with served(tmp_path, maxStarting=10) as gate:
        wait_until(lambda: ping(gate.socket), 10, "the gate")
        names = gate.call(lambda: sorted(gate.gate.table.loads))
        status = gate.call(gate.gate.status)
    assert names == ["good"]
    json.dumps(status, allow_nan=False)  # what /status does: raised ValueError (a 500) with an infinite deadline
    assert len(corrupt_copies(tmp_path)) == 1


def test_infinite_start_timeouts_are_refused_on_submit(tmp_path: Path) -> None:
    """A submit with startTimeoutSeconds 1e999 (infinity) or 1e308 is refused as invalid."""
    with served(tmp_path) as gate:
        wait_until(lambda: ping(gate.socket), 10, "the gate")
        session = Session(gate.socket)
        for raw in (
            b'{"op":"submit","name":"a","startTimeoutSeconds":1e999}',
            b'{"op":"submit","name":"a","startTimeoutSeconds":1e308}',
            b'{"op":"submit","name":"a","startTimeoutSeconds":Infinity}',
        ):
            answer = session.request(raw)
            assert answer["ok"] is False and answer["error"]["code"] == "invalid", answer
        session.close()


def test_two_starting_records_of_one_name_hold_one_slot(tmp_path: Path) -> None:
    """Two starting records with the same name restore one load; once it is released its slot admits the next load."""
    write_state(tmp_path, [record("twin", seq=1), record("twin", seq=2)])
    with served(tmp_path, maxStarting=1, minRate=0) as gate:
        wait_until(lambda: ping(gate.socket), 10, "the gate")
        assert gate.call(lambda: gate.gate.table.starting) == 1
        session = Session(gate.socket)
        assert session.request({"op": "release", "name": "twin"})["ok"]
        answer = session.request({"op": "submit", "name": "next", "detach": True, "readiness": {"type": "notify"}})
        session.close()
        assert answer["ok"] and answer["load"]["state"] == "starting", answer
        assert gate.call(lambda: gate.gate.table.starting) == 1


def _exec_record(name: str, marker: Path, uid: int) -> dict[str, Any]:
    probe = ExecProbe(type="exec", command=["/bin/sh", "-c", f"touch {marker}"], periodSeconds=0.1)
    return record(name, readiness=probe.model_dump(by_alias=True, mode="json"), uid=uid, gid=uid)


def test_a_forged_uid_does_not_run_exec_probes(tmp_path: Path) -> None:
    """A restored exec probe runs as its uid only if that uid may use the gate now; otherwise the load is dropped."""
    shared = Path(tempfile.mkdtemp(prefix="nodeguard-probe-"))
    shared.chmod(0o777)  # the probe runs as uid 4242
    marker = shared / "ran"
    try:
        write_state(tmp_path, [_exec_record("forged", marker, 4242)])
        with served(tmp_path) as gate:
            wait_until(lambda: ping(gate.socket), 10, "the gate")
            assert gate.call(lambda: list(gate.gate.table.loads)) == []
        assert len(corrupt_copies(tmp_path)) == 1
        # The control: the same record, with uid 4242 allowed, is restored and probed as that uid.
        write_state(tmp_path, [_exec_record("allowed", marker, 4242)])
        with served(tmp_path, allowedUids=[4242]) as gate:
            wait_until(marker.exists, 10, "the allowed load's probe")
            assert marker.stat().st_uid == 4242
    finally:
        for leftover in shared.iterdir():
            leftover.unlink()
        shared.rmdir()


def test_a_state_file_another_user_could_write_is_not_trusted(tmp_path: Path) -> None:
    """A state file owned by another user, or writable by others, restores nothing and is set aside."""
    for owner, mode in ((4242, 0o600), (os.geteuid(), 0o666)):
        path = write_state(tmp_path, [record("planted")])
        os.chown(path, owner, -1)
        path.chmod(mode)
        back = store.read(str(path), BOOT)
        assert back.loads == [] and back.set_aside is not None, back
        assert "not trusted" in back.problems[0]
        Path(back.set_aside).unlink()


def test_a_symlink_at_the_state_path_is_neither_read_nor_written_through(tmp_path: Path) -> None:
    """A symlink planted as the state file is set aside unread; the gate's writes replace it and the target is untouched."""
    outside = tmp_path / "outside"
    outside.mkdir()
    victim = outside / "victim"
    victim.write_text(json.dumps({"version": 1, "bootId": BOOT, "loads": [record("planted")]}))
    state_dir = tmp_path / "state"
    state_dir.mkdir()
    (state_dir / store.STATE_FILE).symlink_to(victim)
    before = victim.read_bytes()
    with served(state_dir) as gate:
        wait_until(lambda: ping(gate.socket), 10, "the gate")
        assert gate.call(lambda: list(gate.gate.table.loads)) == []
        session = Session(gate.socket)
        assert session.request({"op": "submit", "name": "mine", "detach": True})["ok"]
        session.close()
        wait_until(lambda: stat.S_ISREG((state_dir / store.STATE_FILE).lstat().st_mode), 10, "a real state file")
    assert victim.read_bytes() == before
    (aside,) = corrupt_copies(state_dir)
    assert aside.is_symlink()


def test_a_fifo_at_the_state_path_does_not_hang_the_start(tmp_path: Path) -> None:
    """A FIFO as the state file is set aside at once; the gate starts and serves."""
    os.mkfifo(tmp_path / store.STATE_FILE)
    with served(tmp_path) as gate:
        wait_until(lambda: ping(gate.socket), 10, "the gate")
    (aside,) = corrupt_copies(tmp_path)
    assert stat.S_ISFIFO(aside.lstat().st_mode)


RECORD_FIELDS = st.sampled_from(list(record("x").keys()))
ANY_JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=10),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3),
    max_leaves=10,
)


@st.composite
def state_files(draw: st.DrawFn) -> bytes:
    """Random bytes, random JSON, or a valid file with records mutated at random."""
    kind = draw(st.sampled_from(["bytes", "json", "records"]))
    if kind == "bytes":
        return draw(st.binary(max_size=200))
    if kind == "json":
        return json.dumps(draw(ANY_JSON)).encode()
    loads: list[Any] = []
    for i in range(draw(st.integers(0, 4))):
        item: Any = record(draw(st.sampled_from(["a", "b", "c"])), seq=i + 1)
        for _ in range(draw(st.integers(0, 3))):
            item[draw(RECORD_FIELDS)] = draw(ANY_JSON)
        if draw(st.booleans()):
            item = draw(ANY_JSON)
        loads.append(item)
    return json.dumps({"version": 1, "bootId": BOOT, "loads": loads}).encode()


def test_fuzz_state_file_loading(tmp_path: Path) -> None:
    """Loading any state file never raises; a file unreadable as a whole is set aside; what is restored is valid."""

    @settings(max_examples=300, deadline=None, suppress_health_check=list(HealthCheck), database=None)
    @given(state_files())
    def load(raw: bytes) -> None:
        for leftover in tmp_path.iterdir():
            leftover.unlink()
        path = write_state(tmp_path, [], raw=raw)
        back = store.read(str(path), BOOT)
        names = [load.name for load in back.loads]
        assert len(names) == len(set(names))
        now = time.monotonic()
        json.dumps([load.to_status(now) for load in back.loads], allow_nan=False)
        if back.problems:
            assert back.set_aside is not None and Path(back.set_aside).read_bytes() == raw
        if not path.exists():  # set aside whole: nothing restored from it
            assert back.loads == [] and back.set_aside is not None

    load()


def test_gate_restarted_from_a_fuzzed_state_stays_ready(tmp_path: Path) -> None:
    """A real GateService started on a state file of random records serves and answers status."""
    write_state(tmp_path, [record("a", seq=1), {"name": "b"}, [1, 2], record("a", seq=3, uid=-1)])
    gate = ServedGate(tmp_path).start()
    try:
        wait_until(lambda: ping(gate.socket), 10, "the gate")
        assert gate.call(lambda: sorted(gate.gate.table.loads)) == ["a"]
        assert gate.call(gate.gate.problem) is None
    finally:
        gate.stop()
