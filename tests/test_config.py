"""The per-node config: validation with paths, node selection, schema, and no tracebacks."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from nodeguard.config import Document, json_schema, parse_document, parse_text
from nodeguard.errors import ConfigError

REPO = Path(__file__).resolve().parents[1]
CPU_OBJECTIVE = {"metric": "cpu_total_usage", "threshold": "80%", "restoreBelow": "60%", "action": "throttle"}


def errors_of(document: Any) -> list[str]:
    with pytest.raises(ConfigError) as caught:
        parse_document(document)
    return caught.value.problems


def test_error_names_path_and_value() -> None:
    """A bad threshold in a perNode rule names its full JSON path, what was expected and the value."""
    doc = {
        "perNode": [
            {"nodeSelector": {}},
            {"nodeSelector": {}, "guard": {"objectives": [{**CPU_OBJECTIVE, "threshold": "eighty"}]}},
        ]
    }
    assert errors_of(doc) == [
        'perNode[1].guard.objectives[0].threshold: expected a number of cores or a percentage like "80%", got "eighty"'
    ]


def test_every_error_is_reported_at_once() -> None:
    """All problems in a document are listed, each with its own path."""
    doc = {
        "global": {"sensing": {"tickSeconds": 0, "cgroupRoot": "relative"}, "bogus": 1},
        "perNode": [{"guard": {}}],
    }
    problems = errors_of(doc)
    paths = sorted(p.split(":")[0] for p in problems)
    assert paths == [
        "global.bogus",
        "global.sensing.cgroupRoot",
        "global.sensing.tickSeconds",
        "perNode[0].nodeSelector",
    ]
    assert any("unknown key, got 1" in p for p in problems)


@pytest.mark.parametrize(
    ("objective", "path", "fragment"),
    [
        ({**CPU_OBJECTIVE, "restoreBelow": "80%"}, "restoreBelow", "strictly below threshold"),
        ({**CPU_OBJECTIVE, "restoreBelow": 1.0}, "restoreBelow", "same unit"),
        ({**CPU_OBJECTIVE, "metric": "disk_magic"}, "metric", "Input should be"),
        ({**CPU_OBJECTIVE, "threshold": "180%"}, "threshold", "over 100"),
        (
            {"metric": "memory_total_utilization", "threshold": "90%", "action": "throttle"},
            "restoreBelow",
            "needs restoreBelow",
        ),
        (
            {"metric": "memory_total_usage", "threshold": "8Gi", "action": "evict", "restoreBelow": "4Gi"},
            "restoreBelow",
            "throttle objectives only",
        ),
        ({"metric": "cpu_total_usage", "threshold": 2, "action": "throttle"}, "restoreBelow", "needs restoreBelow"),
        ({**CPU_OBJECTIVE, "triggerAfter": 0}, "triggerAfter", "greater than or equal to 1"),
    ],
)
def test_objectives_that_cannot_work_are_rejected(objective: dict[str, Any], path: str, fragment: str) -> None:
    """Each unworkable objective is one error at its own key."""
    [problem] = errors_of({"global": {"guard": {"objectives": [objective]}}})
    assert problem.startswith(f"global.guard.objectives[0].{path}: "), problem
    assert fragment in problem


@pytest.mark.parametrize(
    ("memory", "path", "fragment"),
    [
        ({"minHigh": "10%"}, "minHigh", "not a percentage"),
        ({"minHigh": "lots"}, "minHigh", "expected bytes"),
        ({"minHigh": 4096}, "minHigh", "greater than or equal to 1048576"),
        ({"stepPercent": 0}, "stepPercent", "greater than 0"),
        ({"restoreStepPercent": 101}, "restoreStepPercent", "less than or equal to 100"),
    ],
)
def test_bad_memory_settings_name_their_path_and_value(memory: dict[str, Any], path: str, fragment: str) -> None:
    """Each bad guard.memory value is one error at its own key, saying what was expected."""
    [problem] = errors_of({"global": {"guard": {"memory": memory}}})
    assert problem.startswith(f"global.guard.memory.{path}: "), problem
    assert fragment in problem


def test_memory_settings_take_byte_quantities() -> None:
    """guard.memory.minHigh accepts Kubernetes-style byte quantities."""
    doc = parse_document({"global": {"guard": {"memory": {"minHigh": "128Mi"}}}})
    assert doc.global_.guard.memory.min_high == 128 << 20


@pytest.mark.parametrize(
    ("metric", "threshold", "value", "percent"),
    [
        ("cpu_total_usage", 1.5, 1.5, False),
        ("cpu_total_usage", "1500m", 1.5, False),
        ("cpu_total_usage", "80%", 80.0, True),
        ("memory_total_usage", "8Gi", 8 * 2**30, False),
        ("memory_total_usage", "2G", 2e9, False),
        ("cpu_total_utilization", 75, 75.0, True),
        ("load_average", "1.5", 1.5, False),
    ],
)
def test_threshold_units(metric: str, threshold: object, value: float, percent: bool) -> None:
    """Thresholds accept the metric's own units and percentages of capacity."""
    objective = {"metric": metric, "threshold": threshold, "action": "evict"}
    doc = parse_document({"global": {"guard": {"objectives": [objective]}}})
    parsed = doc.global_.guard.objectives[0].threshold
    assert (parsed.value, parsed.percent) == (value, percent)


def test_per_node_rules_merge_over_global_in_order() -> None:
    """Matching rules override global key by key, later rules win, lists replace, others don't apply."""
    doc = parse_document(
        {
            "global": {"sensing": {"tickSeconds": 2, "discoverySeconds": 7}, "guard": {"objectives": [CPU_OBJECTIVE]}},
            "perNode": [
                {"nodeSelector": {"matchLabels": {"pool": "batch"}}, "sensing": {"tickSeconds": 0.5}},
                {
                    "nodeSelector": {"matchLabels": {"kubernetes.io/hostname": "n1"}},
                    "sensing": {"tickSeconds": 0.25},
                    "guard": {"objectives": []},
                },
                {"nodeSelector": {"matchLabels": {"kubernetes.io/hostname": "other"}}, "sensing": {"tickSeconds": 9}},
            ],
        }
    )
    n1 = doc.settings_for({"kubernetes.io/hostname": "n1", "pool": "batch"})
    assert n1.sensing.tick_seconds == 0.25 and n1.sensing.discovery_seconds == 7
    assert n1.guard.objectives == []
    batch = doc.settings_for({"kubernetes.io/hostname": "n2", "pool": "batch"})
    assert batch.sensing.tick_seconds == 0.5 and len(batch.guard.objectives) == 1
    plain = doc.settings_for({"kubernetes.io/hostname": "n3"})
    assert plain.sensing.tick_seconds == 2
    assert doc.matching_rules({"kubernetes.io/hostname": "n1", "pool": "batch"}) == [0, 1]


def test_match_expressions() -> None:
    """In, NotIn, Exists and DoesNotExist follow Kubernetes label-selector semantics."""
    rule = {
        "nodeSelector": {
            "matchExpressions": [
                {"key": "zone", "operator": "In", "values": ["a", "b"]},
                {"key": "tier", "operator": "NotIn", "values": ["gold"]},
                {"key": "gpu", "operator": "DoesNotExist"},
                {"key": "pool", "operator": "Exists"},
            ]
        },
        "sensing": {"tickSeconds": 3},
    }
    doc = parse_document({"perNode": [rule]})
    assert doc.settings_for({"zone": "a", "tier": "silver", "pool": "x"}).sensing.tick_seconds == 3
    for labels in (
        {"zone": "c", "pool": "x"},
        {"zone": "a", "tier": "gold", "pool": "x"},
        {"zone": "a", "gpu": "1", "pool": "x"},
        {"zone": "a"},
    ):
        assert doc.settings_for(labels).sensing.tick_seconds == 1.0, labels
    assert errors_of({"perNode": [{"nodeSelector": {"matchExpressions": [{"key": "k", "operator": "In"}]}}]})


def test_not_json_and_not_an_object() -> None:
    """Syntax errors give a line and column; a non-object document is one clear error."""
    with pytest.raises(ConfigError, match="line 1 column"):
        parse_text("{nope")
    with pytest.raises(ConfigError, match="expected a JSON object"):
        parse_text("[1, 2]")
    with pytest.raises(ConfigError, match="NaN"):
        parse_text('{"global": {"sensing": {"tickSeconds": NaN}}}')


def test_examples_are_valid() -> None:
    """Every example config shipped in packaging/examples validates."""
    examples = sorted((REPO / "packaging" / "examples").glob("*.json"))
    assert examples
    for path in examples:
        parse_text(path.read_text(), str(path))


def test_committed_schema_is_current() -> None:
    """packaging/nodeguard.schema.json is what the model generates (regenerate with `nodeguard schema`)."""
    committed = json.loads((REPO / "packaging" / "nodeguard.schema.json").read_text())
    assert committed == json.loads(json.dumps(json_schema()))


JSON_SCALARS = st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=12)
JSON = st.recursive(
    JSON_SCALARS,
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=10), children, max_size=4),
    max_leaves=20,
)
KEYS = [
    "global",
    "perNode",
    "sensing",
    "guard",
    "workloads",
    "objectives",
    "metric",
    "threshold",
    "action",
    "restoreBelow",
    "nodeSelector",
    "matchLabels",
    "groups",
    "match",
    "class",
    "tickSeconds",
    "candidates",
]


@st.composite
def config_like(draw: st.DrawFn) -> Any:
    """Documents near the real shape: valid pieces, mutated with wrong types and unknown keys."""
    objective = draw(
        st.fixed_dictionaries(
            {},
            optional={
                "metric": st.sampled_from(
                    ["cpu_total_usage", "memory_total_usage", "load_average", "cpu_pressure", "x"]
                ),
                "threshold": st.sampled_from(["80%", "1500m", "8Gi", 2, -1, "eighty", None, "101%"]) | JSON_SCALARS,
                "action": st.sampled_from(["throttle", "evict", "nap"]),
                "restoreBelow": st.sampled_from(["60%", "90%", 1, "x"]) | JSON,
                "triggerAfter": st.integers(-2, 5) | JSON_SCALARS,
            },
        )
    )
    section = draw(st.dictionaries(st.sampled_from(KEYS), JSON, max_size=3))
    guard = {"objectives": draw(st.lists(st.just(objective) | JSON, max_size=3)), **section}
    rule = {"nodeSelector": draw(st.just({"matchLabels": {"a": "b"}}) | JSON), "guard": guard}
    return draw(
        st.sampled_from(
            [
                {"global": {"guard": guard}},
                {"global": {"guard": guard}, "perNode": [rule]},
                {"perNode": draw(st.lists(st.just(rule) | JSON, max_size=3))},
            ]
        )
        | JSON
    )


@settings(max_examples=300, suppress_health_check=[HealthCheck.too_slow], deadline=None)
@given(config_like())
def test_any_document_gives_config_or_config_error(document: Any) -> None:
    """Generated documents, valid or broken, only ever yield a Document or a ConfigError with paths."""
    try:
        parsed = parse_document(document)
    except ConfigError as exc:
        assert exc.problems and all(": " in p for p in exc.problems)
    else:
        assert isinstance(parsed, Document)
        parsed.settings_for({"a": "b"})


def test_objectives_that_would_feed_on_their_own_throttles_are_refused() -> None:
    """A throttle on cpu_pressure, or an evict on it beside throttles, is refused with the reason and the path:
    nodeguard's own CFS throttles raise node CPU pressure (measured by bench/selfpressure.py)."""
    throttle = {"metric": "cpu_total_utilization", "threshold": "80%", "restoreBelow": "60%", "action": "throttle"}
    pressure = {"metric": "cpu_pressure", "threshold": 40, "restoreBelow": 20, "action": "throttle"}
    with pytest.raises(ConfigError) as raised:
        parse_document({"global": {"guard": {"objectives": [pressure]}}})
    assert raised.value.problems[0].startswith(
        "global.guard.objectives[0].action: a throttle objective on cpu_pressure"
    )
    assert "79 % 'some'" in raised.value.problems[0]
    evict = {"metric": "cpu_pressure", "threshold": 40, "action": "evict"}
    with pytest.raises(ConfigError) as raised:
        parse_document({"global": {"guard": {"objectives": [throttle, evict]}}})
    assert "objectives[1].metric is cpu_pressure" in raised.value.problems[0]
    assert (
        parse_document({"global": {"guard": {"objectives": [evict]}}}).global_.guard.objectives[0].metric
        == "cpu_pressure"
    )


def test_guard_protect_defaults_and_the_old_weight_hold_key() -> None:
    """guard.protect defaults to the planner's former constants; the deprecated guard.weightHoldSeconds sets the
    weights' hold and, unless protect.quotaOffSeconds is given, the quota lever's off time too."""

    def protect(guard: dict[str, Any]) -> dict[str, Any]:
        settings = parse_document({"global": {"guard": guard}}).settings_for({})
        return settings.guard.protect.model_dump(by_alias=True)

    assert protect({}) == {
        "weightHoldSeconds": 300.0,
        "drainShare": 0.5,
        "drainPatienceTicks": 20,
        "streakTicks": 4,
        "trialTicks": 10,
        "futileShare": 0.7,
        "quotaOffSeconds": 300.0,
        "quietTicks": 3,
    }
    assert protect({"weightHoldSeconds": 60}) == protect({"protect": {"weightHoldSeconds": 60, "quotaOffSeconds": 60}})
    both = protect({"weightHoldSeconds": 60, "protect": {"quotaOffSeconds": 5}})
    assert (both["weightHoldSeconds"], both["quotaOffSeconds"]) == (60.0, 5.0)
    only = protect({"protect": {"weightHoldSeconds": 60}})
    assert (only["weightHoldSeconds"], only["quotaOffSeconds"]) == (60.0, 300.0), "separate timers once split"


def test_a_bad_protect_value_names_its_path_and_value() -> None:
    """A guard.protect value out of range names its JSON path and the value; two holds that disagree are refused."""
    assert errors_of({"global": {"guard": {"protect": {"futileShare": 1.5}}}}) == [
        "global.guard.protect.futileShare: Input should be less than or equal to 1, got 1.5"
    ]
    assert errors_of({"perNode": [{"nodeSelector": {}, "guard": {"protect": {"streakTicks": 0}}}]}) == [
        "perNode[0].guard.protect.streakTicks: Input should be greater than or equal to 1, got 0"
    ]
    (problem,) = errors_of({"global": {"guard": {"weightHoldSeconds": 60, "protect": {"weightHoldSeconds": 5}}}})
    assert problem.startswith("global.guard: weightHoldSeconds (60.0) and protect.weightHoldSeconds (5.0) disagree")
