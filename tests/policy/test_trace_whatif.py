"""The decision trace, what-if snapshots, and the guard's config additions."""

from __future__ import annotations

import json

import pytest

from nodeguard.config import parse_document
from nodeguard.errors import ConfigError, NodeguardError, WhatIfError
from nodeguard.policy.holds import HeldThrottle
from nodeguard.policy.metrics import CAPABILITIES, Metric
from nodeguard.policy.planner import plan
from nodeguard.policy.state import GuardState
from nodeguard.policy.trace import plan_to_data
from nodeguard.policy.whatif import parse_overrides, what_if
from tests.policy.builders import UNLIMITED, GiB, cpu_throttle, guard, snapshot, usage

WORKLOADS = [usage(f"w{i}", cores=1.0, priority=-i) for i in range(10)]


def test_trace_is_strict_json_with_every_part() -> None:
    """A plan serialises to strict JSON holding inputs, waterlines, gaps by direction, candidates, actions and blocks."""
    settings = guard(
        cpu_throttle(6.0, 5.0),
        {"metric": "memory_total_usage", "threshold": "8Gi", "action": "evict", "triggerAfter": 1},
        {"metric": "load_average", "threshold": 2, "restoreBelow": 1, "action": "throttle", "triggerAfter": 3},
    )
    state = GuardState.holding(
        HeldThrottle("w0", UNLIMITED, UNLIMITED._replace(quota_us=50_000), frozenset({Metric.CPU_TOTAL_USAGE}), 1.0)
    )
    p = plan(snapshot(WORKLOADS, cores_used=7.5, memory_used=10 * GiB, load1=24.0), state, settings)
    data = json.loads(json.dumps(plan_to_data(p), allow_nan=False))
    assert data["inputs"]["readings"]["cpu_total_usage"] == 7.5
    assert {w["metric"] for w in data["waterlines"]} == {"cpu_total_usage", "memory_total_usage", "load_average"}
    assert data["gaps"] == {
        "throttle_down": {"cpu_total_usage": 1.5, "load_average": 1.0},
        "throttle_up": {},
        "evict": {"memory_total_usage": 2 * GiB},
    }
    cpu_order = data["candidates"]["class_and_priority,cpu_usage,ext_cpu_usage,running_time"]
    assert cpu_order[0] == {
        "workload": "w9",
        "key": {"class_and_priority": [-2, -9], "cpu_usage": -1.0, "ext_cpu_usage": -1.0, "running_time": -1000.0},
        "rule": "guard.candidates: class BestEffort",
    }
    assert [a["kind"] for a in data["actions"]] == ["throttle", "throttle", "evict"]
    assert data["actions"][0]["quota"] == {"quota_us": 5000, "period_us": 100000, "cores": 0.05}
    assert data["predicted_release"]["cpu_total_usage"] == pytest.approx(1.5)
    assert {
        "metric": "load_average",
        "direction": "throttle",
        "cause": "confirming",
        "detail": "past the waterline 1/3 ticks",
    } in data["blocked"]
    assert data["state"]["throttles"]["w0"]["original"]["quota_us"] is None


def test_trace_candidate_limit() -> None:
    """candidate_limit keeps the first candidates of each order only."""
    p = plan(snapshot(WORKLOADS, cores_used=7.5), GuardState(), guard(cpu_throttle(6.0, 5.0, triggerAfter=1)))
    (order,) = plan_to_data(p, candidate_limit=3)["candidates"].values()
    assert [c["workload"] for c in order] == ["w9", "w8", "w7"]


def test_what_if_sets_only_the_named_metric() -> None:
    """A what-if override changes the named node metric and nothing else."""
    snap = snapshot(WORKLOADS, cores_used=2.0, memory_used=4 * GiB)
    changed = what_if(snap, {"cpu_total_usage": 7.5})
    assert changed.node.cores_used == 7.5
    assert changed.node.memory_used == 4 * GiB
    assert changed.workloads == snap.workloads


@pytest.mark.parametrize(
    ("metric", "raw", "expected"),
    [
        ("cpu_total_usage", 7.5, 7.5),
        ("cpu_total_usage", "75%", 6.0),
        ("cpu_total_utilization", 80, 80.0),
        ("memory_total_usage", "12Gi", 12.0 * GiB),
        ("memory_total_utilization", 50, 50.0),
        ("cpu_pressure", 35, 35.0),
        ("load_average", 2.5, 2.5),
    ],
)
def test_what_if_reads_back_through_the_registry(metric: str, raw: float | str, expected: float) -> None:
    """Every metric can be overridden, and reads back as the value given, in its unit."""
    changed = what_if(snapshot(cpus=8, memory_total=16 * GiB), {metric: raw})
    assert CAPABILITIES[Metric(metric)].read(changed.node) == pytest.approx(expected)


def test_what_if_drives_the_plan() -> None:
    """The plan of a what-if snapshot acts as if the node read those values."""
    snap = what_if(snapshot(WORKLOADS, cores_used=1.0), {"cpu_total_usage": 7.5})
    p = plan(snap, GuardState.primed(), guard(cpu_throttle(6.0, 5.0, triggerAfter=5)))
    assert [a.workload_id for a in p.actions] == ["w9", "w8"]


@pytest.mark.parametrize(
    ("overrides", "match"),
    [
        ({"cpu_usage_total": 7.5}, "unknown metric 'cpu_usage_total'"),
        ({"cpu_pressure": 120}, "over 100"),
        ({"cpu_total_usage": -1.0}, "not negative"),
        ({"cpu_total_usage": float("nan")}, "finite"),
        ({"memory_total_usage": "lots"}, "expected bytes"),
    ],
)
def test_what_if_refuses_bad_overrides(overrides: dict[str, float | str], match: str) -> None:
    """An unknown metric or an impossible value raises a WhatIfError that says which."""
    with pytest.raises(WhatIfError, match=match) as caught:
        what_if(snapshot(), overrides)
    assert isinstance(caught.value, NodeguardError)


def test_parse_overrides() -> None:
    """METRIC=VALUE items become overrides; numbers stay numbers, quantities stay text."""
    assert parse_overrides(["cpu_total_usage=7.5", " memory_total_usage = 30Gi"]) == {
        "cpu_total_usage": 7.5,
        "memory_total_usage": "30Gi",
    }
    with pytest.raises(WhatIfError, match="METRIC=VALUE"):
        parse_overrides(["cpu_total_usage"])
    with pytest.raises(WhatIfError, match="unknown metric"):
        parse_overrides(["nope=1"])


def test_sort_by_config_errors_name_the_path_and_value() -> None:
    """An unknown comparator in sortBy is reported at its JSON path with its value."""
    objective = {**cpu_throttle(6.0, 5.0), "sortBy": ["class_and_priority", "fastest"]}
    doc = {"global": {}, "perNode": [{"nodeSelector": {}, "guard": {"objectives": [objective]}}]}
    with pytest.raises(ConfigError) as caught:
        parse_document(doc)
    assert caught.value.problems == [
        "perNode[0].guard.objectives[0].sortBy[1]: unknown comparator; expected one of class_and_priority, qos_class, "
        'priority, cpu_usage, ext_cpu_usage, memory_usage, running_time, got "fastest"'
    ]


@pytest.mark.parametrize(
    ("guard_section", "path"),
    [
        ({"closedLoopStepPercent": 0}, "global.guard.closedLoopStepPercent"),
        ({"evictions": {"terminationTimeoutSeconds": 0}}, "global.guard.evictions.terminationTimeoutSeconds"),
    ],
)
def test_new_guard_settings_are_validated(guard_section: dict[str, object], path: str) -> None:
    """The guard settings added for the planner refuse impossible values at their path."""
    with pytest.raises(ConfigError, match=path.replace(".", r"\.")):
        parse_document({"global": {"guard": guard_section}})
