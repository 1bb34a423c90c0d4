"""The shipped monitoring as the packaging tests read it: the Grafana dashboard, the alert rules, and the metric
names nodeguard exports."""

from __future__ import annotations

import ast
import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import yaml

from nodeguard.model.levers import LEVERS

REPO = Path(__file__).resolve().parents[2]
DASHBOARD = REPO / "packaging" / "grafana" / "nodeguard-dashboard.json"
RULES = REPO / "packaging" / "prometheus" / "nodeguard-alerts.yaml"
METRIC_NAME = re.compile(r"\bnodeguard_[a-z_]+\b")
# The lever gauges are named by each lever's terms (nodeguard.model.levers), which the collector iterates over.
LEVER_GAUGES = {name for t in LEVERS for name in (t.count_metric, t.value_metric, t.original_metric) if name}


def exported_metric_names(source: str) -> set[str]:
    """Metric names in nodeguard.surfaces.metrics' source: string literals, f-strings over a literal loop, histograms.

    ``f"nodeguard_semaphore_{field}"`` inside ``for field in ("allotment", ...)`` gives one name per element;
    a ``Histogram("name", ...)`` is exported as ``name_bucket``, ``name_sum`` and ``name_count``.
    """
    names = set(re.findall(r"[\"'](nodeguard_[a-z_]+)[\"']", source))
    tree = ast.parse(source)
    for loop in ast.walk(tree):
        if not (
            isinstance(loop, ast.For)
            and isinstance(loop.target, ast.Name)
            and isinstance(loop.iter, ast.Tuple | ast.List)
        ):
            continue
        values = [e.value for e in loop.iter.elts if isinstance(e, ast.Constant) and isinstance(e.value, str)]
        for node in ast.walk(loop):
            if not isinstance(node, ast.JoinedStr):
                continue
            parts = node.values
            names.update(
                "".join(p.value if isinstance(p, ast.Constant) else value for p in parts)
                for value in values
                if all(
                    isinstance(p, ast.Constant)
                    or (
                        isinstance(p, ast.FormattedValue)
                        and isinstance(p.value, ast.Name)
                        and p.value.id == loop.target.id
                    )
                    for p in parts
                )
            )
    for histogram in re.findall(r"Histogram\(\s*[\"'](nodeguard_[a-z_]+)[\"']", source):
        names.update(f"{histogram}{suffix}" for suffix in ("_bucket", "_sum", "_count"))
    return {n for n in names if METRIC_NAME.fullmatch(n) and not n.endswith("_")}


def dashboard() -> dict[str, Any]:
    """The dashboard's JSON model."""
    return json.loads(DASHBOARD.read_text(encoding="utf-8"))


def all_panels(panels: list[dict[str, Any]]) -> Iterator[dict[str, Any]]:
    """Every panel, those inside rows too."""
    for panel in panels:
        yield panel
        yield from all_panels(panel.get("panels", []))


def alert_rules() -> list[dict[str, Any]]:
    """Every rule of every group of the alert rules."""
    return [rule for group in yaml.safe_load(RULES.read_text())["groups"] for rule in group["rules"]]
