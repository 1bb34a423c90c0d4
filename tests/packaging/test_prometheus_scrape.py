"""A real Prometheus scrapes a real nodeguard: every Grafana dashboard query and every alert's metrics return series.

The daemon (``nodeguard run``, not a dry run) guards two groups of its own on this host's cgroup v1 cpu hierarchy:
a protected one and a BestEffort one it really throttles (a node waterline of 0.01 cores, which any machine is
over), with its gate serving (one load admitted) and coordination on (a real mosquitto, one seed node holding a
cluster semaphore). Debian's ``prometheus`` scrapes it every second with the shipped alert rules loaded; the test
asks Prometheus's HTTP API.
"""

from __future__ import annotations

import json
import re
import shutil
import signal
import subprocess
import sys
import urllib.parse
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.packaging.monitoring import METRIC_NAME, RULES, alert_rules, all_panels, dashboard
from tests.support import cgroups as rc
from tests.support.broker import Broker, listening, skip_without_mosquitto
from tests.support.daemon import DaemonProcess
from tests.support.node import plain_node
from tests.support.poll import wait_until
from tests.support.ports import free_port
from tests.support.workloads import start_duty_cycle

PROMETHEUS = shutil.which("prometheus")
NODE = "ng-scrape"
DEADLINE = 45.0  # seconds for every query to return data; it takes about 10 on a quiet machine
LEGEND_LABEL = re.compile(r"\{\{\s*(\w+)\s*\}\}")
ANNOTATION_LABEL = re.compile(r"\$labels\.(\w+)")
COMPARISON = re.compile(r"(==|!=|>=|<=|>|<)(?!\s*bool\b)")
# Queries that cannot return a series here, each with why. Asserted precisely: the query is empty and the metric
# has no sample in the daemon's own /metrics (only its HELP and TYPE lines).
NO_SERIES_HERE = {
    "nodeguard_write_errors_total": "a counter per errno, with no series before the kernel refuses a write; "
    "the kernel refuses none of the throttles on the test's own groups",
}


def api(base: str, path: str, **params: str) -> Any:
    url = f"{base}/api/v1/{path}?{urllib.parse.urlencode(params)}"
    with urllib.request.urlopen(url, timeout=5) as response:
        body = json.loads(response.read())
    assert body["status"] == "success", body
    return body["data"]


def query(base: str, expr: str) -> list[dict[str, Any]]:
    data = api(base, "query", query=expr)
    assert data["resultType"] == "vector", (expr, data)
    return list(data["result"])


def answers_ready(base: str) -> bool:
    """Whether Prometheus answers /-/ready with 200 (it answers 503 while its storage opens)."""
    try:
        with urllib.request.urlopen(f"{base}/-/ready", timeout=5) as response:
            return bool(response.status == 200)
    except OSError:
        return False


def wait_ready(base: str, log: Path, timeout: float = 30.0) -> None:
    """Until Prometheus is ready, or fail with its log."""
    wait_until(lambda: answers_ready(base), timeout, "Prometheus ready", interval=0.2,
               detail=lambda: log.read_text()[-3000:])  # fmt: skip


def dashboard_targets() -> list[tuple[str, str, str]]:
    """(panel title, expression, legend format) of every panel target."""
    return [
        (panel.get("title", ""), target["expr"], target.get("legendFormat", ""))
        for panel in all_panels(dashboard()["panels"])
        for target in panel.get("targets", [])
        if "expr" in target
    ]


def variable_query(name: str) -> str:
    found = [v for v in dashboard()["templating"]["list"] if v["name"] == name]
    assert found, name
    return str(found[0]["query"]["query"])


def label_values(base: str, definition: str) -> list[str]:
    """Grafana's label_values(SELECTOR, LABEL) through Prometheus's series API."""
    match = re.fullmatch(r"label_values\((.+),\s*(\w+)\)", definition)
    assert match, definition
    series = api(base, "series", **{"match[]": match.group(1)})
    return sorted({s[match.group(2)] for s in series if match.group(2) in s})


@pytest.fixture
def prometheus_dir(tmp_path: Path) -> Path:
    if PROMETHEUS is None:
        pytest.skip("prometheus missing: scripts/setup installs Debian's prometheus package")
    skip_without_mosquitto()
    return tmp_path


@pytest.fixture
def scraped_daemon(prometheus_dir: Path) -> Iterator[tuple[str, DaemonProcess]]:
    """A guarding, gating, coordinating daemon on the test's own v1 groups, and Prometheus's URL scraping it."""
    tmp = prometheus_dir
    hierarchy = rc.v1_cpu_hierarchy()  # skips without root or a v1 cpu hierarchy
    broker = Broker(tmp).start()
    try:
        with plain_node(hierarchy, burners=1) as node:  # stops its processes and removes its groups on the way out
            # Light duty cycles: a protected workload with a stall to read, a BestEffort one to throttle.
            node.procs.append(start_duty_cycle(0.1, *hierarchy.dirs(node.important.inner)))
            node.procs.append(start_duty_cycle(0.1, *hierarchy.dirs(node.burners[0].inner)))
            port = free_port()
            config = node.config(
                tmp / "run/ledger.json",
                [
                    {"metric": "cpu_total_usage", "action": "throttle", "threshold": 0.01, "restoreBelow": 0.005},
                    {"metric": "protected_cpu_stall", "action": "throttle", "threshold": "90%", "restoreBelow": "50%"},
                ],
            )
            config["global"]["http"] = {"listen": f"127.0.0.1:{port}"}
            config["global"]["gate"] = {"socket": str(tmp / "run/gate.sock")}
            config["global"]["coordination"] = {
                "enabled": True, "cluster": "scrape", "seeds": [NODE], "semaphores": {"prepare": 2},
                "stateDir": str(tmp / "run/coordination"),
                "broker": {"host": "127.0.0.1", "port": broker.port},
            }  # fmt: skip
            daemon = DaemonProcess(config, tmp).start(env={"NODE_NAME": NODE})
            try:
                daemon.wait_for(lambda: listening(port), 15, "the daemon's HTTP endpoints")
                admit = subprocess.run(
                    [sys.executable, "-m", "nodeguard", "admit", "--socket", str(tmp / "run/gate.sock"),
                     "--name", "scrape-load", "--connect-timeout", "15"],
                    capture_output=True, text=True, timeout=30, cwd=str(Path(__file__).parents[2]),
                )  # fmt: skip
                assert admit.returncode == 0, admit.stderr
                prom_port = free_port()
                (tmp / "prometheus.yml").write_text(
                    yaml.safe_dump(
                        {
                            "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
                            "rule_files": [str(RULES)],
                            "scrape_configs": [
                                {"job_name": "nodeguard", "static_configs": [{"targets": [f"127.0.0.1:{port}"]}]}
                            ],
                        }
                    )
                )
                prom_log = (tmp / "prometheus.log").open("wb")
                prometheus = subprocess.Popen(
                    [PROMETHEUS or "prometheus", f"--config.file={tmp / 'prometheus.yml'}",
                     f"--storage.tsdb.path={tmp / 'tsdb'}", f"--web.listen-address=127.0.0.1:{prom_port}"],
                    stdout=prom_log, stderr=prom_log,
                )  # fmt: skip
                prom_log.close()
                try:
                    wait_ready(f"http://127.0.0.1:{prom_port}", tmp / "prometheus.log")
                    yield f"http://127.0.0.1:{prom_port}", daemon
                finally:
                    prometheus.send_signal(signal.SIGTERM)
                    try:
                        prometheus.wait(10)
                    except subprocess.TimeoutExpired:
                        prometheus.kill()
                        prometheus.wait()
            finally:
                daemon.signal(signal.SIGTERM)
                try:
                    assert daemon.wait(15) == 0, daemon.log_path.read_text()[-4000:]
                finally:
                    daemon.kill()
                assert not node.changed(), "SIGTERM put every quota and weight back"
    finally:
        broker.stop()


def with_bool(expr: str) -> str:
    """The expression with every comparison made a ``bool`` one: each series it compares is kept, valued 0 or 1.

    So the alert's expression returns the series (and labels) it would fire with, whether or not its condition
    holds now. Comparisons inside label matchers (``{job="x"}``) and strings are left alone.
    """
    out, depth, quote = [], 0, ""
    i = 0
    while i < len(expr):
        char = expr[i]
        if quote:
            quote = "" if char == quote and expr[i - 1] != "\\" else quote
        elif char in "\"'`":
            quote = char
        elif char in "{}":
            depth += 1 if char == "{" else -1
        elif depth == 0 and (match := COMPARISON.match(expr, i)):
            out.append(match.group(1) + " bool")
            i = match.end()
            continue
        out.append(char)
        i += 1
    return "".join(out)


def test_with_bool_turns_each_comparison_outside_matchers_into_a_bool_one() -> None:
    """Comparisons between vectors and scalars get ``bool``; label matchers, strings and present ``bool``s do not."""
    assert with_bool('up{job="nodeguard"} == 0') == 'up{job="nodeguard"} == bool 0'
    assert with_bool('a{x!="1",y=~">"} >= 2 or b < bool 1') == 'a{x!="1",y=~">"} >= bool 2 or b < bool 1'
    assert with_bool("100 * a > on (job) group_left () min by (job) (b)") == (
        "100 * a > bool on (job) group_left () min by (job) (b)"
    )
    assert [with_bool(rule["expr"]).count(" bool") for rule in alert_rules()] == [1, 1, 1, 2, 1, 1, 2]


def expand(expr: str, metric: str) -> str:
    """The expression as Grafana sends it with every node selected and one guard metric."""
    return expr.replace("$node", ".*").replace("$metric", metric)


def missing_labels(series: list[dict[str, Any]], legend: str) -> list[str]:
    wanted = set(LEGEND_LABEL.findall(legend))
    return [f"{s['metric']} lacks {sorted(wanted - set(s['metric']))}" for s in series if wanted - set(s["metric"])]


def test_every_dashboard_query_and_alert_metric_returns_series(scraped_daemon: tuple[str, DaemonProcess]) -> None:
    """Every dashboard query returns series with the labels its legend shows, every metric an alert reads has a
    series from the nodeguard job, and Prometheus evaluates every rule without error."""
    base, daemon = scraped_daemon
    targets = dashboard_targets()
    assert len(targets) >= 20
    alert_exprs = [rule["expr"] for rule in alert_rules()]
    alert_metrics = sorted({name for expr in alert_exprs for name in METRIC_NAME.findall(expr)})

    def empty() -> list[str]:
        metrics = label_values(base, variable_query("metric").replace("$node", ".*"))
        if not metrics:
            return ["the metric variable has no values"]
        missing = [
            expand(expr, metric)
            for _, expr, _ in targets
            for metric in (metrics if "$metric" in expr else [""])
            if not any(name in expr for name in NO_SERIES_HERE) and not query(base, expand(expr, metric))
        ]
        missing += [name for name in alert_metrics if name not in NO_SERIES_HERE and not query(base, name)]
        return missing

    wait_until(lambda: not empty(), DEADLINE, "a series for every query", interval=1.0, give_up=daemon.exited,
               detail=lambda: f"no series for {empty()}; daemon log:\n{daemon.log_path.read_text()[-3000:]}")  # fmt: skip

    # The variables: every node (instance) and every guard metric the objectives name.
    instances = label_values(base, variable_query("node"))
    assert len(instances) == 1 and instances[0].startswith("127.0.0.1:"), instances
    assert label_values(base, variable_query("metric").replace("$node", ".*")) == [
        "cpu_total_usage",
        "protected_cpu_stall",
    ]
    # Each query's series carry the labels its legend names; the throttle is real (held under its original).
    for title, expr, legend in targets:
        if any(name in expr for name in NO_SERIES_HERE):
            continue
        for metric in ("cpu_total_usage", "protected_cpu_stall") if "$metric" in expr else ("",):
            series = query(base, expand(expr, metric))
            assert not missing_labels(series, legend), (title, expr, missing_labels(series, legend))
    held = query(base, "nodeguard_throttle_quota_cores")
    assert held and all(s["metric"]["workload"].endswith("/be-0") for s in held), held
    assert float(query(base, "nodeguard_throttled_workloads")[0]["value"][1]) >= 1
    assert float(query(base, "nodeguard_semaphore_allotment")[0]["value"][1]) == 2
    assert float(query(base, "nodeguard_mqtt_connected")[0]["value"][1]) == 1
    stall = query(base, "nodeguard_protected_cpu_stall_ratio")
    assert [s["metric"]["workload"].rsplit("/", 1)[-1] for s in stall] == ["important"], stall
    # Every metric an alert reads comes from the nodeguard job with its instance, as the rules' `by` clauses expect.
    assert query(base, 'up{job="nodeguard"}')[0]["value"][1] == "1"
    for name in alert_metrics:
        if name in NO_SERIES_HERE:
            continue
        for series in query(base, name):
            assert series["metric"]["job"] == "nodeguard" and series["metric"]["instance"] == instances[0], series
    assert query(base, 'nodeguard_waterline{metric="protected_cpu_stall", action="throttle"}')
    # The queries left out, precisely: Prometheus has no series of the metric, and neither has the daemon.
    with urllib.request.urlopen(f"http://{instances[0]}/metrics", timeout=5) as response:
        exposition = response.read().decode()
    for name, why in NO_SERIES_HERE.items():
        assert query(base, name) == [], why
        assert f"# TYPE {name} counter" in exposition, name
        samples = [line for line in exposition.splitlines() if line.startswith(name.removesuffix("_total"))
                   and not line.startswith("#")]  # fmt: skip
        assert samples == [], (why, samples)
        for _, expr, _ in targets:
            if name in expr:
                assert query(base, expand(expr, "")) == [], expr
    # Each alert's expression, its comparisons made bool ones, returns the series it would fire with, and they carry
    # every label its annotations name (the alerts' conditions do not hold here: a healthy node).
    for rule in alert_rules():
        series = query(base, with_bool(rule["expr"]))
        wanted = {"job", "instance"} | set(ANNOTATION_LABEL.findall(json.dumps(rule["annotations"])))
        assert series, (rule["alert"], with_bool(rule["expr"]))
        for one in series:
            assert wanted <= set(one["metric"]), (rule["alert"], sorted(wanted - set(one["metric"])), one)
            assert one["metric"]["instance"] == instances[0], (rule["alert"], one)
            assert one["value"][1] in ("0", "1"), (rule["alert"], one)
    # Prometheus loaded the shipped rules and evaluated each one without error.
    rules = [r for g in api(base, "rules")["groups"] for r in g["rules"]]
    assert {r["name"] for r in rules} == {r["alert"] for g in yaml.safe_load(RULES.read_text())["groups"]
                                          for r in g["rules"]}  # fmt: skip

    def unhealthy() -> list[tuple[str, str | None, str | None]]:
        rules = [r for g in api(base, "rules")["groups"] for r in g["rules"]]
        return [(r["name"], r.get("health"), r.get("lastError")) for r in rules if r.get("health") != "ok"]

    wait_until(lambda: not unhealthy(), DEADLINE, "every rule evaluated", interval=1.0, detail=lambda: str(unhealthy()))
