"""docs/reference/events.md is what scripts/events_reference.py prints from the Event reasons nodeguard records."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest

from nodeguard.kubernetes.events import REASONS
from nodeguard.model.levers import CPU_QUOTA, LEVERS, EventKind
from tests.docs.generators import load

REPO = Path(__file__).resolve().parents[2]
REFERENCE = REPO / "docs" / "reference" / "events.md"


def test_the_committed_reference_is_what_the_generator_prints() -> None:
    """The committed Events reference equals the generator's output, so it follows every change of the reasons."""
    module = load("events_reference")
    assert REFERENCE.read_text() == module.render(), (
        f"docs/reference/events.md is out of date; regenerate it: {module.COMMAND}"
    )


def test_every_reason_recorded_has_its_row_with_its_type() -> None:
    """Each (reason, type, action) the recorder can send is a row of the page, and the page lists no other reason."""
    rows = re.findall(r"^\| `(Nodeguard\w+)` \| (\w+) \| `(\w+)` \|", REFERENCE.read_text(), re.MULTILINE)
    assert sorted(rows) == sorted({(kind.reason, kind.type, kind.action) for kind in REASONS})


def test_a_new_reason_stops_the_generator_until_documented(monkeypatch: pytest.MonkeyPatch) -> None:
    """A reason added to the recorder without its WHEN (or a lever without its object) fails the generator."""
    module = load("events_reference")
    capped = dataclasses.replace(CPU_QUOTA, holds=EventKind("NodeguardCapped", "Warning", "Cap"))
    monkeypatch.setattr(module, "LEVERS", (capped, *LEVERS[1:]))
    with pytest.raises(module.Undocumented, match="NodeguardCapped"):
        module.render()
    io = dataclasses.replace(CPU_QUOTA, name="io.max", holds=EventKind("NodeguardIoThrottled", "Warning", "Io"))
    monkeypatch.setattr(module, "LEVERS", (*LEVERS, io))
    with pytest.raises(module.Undocumented, match=r"io\.max"):
        module.render()
