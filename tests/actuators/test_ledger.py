"""The ledger of originals: atomic, first original kept, corrupt files set aside, single holder."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from nodeguard.actuators.ledger import Ledger, LedgerBusy, LedgerEntry, exclusive


def entry(workload: str, original: str = "max 100000", applied: str = "20000 100000") -> LedgerEntry:
    return LedgerEntry(workload, "v2", original, applied, "cpu_total_usage", 1.0)


def test_round_trip_and_first_original_wins(tmp_path: Path) -> None:
    """Saved entries load back; re-throttling keeps the very first original."""
    path = str(tmp_path / "run/ledger.json")
    ledger = Ledger.load(path)
    ledger.record(entry("a", original="max 100000", applied="50000 100000"))
    ledger.record(entry("a", original="50000 100000", applied="20000 100000"))
    ledger.record(entry("b", original="80000 100000"))
    ledger.save()
    again = Ledger.load(path)
    assert again.entries["a"].original == "max 100000"
    assert again.entries["a"].applied == "20000 100000"
    assert set(again.entries) == {"a", "b"}
    assert [p.name for p in (tmp_path / "run").iterdir()] == ["ledger.json"], "temporary files are renamed, not left behind"


@pytest.mark.parametrize(
    "content",
    [
        "{not json",
        json.dumps({"version": 99, "entries": []}),
        json.dumps({"version": 1, "entries": [{"x": 1}]}),
        json.dumps({"version": 1, "entries": [{**entry("a").__class__.__annotations__, "workload_id": "a"}]}),
        json.dumps(
            {
                "version": 1,
                "entries": [
                    {
                        "workload_id": "a",
                        "cgroup_version": "v2",
                        "original": "bogus",
                        "applied": "1 1",
                        "reason": "r",
                        "changed_at": 0,
                    }
                ],
            }
        ),
    ],
)
def test_corrupt_or_foreign_ledger_is_kept_aside(tmp_path: Path, content: str) -> None:
    """A ledger that cannot be trusted is renamed (not deleted) and the daemon starts empty."""
    path = tmp_path / "ledger.json"
    path.write_text(content)
    ledger = Ledger.load(str(path))
    assert ledger.entries == {}
    assert ledger.set_aside is not None and Path(ledger.set_aside).read_text() == content
    assert not path.exists()


def test_one_holder_at_a_time(tmp_path: Path) -> None:
    """A second holder of the ledger lock is refused while the first holds it."""
    path = str(tmp_path / "ledger.json")
    with exclusive(path), pytest.raises(LedgerBusy), exclusive(path):
        pass
    with exclusive(path):
        pass
