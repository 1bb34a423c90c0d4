"""packaging/prometheus/nodeguard-alerts.yaml: valid for promtool, each alert unit-tested firing and not firing,
on metrics nodeguard exports, and the same rules as the PrometheusRule manifest."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

import nodeguard.surfaces.metrics
from tests.packaging.monitoring import LEVER_GAUGES, METRIC_NAME, RULES, alert_rules, exported_metric_names

REPO = Path(__file__).resolve().parents[2]
RULE_TESTS = REPO / "packaging" / "prometheus" / "nodeguard-alerts.test.yaml"
MANIFEST = REPO / "packaging" / "kubernetes" / "prometheus-operator" / "nodeguard-prometheusrule.yaml"
# What issue 25 asks the alerts to cover, by alert name.
REQUIRED = {
    "NodeguardNotTicking",
    "NodeguardRestoresFailing",
    "NodeguardWritesRefused",
    "NodeguardProtectedWorkloadStalled",
    "NodeguardGateBackingUp",
    "NodeguardCoordinationLost",
}
PROMTOOL = shutil.which("promtool")
needs_promtool = pytest.mark.skipif(
    PROMTOOL is None, reason="promtool missing: scripts/setup installs Debian's prometheus package, which has it"
)


def promtool(*args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    assert PROMTOOL is not None
    return subprocess.run([PROMTOOL, *args], cwd=cwd, capture_output=True, text=True, timeout=60)


def test_the_alerts_cover_what_an_operator_must_hear_about() -> None:
    """Every alert the issue names is in the rules file, each with a severity, a summary and a description."""
    found = {rule["alert"]: rule for rule in alert_rules()}
    assert set(found) >= REQUIRED, f"missing: {REQUIRED - set(found)}"
    for name, rule in found.items():
        assert rule["labels"]["severity"] in ("critical", "warning"), name
        assert {"summary", "description"} <= set(rule["annotations"]), name


def test_the_alerts_query_only_metrics_nodeguard_exports() -> None:
    """Every nodeguard_* name in an alert expression is a metric nodeguard.surfaces.metrics exports."""
    exported = exported_metric_names(Path(nodeguard.surfaces.metrics.__file__).read_text()) | LEVER_GAUGES
    assert "nodeguard_restore_failures_total" in exported
    used = {name for rule in alert_rules() for name in METRIC_NAME.findall(rule["expr"])}
    assert used - exported == set(), f"not exported: {used - exported}"


def test_the_prometheusrule_manifest_holds_the_same_rules() -> None:
    """The PrometheusRule's spec is the rules file's groups, rule for rule, so neither drifts from the other."""
    manifest = yaml.safe_load(MANIFEST.read_text())
    assert (manifest["apiVersion"], manifest["kind"]) == ("monitoring.coreos.com/v1", "PrometheusRule")
    assert manifest["metadata"]["namespace"] == "nodeguard"
    assert manifest["spec"] == yaml.safe_load(RULES.read_text())


@needs_promtool
def test_promtool_checks_the_rules_and_passes_their_unit_tests() -> None:
    """promtool check rules accepts the file and promtool test rules passes every firing and not-firing case."""
    checked = promtool("check", "rules", str(RULES), cwd=RULES.parent)
    assert checked.returncode == 0, checked.stdout + checked.stderr
    tested = promtool("test", "rules", RULE_TESTS.name, cwd=RULES.parent)
    assert tested.returncode == 0, tested.stdout + tested.stderr


@needs_promtool
def test_each_alert_has_a_firing_and_a_not_firing_unit_test(tmp_path: Path) -> None:
    """With one alert's expression made never true, or its `for` taken away, the unit tests fail: so each alert
    is tested firing, and tested not firing before its time."""
    tested = {t["alertname"] for case in yaml.safe_load(RULE_TESTS.read_text())["tests"]
              for t in case["alert_rule_test"]}  # fmt: skip
    assert {rule["alert"] for rule in alert_rules()} <= tested
    shutil.copy(RULE_TESTS, tmp_path / RULE_TESTS.name)
    document = yaml.safe_load(RULES.read_text())
    unnoticed = []
    for index, rule in enumerate(alert_rules()):
        for what, change in (("never true", {"expr": "vector(1) == 0"}), ("no `for`", {"for": "0s"})):
            mutated = yaml.safe_load(RULES.read_text())
            mutated["groups"][0]["rules"][index].update(change)
            assert len(document["groups"]) == 1
            (tmp_path / RULES.name).write_text(yaml.safe_dump(mutated))
            if promtool("test", "rules", RULE_TESTS.name, cwd=tmp_path).returncode == 0:
                unnoticed.append(f"{rule['alert']}: {what}")
    assert unnoticed == [], f"changes no unit test notices: {unnoticed}"
