"""packaging/grafana/nodeguard-dashboard.json: well formed, and it queries only metrics nodeguard exports."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import pytest

import nodeguard.surfaces.metrics
from tests.packaging.monitoring import LEVER_GAUGES, METRIC_NAME, all_panels, dashboard, exported_metric_names

REPO = Path(__file__).resolve().parents[2]
GRAFANA_BUILTINS = {"__rate_interval", "__interval", "__range", "__range_s", "__interval_ms"}
# The metrics the dashboard is there to show.
REQUIRED = {
    "nodeguard_node_usage",
    "nodeguard_protected_cpu_stall_ratio",
    "nodeguard_waterline",
    "nodeguard_restore_waterline",
    "nodeguard_gap",
    "nodeguard_throttled_workloads",
    "nodeguard_throttle_quota_cores",
    "nodeguard_throttle_original_quota_cores",
    "nodeguard_workload_cpu_usage_cores",
    "nodeguard_actions_total",
    "nodeguard_quota_drift_total",
    "nodeguard_write_errors_total",
    "nodeguard_tick_duration_seconds_bucket",
    "nodeguard_gate_loads",
    "nodeguard_gate_wait_seconds_bucket",
    "nodeguard_semaphore_allotment",
    "nodeguard_semaphore_held",
    "nodeguard_semaphore_waiting",
    "nodeguard_mqtt_connected",
    "nodeguard_mqtt_messages_rejected_total",
    "nodeguard_tick_errors_total",
}


EXPORTED = exported_metric_names(Path(nodeguard.surfaces.metrics.__file__).read_text(encoding="utf-8")) | LEVER_GAUGES


def exprs() -> list[str]:
    return [t["expr"] for p in all_panels(dashboard()["panels"]) for t in p.get("targets", [])]


def variables() -> dict[str, dict[str, Any]]:
    return {v["name"]: v for v in dashboard()["templating"]["list"]}


def balanced(expr: str) -> bool:
    """Brackets nest and close, outside string literals; string literals close."""
    closing = {")": "(", "]": "[", "}": "{"}
    stack: list[str] = []
    quote = ""
    escaped = False
    for char in expr:
        if quote:
            if escaped:
                escaped = False
            elif char == "\\":
                escaped = True
            elif char == quote:
                quote = ""
        elif char in "\"'`":
            quote = char
        elif char in "([{":
            stack.append(char)
        elif char in closing and (not stack or stack.pop() != closing[char]):
            return False
    return not stack and not quote


def test_metric_names_are_read_from_the_source() -> None:
    """The names read from nodeguard.surfaces.metrics include plain, f-string-built and histogram names."""
    assert {"nodeguard_build_info", "nodeguard_semaphore_held", "nodeguard_tick_duration_seconds_bucket"} <= EXPORTED
    source = 'for f in ("a", "b"):\n    g(f"nodeguard_x_{f}")\nHistogram("nodeguard_h_seconds")\n"nodeguard_y"'
    assert exported_metric_names(source) == {
        "nodeguard_x_a",
        "nodeguard_x_b",
        "nodeguard_y",
        "nodeguard_h_seconds",
        "nodeguard_h_seconds_bucket",
        "nodeguard_h_seconds_sum",
        "nodeguard_h_seconds_count",
    }


def test_dashboard_is_a_grafana_10_model() -> None:
    """The JSON has the Grafana 10 top-level fields, a stable uid and a panel list."""
    model = dashboard()
    assert model["schemaVersion"] >= 37  # Grafana 10.0
    assert model["uid"] == "nodeguard" and model["title"]
    assert model["id"] is None  # importable into any Grafana
    assert model["panels"]


def test_panel_ids_are_unique() -> None:
    """No two panels (rows and nested panels included) share an id."""
    ids = [p["id"] for p in all_panels(dashboard()["panels"])]
    assert len(ids) == len(set(ids))
    assert all(isinstance(i, int) for i in ids)


def test_panels_fit_the_grid() -> None:
    """Every panel has a grid position inside Grafana's 24 columns."""
    for panel in all_panels(dashboard()["panels"]):
        pos = panel["gridPos"]
        assert pos["w"] > 0 and pos["h"] > 0 and pos["x"] >= 0 and pos["x"] + pos["w"] <= 24, panel["title"]


def test_datasource_and_node_variables() -> None:
    """A DS_PROMETHEUS data source variable feeds every query, and a node variable lists nodeguard instances."""
    found = variables()
    assert found["DS_PROMETHEUS"]["type"] == "datasource"
    assert found["DS_PROMETHEUS"]["query"] == "prometheus"
    node = found["node"]
    query = node["query"]["query"] if isinstance(node["query"], dict) else node["query"]
    assert query == "label_values(nodeguard_build_info, instance)"
    for panel in all_panels(dashboard()["panels"]):
        for item in (panel, *panel.get("targets", [])):
            if "datasource" in item:
                assert item["datasource"]["uid"] == "${DS_PROMETHEUS}", panel["title"]


def test_variable_queries_use_only_exported_metrics() -> None:
    """Every query variable asks Prometheus about metrics that nodeguard exports."""
    for variable in variables().values():
        if variable["type"] != "query":
            continue
        query = variable["query"]["query"] if isinstance(variable["query"], dict) else variable["query"]
        names = set(METRIC_NAME.findall(query))
        assert names and names <= EXPORTED, (variable["name"], query)
        assert balanced(query), query


@pytest.mark.parametrize("expr", exprs())
def test_expression_is_well_formed(expr: str) -> None:
    """Each query's brackets and quotes balance, and every $variable it uses is defined or built in."""
    assert expr.strip()
    assert balanced(expr), expr
    used = set(re.findall(r"\$\{?(\w+)", expr))
    assert used <= set(variables()) | GRAFANA_BUILTINS, used


@pytest.mark.parametrize("expr", exprs())
def test_expression_uses_only_exported_metrics(expr: str) -> None:
    """Each query names at least one metric, and only metrics that nodeguard exports."""
    names = set(METRIC_NAME.findall(expr))
    assert names, expr
    assert names <= EXPORTED, names - EXPORTED


def test_every_required_metric_has_a_panel() -> None:
    """Every metric the dashboard is meant to show appears in some query."""
    shown = {name for expr in exprs() for name in METRIC_NAME.findall(expr)}
    assert shown >= REQUIRED, REQUIRED - shown
    assert REQUIRED <= EXPORTED, REQUIRED - EXPORTED


def test_balance_check_can_fail() -> None:
    """The well-formedness check rejects unbalanced brackets and open quotes."""
    assert balanced('sum by (le) (rate(x{a="(}"}[5m]))')
    for bad in ("rate(x[5m]", 'x{a="b}', "x{a='b'}]", "histogram_quantile(0.9, sum(rate(x[5m]))"):
        assert not balanced(bad), bad
