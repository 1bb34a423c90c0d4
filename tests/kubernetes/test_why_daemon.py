"""`nodeguard why` on a kubelet-shaped node, end to end, with a restart between the action and the question.

The real daemon on this host's cgroup v1 (pods laid out as kubelet lays them
out, tests/support/node.py), pod names and classes from the stand-in
API server (conftest.py), the history in the test's directory. Each lever this
hierarchy has: a pod's CPU quota (then a crash and a restart that puts it
back), the Burstable tier's weight (then a stop and a restart), and an
eviction through the API. The command runs as an operator runs it, after the
daemons are gone; /history is asked of the running one.
"""

from __future__ import annotations

import contextlib
import datetime
import json
import signal
import time
import urllib.parse
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from nodeguard.history.reading import Record, scan
from nodeguard.sources.readers import count_cpus
from tests.history.files import why, why_json
from tests.kubernetes.conftest import FakeKube, Pki
from tests.kubernetes.objects import NODE, pod
from tests.support import cgroups as rc
from tests.support.daemon import DaemonProcess
from tests.support.node import (
    GUARANTEED_LIMIT,
    POD_LIMIT,
    SLOW,
    ShapedNode,
    kubelet_node,
    protect_config,
    protected_node,
    waterline,
)
from tests.support.node import waterline_config as config
from tests.support.ports import free_port


def uid_of(found: rc.KubeletPod) -> str:
    return found.pod.rsplit("/pod", 1)[1]


def name_of(node: ShapedNode, found: rc.KubeletPod) -> str:
    return "prod/db" if found is node.important else f"batch/burner-{node.burners.index(found)}"


def by_group(node: ShapedNode) -> dict[str, rc.KubeletPod]:
    return {found.pod: found for found in [*node.burners, node.important]}


def api_pods(node: ShapedNode) -> list[dict[str, Any]]:
    """The node's pods as the API server lists them: the burners Burstable in namespace batch, the important pod
    Guaranteed in prod."""
    return [
        pod(name_of(node, found).split("/")[1], uid_of(found), namespace=name_of(node, found).split("/")[0],
            qos="Guaranteed" if found is node.important else "Burstable")
        for found in [*node.burners, node.important]
    ]  # fmt: skip


@contextlib.contextmanager
def on_the_api(node: ShapedNode, daemon_config: dict[str, Any], kube: FakeKube, pki: Pki, token: Path,
               **extra: Any) -> Iterator[dict[str, Any]]:  # fmt: skip
    """The config with the Kubernetes integration on the stand-in API server, which lists the node's pods, and HTTP
    on a free port."""
    kube.pods = api_pods(node)
    section = daemon_config["global"]
    section["kubernetes"] = {"enabled": True, "apiServerUrl": kube.url, "tokenPath": str(token),
                             "caPath": str(pki.ca_path), "timeoutSeconds": 2, "refreshSeconds": 1, **extra}  # fmt: skip
    section["http"] = {"listen": f"127.0.0.1:{free_port()}"}
    yield daemon_config


def entries(history: Path, kind: str) -> list[Record]:
    return [r for r in scan(str(history)).records if r.kind == kind]


def started(daemon: DaemonProcess) -> Callable[[], bool]:
    return lambda: any(e.get("event") == "nodeguard running" for e in daemon.events())


def stop(daemon: DaemonProcess) -> None:
    daemon.signal(signal.SIGTERM)
    assert daemon.wait(timeout=15 * SLOW) == 0


def restart(first: DaemonProcess) -> None:
    """A daemon with the first one's config started (its start puts back what the ledger holds) and stopped."""
    second = first.successor().start()
    try:
        second.wait_for(started(second), 20 * SLOW, "the restarted daemon running")
        stop(second)
    finally:
        second.kill()


def iso(at: float) -> str:
    return datetime.datetime.fromtimestamp(at).isoformat()


def get_json(config_: dict[str, Any], path: str) -> dict[str, Any]:
    """GET a JSON endpoint of the daemon running with this config."""
    with urllib.request.urlopen(f"http://{config_['global']['http']['listen']}{path}", timeout=10) as response:
        assert response.headers["Content-Type"] == "application/json"
        answer: dict[str, Any] = json.loads(response.read())
    return answer


def history_over_http(config_: dict[str, Any], **params: str) -> dict[str, Any]:
    return get_json(config_, f"/history?{urllib.parse.urlencode(params)}")


def only(answer: dict[str, Any], kind: str) -> dict[str, Any]:
    found = [e for e in answer["entries"] if e["kind"] == kind]
    assert len(found) >= 1, answer["entries"]
    return found[0]


def test_why_a_pod_was_throttled_after_a_crash_and_a_restart(kube: FakeKube, pki: Pki, token_file: Path,
                                                             tmp_path: Path) -> None:  # fmt: skip
    """A burner's quota lowered, the daemon SIGKILLed, a new one started (it puts the quota back): `why` by name,
    UID and cgroup path says when, to what, for which objective at which readings, its rank among the candidates
    and the rule that made it one; that the restart gave it back; and what held it at the moment asked. /history of
    the running daemon says the same."""
    history = tmp_path / "history"
    threshold = waterline(count_cpus(Path("/proc/stat").read_text()))  # measured before the burners start
    with kubelet_node(rc.v1_cpu_hierarchy(), POD_LIMIT, GUARANTEED_LIMIT) as node:
        node.start()
        time.sleep(1.0)  # as test_guard_kubelet_e2e: the burners' steady shares before the first tick
        with on_the_api(node, config(node, tmp_path / "run/ledger.json", threshold), kube, pki, token_file) as cfg:
            first = DaemonProcess(cfg, tmp_path, "--node-name", NODE).start()
            try:
                first.wait_for(lambda: bool(entries(history, "throttle")), 30 * SLOW, "a throttle in the history")
            finally:
                first.kill()  # a crash: what the writer wrote is on disk
            throttle = entries(history, "throttle")[0]
            held = by_group(node)[throttle.group or ""]
            assert node.held_below(held.pod), "still throttled: nobody put it back"
            node.stop_burners()
            second = first.successor().start()
            try:
                second.wait_for(started(second), 20 * SLOW, "the restarted daemon running")
                assert not node.held_below(held.pod) and not node.changed(), "the start put the quota back"
                second.wait_for(lambda: get_json(cfg, "/status")["history"]["written"] == 1, 10 * SLOW,
                                "the start's entry written")  # fmt: skip
                served = history_over_http(cfg, pod=name_of(node, held))
                status = get_json(cfg, "/status")["history"]
                assert status == {"path": str(history), "written": 1, "dropped": 0, "errors": 0}
                stop(second)
            finally:
                second.kill()

    asked = [why_json(ask, "--history", str(history)) for ask in (name_of(node, held), uid_of(held), held.pod)]
    answer = asked[0]
    assert asked[1]["entries"] == answer["entries"] == asked[2]["entries"] == served["entries"]
    assert answer["workloads"] == [{"id": held.pod, "name": name_of(node, held), "uid": uid_of(held)}]
    entry = only(answer, "throttle")
    assert entry["relation"] == "workload" and entry["lever"] == "cpu.max" and entry["holds_back"]
    assert entry["workload"]["name"] == name_of(node, held) and entry["workload"]["class"] == "Burstable"
    assert entry["before"] == "1.5 cores" and entry["after"].endswith(" cores") and entry["after"] != "1.5 cores"
    assert entry["metric"] == "cpu_total_usage" and entry["gap"] > 0
    assert entry["objective"]["name"] == "objectives[0]" and entry["objective"]["threshold"] == round(threshold, 3)
    assert entry["readings"]["cpu_total_usage"] > threshold, "the reading past the waterline that made it act"
    assert entry["gaps"]["throttle_down"]["cpu_total_usage"] > 0
    assert 1 <= entry["rank"]["position"] <= entry["rank"]["of"] <= len(node.burners), "the Guaranteed pod is none"
    assert entry["objective"]["sort_by"] == list(entry["rank"]["key"]), "the key in the objective's order"
    assert entry["candidate"]["class"] == "Burstable" and entry["rule"] == "guard.candidates: class Burstable"
    start = only(answer, "start")
    assert start["relation"] == "daemon" and held.pod in start["groups"] and start["how"] == "restore"
    assert answer["held"] == []
    during = why_json(name_of(node, held), "--history", str(history), "--at", iso(entry["at"] + 0.01))
    assert [(h["lever"], h["group"]) for h in during["held"]] == [("cpu.max", held.pod)]
    text = why(name_of(node, held), "--history", str(history))
    assert text.returncode == 0, text
    assert f"throttle  cpu.max on {name_of(node, held)}: 1.5 cores -> {entry['after']}" in text.stdout
    assert "daemon started (restore): put back every lever of" in text.stdout
    assert why_json("prod/db", "--history", str(history))["entries"] == [], "the Guaranteed pod was never touched"


def test_why_a_pod_was_held_by_its_tiers_weight_after_a_restart(kube: FakeKube, pki: Pki, token_file: Path,
                                                                tmp_path: Path) -> None:  # fmt: skip
    """protected_cpu_stall lowers the Burstable tier's weight for the Guaranteed pod; the daemon is stopped (the
    weight put back) and started again: `why` for a burner shows the hold on its tier, with the candidates it listed
    and the pods under it, and that the stop gave it back."""
    history = tmp_path / "history"
    with protected_node(rc.v1_cpu_hierarchy()) as node:
        tier = f"{node.parent}/kubepods/burstable"
        node.start()
        cfg_ = protect_config(node, tmp_path / "run/ledger.json", weightHoldSeconds=600)
        with on_the_api(node, cfg_, kube, pki, token_file) as cfg:
            first = DaemonProcess(cfg, tmp_path, "--node-name", NODE).start()
            try:
                first.wait_for(lambda: node.hierarchy.weight(tier) != node.weights[tier], 30 * SLOW,
                               "the tier's weight lowered")  # fmt: skip
                first.wait_for(lambda: bool(entries(history, "reweigh")), 10, "the reweigh in the history")
                stop(first)
            finally:
                first.kill()
            assert node.hierarchy.weight(tier) == node.weights[tier], "the stop put the weight back"
            node.stop_burners()
            restart(first)

    burner = node.burners[0]
    answer = why_json(name_of(node, burner), "--history", str(history))
    entry = only(answer, "reweigh")
    assert entry["relation"] == "group" and entry["through"] == tier and entry["lever"] == "cpu.weight"
    assert entry["holds_back"] and entry["after"] == "2" and entry["workload"] is None
    assert entry["objective"]["metric"] == "protected_cpu_stall" and entry["readings"]["protected_cpu_stall"] > 5
    listed = set(entry["workloads"])
    assert listed and listed <= {b.pod for b in node.burners}
    assert entry["listed"] == (burner.pod in listed)
    assert {w["name"] for w in entry["under"]} == {name_of(node, b) for b in node.burners}
    stopped = only(answer, "stop")
    assert stopped["relation"] == "daemon" and tier in stopped["groups"] and answer["held"] == []
    during = why_json(uid_of(burner), "--history", str(history), "--at", iso(entry["at"] + 0.01))
    assert [(h["lever"], h["group"], h["relation"]) for h in during["held"]] == [("cpu.weight", tier, "group")]
    text = why(name_of(node, burner), "--history", str(history)).stdout
    assert f"cpu.weight on {tier}, a group above the pod (every pod under it is held)" in text
    assert "daemon stopped (restore): put back every lever of" in text


def test_why_a_pod_was_evicted_after_a_restart(kube: FakeKube, pki: Pki, token_file: Path, tmp_path: Path) -> None:
    """An evict objective past its waterline asks the API to evict the least important burner; after a stop and a
    restart, `why` for that pod says the eviction was asked, when and why."""
    history = tmp_path / "history"
    threshold = waterline(count_cpus(Path("/proc/stat").read_text()))
    with kubelet_node(rc.v1_cpu_hierarchy(), POD_LIMIT, GUARANTEED_LIMIT) as node:
        node.start()
        time.sleep(1.0)
        evict = {"metric": "cpu_total_usage", "action": "evict", "threshold": round(threshold, 3), "triggerAfter": 2}
        cfg_ = node.config(tmp_path / "run/ledger.json", [evict])
        with on_the_api(node, cfg_, kube, pki, token_file) as cfg:
            first = DaemonProcess(cfg, tmp_path, "--node-name", NODE).start()
            try:
                first.wait_for(lambda: bool(kube.requests("POST")) and any(p.path.endswith("/eviction")
                               for p in kube.requests("POST")), 30 * SLOW, "an eviction asked of the API")  # fmt: skip
                first.wait_for(lambda: bool(entries(history, "evict")), 10, "the eviction in the history")
                stop(first)
            finally:
                first.kill()
            node.stop_burners()
            restart(first)

    evicted = entries(history, "evict")[0]
    found = by_group(node)[evicted.group or ""]
    (posted,) = [p.path for p in kube.requests("POST") if p.path.endswith("/eviction")]
    namespace, name = name_of(node, found).split("/")
    assert posted == f"/api/v1/namespaces/{namespace}/pods/{name}/eviction"
    answer = why_json(name_of(node, found), "--history", str(history))
    entry = only(answer, "evict")
    assert entry["relation"] == "workload" and entry["objective"]["action"] == "evict"
    assert entry["readings"]["cpu_total_usage"] > threshold and entry["gaps"]["evict"]["cpu_total_usage"] > 0
    assert entry["rank"]["position"] == 1 and entry["candidate"]["class"] == "Burstable"
    assert [e["group"] for e in answer["evictions"]] == [found.pod]
    text = why(name_of(node, found), "--history", str(history)).stdout
    assert f"evict  {name_of(node, found)}: eviction asked" in text
