"""The decision traces of the recorded planner scenarios (``trace_corpus``) stay what they were."""

from __future__ import annotations

import json
from typing import Any

import pytest

from tests.policy.trace_corpus import RECORDED, SCENARIOS

RECORDED_TRACES = json.loads(RECORDED.read_text())


def without_phase(trace: dict[str, Any]) -> dict[str, Any]:
    """The trace less protection's phase, which the recorded traces predate (added on purpose since)."""
    state = {k: v for k, v in trace["state"].items() if k != "protect_phase"}
    protected = [{k: v for k, v in p.items() if k not in ("phase", "phase_seconds")} for p in trace["protected"]]
    return {**trace, "state": state, "protected": protected}


@pytest.mark.parametrize("name", sorted(SCENARIOS))
def test_the_decisions_are_the_recorded_ones(name: str) -> None:
    """Every tick's trace equals the recorded one, field for field."""
    got = [without_phase(trace) for trace in json.loads(json.dumps(SCENARIOS[name]()))]
    want = RECORDED_TRACES[name]
    assert len(got) == len(want)
    for tick, (ours, theirs) in enumerate(zip(got, want, strict=True)):
        assert ours == theirs, f"{name}: tick {tick} differs"


def test_the_corpus_covers_every_scenario() -> None:
    """The recorded file holds exactly the scenarios the corpus defines."""
    assert set(RECORDED_TRACES) == set(SCENARIOS)
