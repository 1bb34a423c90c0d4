"""The decision traces of the recorded planner scenarios (``trace_corpus``) stay what they were."""

from __future__ import annotations

import json

import pytest

from tests.policy.trace_corpus import RECORDED, SCENARIOS

RECORDED_TRACES = json.loads(RECORDED.read_text())


@pytest.mark.parametrize("name", sorted(SCENARIOS))
def test_the_decisions_are_the_recorded_ones(name: str) -> None:
    """Every tick's trace equals the recorded one, field for field."""
    got = json.loads(json.dumps(SCENARIOS[name]()))
    want = RECORDED_TRACES[name]
    assert len(got) == len(want)
    for tick, (ours, theirs) in enumerate(zip(got, want, strict=True)):
        assert ours == theirs, f"{name}: tick {tick} differs"


def test_the_corpus_covers_every_scenario() -> None:
    """The recorded file holds exactly the scenarios the corpus defines."""
    assert set(RECORDED_TRACES) == set(SCENARIOS)
