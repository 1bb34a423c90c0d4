"""Label and pod selectors: Kubernetes LabelSelector semantics, one implementation for nodes and pods."""

from __future__ import annotations

from typing import Any

import pytest

from nodeguard.config import parse_document
from nodeguard.errors import ConfigError
from nodeguard.selectors import LabelSelector, PodSelector

STALL = {"metric": "protected_cpu_stall", "threshold": "5%", "restoreBelow": "1%", "action": "throttle"}


def selector(*expressions: dict[str, Any], **labels: str) -> LabelSelector:
    return LabelSelector.model_validate({"matchLabels": labels, "matchExpressions": list(expressions)})


@pytest.mark.parametrize(
    ("expression", "labels", "matches"),
    [
        ({"key": "tier", "operator": "In", "values": ["web", "api"]}, {"tier": "api"}, True),
        ({"key": "tier", "operator": "In", "values": ["web", "api"]}, {"tier": "batch"}, False),
        ({"key": "tier", "operator": "In", "values": ["web", "api"]}, {}, False),
        ({"key": "tier", "operator": "In", "values": [""]}, {"tier": ""}, True),
        ({"key": "tier", "operator": "NotIn", "values": ["gold"]}, {"tier": "silver"}, True),
        ({"key": "tier", "operator": "NotIn", "values": ["gold"]}, {"tier": "gold"}, False),
        ({"key": "tier", "operator": "NotIn", "values": ["gold"]}, {}, True),  # a missing label is not in them
        ({"key": "gpu", "operator": "Exists"}, {"gpu": ""}, True),
        ({"key": "gpu", "operator": "Exists"}, {"cpu": "x"}, False),
        ({"key": "gpu", "operator": "DoesNotExist"}, {"cpu": "x"}, True),
        ({"key": "gpu", "operator": "DoesNotExist"}, {"gpu": "a100"}, False),
    ],
)
def test_every_operator_as_kubernetes_has_it(expression: dict[str, Any], labels: dict[str, str], matches: bool) -> None:
    """In, NotIn, Exists and DoesNotExist decide as apimachinery's label selector does, NotIn matching a
    missing label."""
    assert selector(expression).matches(labels) is matches


def test_every_term_must_hold_and_an_empty_selector_takes_everything() -> None:
    """matchLabels and matchExpressions are ANDed; an empty selector matches any labels, none included."""
    both = selector({"key": "gpu", "operator": "DoesNotExist"}, app="web")
    assert both.matches({"app": "web"})
    assert not both.matches({"app": "web", "gpu": "1"})
    assert not both.matches({"app": "api"})
    assert LabelSelector().matches({}) and LabelSelector().matches({"a": "b"})


def test_a_pod_selector_wants_its_namespace_and_its_labels() -> None:
    """A pod selector takes pods in one of its namespaces whose labels match; an unknown namespace is in none."""
    by_both = PodSelector.model_validate({"namespaces": ["batch"], "labelSelector": {"matchLabels": {"team": "ml"}}})
    assert by_both.matches("batch", {"team": "ml"})
    assert not by_both.matches("batch", {"team": "web"})
    assert not by_both.matches("prod", {"team": "ml"})
    assert not by_both.matches(None, {"team": "ml"})
    by_namespace = PodSelector.model_validate({"namespaces": ["batch", "ci"]})
    assert by_namespace.matches("ci", {}) and not by_namespace.matches("prod", {})
    assert by_both.shown() == "namespaces batch; labels team=ml"


def test_the_node_selector_is_the_same_selector() -> None:
    """perNode's nodeSelector is a LabelSelector: its NotIn matches a node without the label, as Kubernetes does."""
    rule = {"nodeSelector": {"matchExpressions": [{"key": "pool", "operator": "NotIn", "values": ["gpu"]}]},
            "sensing": {"tickSeconds": 3}}  # fmt: skip
    document = parse_document({"perNode": [rule]})
    assert isinstance(document.per_node[0].node_selector, LabelSelector)
    assert document.settings_for({"kubernetes.io/hostname": "n1"}).sensing.tick_seconds == 3
    assert document.settings_for({"pool": "gpu"}).sensing.tick_seconds == 1.0


def problems(document: dict[str, Any]) -> list[str]:
    with pytest.raises(ConfigError) as caught:
        parse_document(document)
    return caught.value.problems


def test_selector_errors_name_their_json_path_and_value() -> None:
    """A bad selector anywhere (nodeSelector, candidates, exempt, an objective's protect) is one line naming its
    JSON path and the value."""
    bad_operator = {"key": "tier", "operator": "Near", "values": ["a"]}
    assert problems({"perNode": [{"nodeSelector": {"matchExpressions": [bad_operator]}}]}) == [
        "perNode[0].nodeSelector.matchExpressions[0].operator: Input should be 'In', 'NotIn', 'Exists' or "
        "'DoesNotExist', got \"Near\""
    ]
    guard = {
        "candidates": {"namespaces": ["Batch"], "labelSelector": {"matchLabels": {"team": "a b"}}},
        "exempt": {"pods": [{}, {"labelSelector": {"matchExpressions": [{"key": "gpu", "operator": "Exists",
                                                                          "values": ["x"]}]}}]},
        "objectives": [{**STALL, "protect": ["web-*", 7, {"namespaces": []}]}],
    }  # fmt: skip
    assert problems({"global": {"guard": guard}}) == [
        "global.guard.objectives[0].protect[1]: expected a glob (a string) or a pod selector (an object), got 7",
        "global.guard.objectives[0].protect[2].namespaces: List should have at least 1 item after validation, "
        "not 0, got []",
        "global.guard.candidates.namespaces[0]: expected a namespace name: at most 63 lower-case letters, digits "
        "or '-', not at either end, got \"Batch\"",
        "global.guard.candidates.labelSelector.matchLabels.team: expected a label value: empty, or at most 63 "
        "letters, digits, '-', '_' or '.', beginning and ending with a letter or digit, got \"a b\"",
        "global.guard.exempt.pods[0]: select by namespaces, labelSelector or both (an empty selector would take "
        "every pod), got {}",
        "global.guard.exempt.pods[1].labelSelector.matchExpressions[0]: operator Exists takes no values, got "
        '{"key":"gpu","operator":"Exists","values":["x"]}',
    ]


@pytest.mark.parametrize(
    ("key", "valid"),
    [
        ("app", True),
        ("node.kubernetes.io/pool", True),
        ("app.kubernetes.io/part-of", True),
        ("a" * 63, True),
        ("a" * 64, False),
        ("-app", False),
        ("a/b/c", False),
        ("Example.com/app", False),  # the prefix is a DNS subdomain: lower case
        ("", False),
    ],
)
def test_label_keys_are_checked_as_kubernetes_checks_them(key: str, valid: bool) -> None:
    """A label key is an optional DNS subdomain prefix and a name of at most 63 characters."""
    document = {"perNode": [{"nodeSelector": {"matchLabels": {key: "x"}}}]}
    if valid:
        parse_document(document)
    else:
        assert problems(document)[0].startswith(f"perNode[0].nodeSelector.matchLabels.{key}")
