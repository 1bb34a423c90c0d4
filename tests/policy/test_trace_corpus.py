"""The decision traces of the recorded planner scenarios (``trace_corpus``) stay what they were."""

from __future__ import annotations

import json
from typing import Any

import pytest

from tests.policy.trace_corpus import RECORDED, SCENARIOS

RECORDED_TRACES = json.loads(RECORDED.read_text())


def as_recorded(trace: dict[str, Any]) -> dict[str, Any]:
    """The trace less what the recorded traces predate (added on purpose since, every earlier field unchanged):
    protection's phase, and which rule chose each workload (the candidates' ``rule``, ``selection``; checked on
    the corpus by ``test_the_corpus_workloads_are_chosen_by_class_and_priority``)."""
    state = {k: v for k, v in trace["state"].items() if k != "protect_phase"}
    protected = [{k: v for k, v in p.items() if k not in ("phase", "phase_seconds")} for p in trace["protected"]]
    candidates = {
        names: [{k: v for k, v in c.items() if k != "rule"} for c in order]
        for names, order in trace["candidates"].items()
    }
    rest = {k: v for k, v in trace.items() if k != "selection"}
    return {**rest, "state": state, "protected": protected, "candidates": candidates}


@pytest.mark.parametrize("name", sorted(SCENARIOS))
def test_the_decisions_are_the_recorded_ones(name: str) -> None:
    """Every tick's trace equals the recorded one, field for field."""
    got = [as_recorded(trace) for trace in json.loads(json.dumps(SCENARIOS[name]()))]
    want = RECORDED_TRACES[name]
    assert len(got) == len(want)
    for tick, (ours, theirs) in enumerate(zip(got, want, strict=True)):
        assert ours == theirs, f"{name}: tick {tick} differs"


def test_the_corpus_covers_every_scenario() -> None:
    """The recorded file holds exactly the scenarios the corpus defines."""
    assert set(RECORDED_TRACES) == set(SCENARIOS)


@pytest.mark.parametrize("name", sorted(SCENARIOS))
def test_the_corpus_workloads_are_chosen_by_class_and_priority(name: str) -> None:
    """The corpus's workloads have no namespace or labels: every candidate is one by its class, every other
    workload is protected or outside the classes, and the selection counts each workload once."""
    for trace in json.loads(json.dumps(SCENARIOS[name]())):
        roles = {}
        for group in trace["selection"]:
            assert group["role"] in ("candidate", "protected", "unselected"), group
            assert group["count"] == len(group["workloads"])
            roles |= dict.fromkeys(group["workloads"], (group["role"], group["rule"]))
        assert len(roles) == trace["inputs"]["workloads"]
        for order in trace["candidates"].values():
            for candidate in order:
                assert candidate["rule"].startswith("guard.candidates: class ")
                assert roles[candidate["workload"]] == ("candidate", candidate["rule"])
