"""`nodeguard why` after a restart, for every lever and an eviction, from real plans and the real executor's changes.

Where this host has no such cgroup (memory.high is cgroup v2 only; its cgroup
v2 mount has neither memory nor cpu), the groups are plain files shaped like
cgroup v2 (tests/history/files.py): the plan, the executor, the levers, the
ledger, the recorder and the command are the daemon's own. The real-kernel
runs of the quota, the tier's weight and an eviction are in
tests/kubernetes/test_why_daemon.py.
"""

from __future__ import annotations

import datetime
import shutil
import time
from dataclasses import replace
from pathlib import Path
from typing import Any

from nodeguard.model.snapshot import Snapshot, WorkloadUsage
from nodeguard.model.workloads import QosClass
from nodeguard.policy.planner import plan
from nodeguard.policy.state import GuardState
from tests.history.files import FileNode, why, why_json
from tests.policy.builders import (
    GiB,
    at,
    cpu_throttle,
    guard,
    kubelet_node,
    mem,
    mem_throttle,
    settings,
    snapshot,
    stall_objective,
    usage,
)

WEIGHT = guard(stall_objective(), minQuotaCores=0.05, weightHoldSeconds=60)

UID = "1f3e4a5b-0000-4000-8000-00000000000a"


def named(found: WorkloadUsage, name: str, uid: str | None = None) -> WorkloadUsage:
    """The workload with its pod's name (namespace/name) and UID, as the Kubernetes metadata gives them."""
    return found._replace(workload=replace(found.workload, name=name, pod_uid=uid))


def now(found: Snapshot) -> Snapshot:
    """The snapshot as taken a minute ago: the restart after it comes later than any moment asked about."""
    return replace(found, wall_time=time.time() - 60)


def iso(at: float) -> str:
    """A moment as an operator gives it: local ISO 8601."""
    return datetime.datetime.fromtimestamp(at).isoformat()


def only(answer: dict[str, Any], kind: str) -> dict[str, Any]:
    (entry,) = [e for e in answer["entries"] if e["kind"] == kind]
    return entry


def test_memory_high_why_after_a_restart(tmp_path: Path) -> None:
    """A Burstable pod's memory.high lowered for memory_total_utilization, then the daemon restarted (memory.high
    put back): asked by name, UID or cgroup path, `why` shows the change with its readings, gap, objective, rank
    and candidate rule, what held the pod at that moment, and that the restart gave it back."""
    node = FileNode(tmp_path)
    big = named(mem("kubepods/burstable/pod" + UID, 4 * GiB, qos=QosClass.BURSTABLE), "batch/big", UID)
    workloads = [big, mem("kubepods/burstable/podsmall", GiB, qos=QosClass.BURSTABLE),
                 mem("kubepods/podgold", 6 * GiB, qos=QosClass.GUARANTEED)]  # fmt: skip
    node.add(workloads)
    settled = node.tick(now(at(14 * GiB, *workloads)), settings(mem_throttle()))
    held = node.read(big.workload.id, "memory.high")
    assert [d.change.kind for d in settled.done] == ["memory_throttle"] and held != "max"
    node.restart()
    assert node.read(big.workload.id, "memory.high") == "max"
    node.close()

    history = node.history.path
    answers = [why_json(ask, "--history", history) for ask in ("batch/big", UID, big.workload.id)]
    assert answers[1]["entries"] == answers[0]["entries"] == answers[2]["entries"]
    answer = answers[0]
    assert answer["workloads"] == [{"id": big.workload.id, "name": "batch/big", "uid": UID}]
    entry = only(answer, "memory_throttle")
    assert entry["relation"] == "workload" and entry["lever"] == "memory.high" and entry["holds_back"]
    assert entry["before"] == "max" and entry["values"] == ["max", held]
    assert entry["metric"] == "memory_total_utilization" and entry["gap"] > 0
    assert entry["readings"]["memory_total_utilization"] == 87.5
    assert entry["objective"]["threshold"] == 80.0 and entry["objective"]["name"] == "objectives[0]"
    assert entry["rank"]["position"] == 1 and entry["rank"]["of"] == 2 and "memory_usage" in entry["rank"]["key"]
    assert entry["candidate"] == {"class": "Burstable", "priority": 0, "classes": ["BestEffort", "Burstable"],
                                  "below_priority": None}  # fmt: skip
    assert entry["rule"] == "guard.candidates: class Burstable", "the rule that made it a candidate"
    stop = only(answer, "stop")
    assert stop["relation"] == "daemon" and stop["groups"] == [big.workload.id]
    assert answer["held"] == [], "given back at the stop"
    then = why_json("batch/big", "--history", history, "--at", iso(entry["at"] + 1))
    assert [(h["lever"], h["group"]) for h in then["held"]] == [("memory.high", big.workload.id)]

    text = why("batch/big", "--history", history)
    assert text.returncode == 0, text
    assert f"memory_throttle  memory.high on batch/big: max -> {entry['after']}" in text.stdout
    assert "objective objectives[0]: throttle past memory_total_utilization 80%, restore below 70%" in text.stdout
    assert (
        "candidate: Burstable, priority 0 (guard.candidates: classes BestEffort, Burstable); rule: guard.candidates: class Burstable"
        in text.stdout
    )
    assert "Nothing nodeguard holds back" in text.stdout


def test_a_tier_weight_holds_every_pod_under_it_listed_or_not(tmp_path: Path) -> None:
    """protected_cpu_stall lowers the Burstable tier's weight: `why` shows it for a pod it listed as a candidate and
    for one under the tier it did not list (too idle to be a candidate), as a hold on a group above each; after a
    restart the stop gave the tier back."""
    node = FileNode(tmp_path)
    quiet = usage("kp/burstable/podquiet", qos=QosClass.BURSTABLE, cores=0.001, waiting=0.0)
    workloads = [*kubelet_node(0.2), quiet]
    node.add(workloads)
    settled = node.tick(now(snapshot(workloads, cpus=2, cores_used=2.0)), WEIGHT)
    tier = next(d for d in settled.done if d.change.group == "kp/burstable")
    assert tier.change.kind == "reweigh" and tier.holds_back and "kp/burstable/podquiet" not in tier.change.workloads
    assert node.read("kp/burstable", "cpu.weight") == "1" or node.read("kp/burstable", "cpu.idle") == "1"
    node.restart()
    node.close()

    listed = why_json("kp/burstable/pod0", "--history", node.history.path)
    entry = only(listed, "reweigh")
    assert entry["relation"] == "group" and entry["through"] == "kp/burstable" and entry["listed"] is True
    assert entry["lever"] == "cpu.weight" and entry["workload"] is None
    assert entry["workloads"] == list(tier.change.workloads)
    assert {w["id"] for w in entry["under"]} == {"kp/burstable/pod0", "kp/burstable/pod1", "kp/burstable/podquiet"}
    assert entry["objective"]["metric"] == "protected_cpu_stall" and entry["protect_phase"]
    unlisted = why_json("kp/burstable/podquiet", "--history", node.history.path)
    assert only(unlisted, "reweigh")["listed"] is False, "held through its tier all the same"
    then = why_json("kp/burstable/podquiet", "--history", node.history.path, "--at", iso(entry["at"] + 1))
    assert [(h["lever"], h["group"], h["relation"]) for h in then["held"]] == [("cpu.weight", "kp/burstable", "group")]
    assert unlisted["held"] == [] and only(unlisted, "stop")["groups"] == ["kp/burstable"]
    assert why_json("kp/podg", "--history", node.history.path)["entries"] == [], "the protected pod: nothing"

    text = why("kp/burstable/podquiet", "--history", node.history.path).stdout
    assert "cpu.weight on kp/burstable, a group above the pod (every pod under it is held)" in text
    assert "candidates it listed: " in text


def test_a_weight_on_the_pod_itself(tmp_path: Path) -> None:
    """On a plain host, where the groups are siblings, the weight lowered is the competing group's own: `why` shows
    it as a change of the workload itself, until the restart gave it back."""
    node = FileNode(tmp_path)
    batch = usage("demo/batch-0", cores=0.6, waiting=0.7, priority=-1)
    important = usage("demo/important", qos=QosClass.GUARANTEED, cores=0.4, waiting=0.2, starved=0.0)
    node.add([batch, important])
    settled = node.tick(now(snapshot([batch, important], cpus=2, cores_used=2.0)), WEIGHT)
    assert [(d.change.kind, d.change.group) for d in settled.done] == [("reweigh", "demo/batch-0")]
    node.restart()
    node.close()
    answer = why_json("demo/batch-0", "--history", node.history.path)
    entry = only(answer, "reweigh")
    assert entry["relation"] == "workload" and entry["lever"] == "cpu.weight" and entry["before"] != entry["after"]
    assert only(answer, "stop")["groups"] == ["demo/batch-0"] and answer["held"] == []


def test_an_eviction_why_after_a_restart(tmp_path: Path) -> None:
    """An evict objective on memory asks the evictor for the largest BestEffort pod: after a restart, `why` shows the
    eviction asked, with its reason, readings, objective and rank, also under --at."""
    node = FileNode(tmp_path)
    hog = named(mem("kubepods/besteffort/pod" + UID, 5 * GiB), "batch/hog", UID)
    workloads = [hog, mem("kubepods/besteffort/podother", GiB), mem("kubepods/podgold", 6 * GiB,
                                                                     qos=QosClass.GUARANTEED)]  # fmt: skip
    node.add(workloads)
    evict = guard({"metric": "memory_total_utilization", "threshold": "85%", "action": "evict", "triggerAfter": 1})
    settled = node.tick(now(at(15 * GiB, *workloads)), evict)
    assert node.evictions.asked == [hog.workload.id] and not settled.done
    node.restart()
    node.close()
    answer = why_json("batch/hog", "--history", node.history.path)
    entry = only(answer, "evict")
    assert entry["relation"] == "workload" and entry["lever"] is None and entry["memory_bytes"] == 5 * GiB
    assert entry["objective"]["action"] == "evict" and entry["gaps"]["evict"]["memory_total_utilization"] > 0
    assert entry["rank"]["position"] == 1 and entry["candidate"]["class"] == "BestEffort"
    assert [e["kind"] for e in answer["evictions"]] == ["evict"]
    text = why("batch/hog", "--history", node.history.path).stdout
    assert "evict  batch/hog: eviction asked" in text and "eviction asked at" in text


def test_a_dry_run_objective_records_nothing(tmp_path: Path) -> None:
    """A dry-run objective changes nothing: no entry (the history says what nodeguard did)."""
    node = FileNode(tmp_path)
    workloads = [mem("kubepods/burstable/podbig", 4 * GiB, qos=QosClass.BURSTABLE)]
    node.add(workloads)
    planned = plan(at(14 * GiB, *workloads), GuardState(), settings(mem_throttle(dryRun=True)))
    assert planned.changes and all(c.dry_run for c in planned.changes)
    node.tick(now(at(14 * GiB, *workloads)), settings(mem_throttle(dryRun=True)))
    node.close()
    assert [e["kind"] for e in why_json("kubepods/burstable/podbig", "--history", node.history.path)["entries"]] == []


BATCH = usage("kp/besteffort/podbatch", cores=2.0)
OTHER = usage("kp/besteffort/podother", cores=0.05)
QUOTA = guard(cpu_throttle(6.0, 5.0))


def throttled(tmp_path: Path) -> tuple[FileNode, str]:
    """A node whose CPU is a core past its waterline, after the tick that throttled the batch pod: the node and the
    quota it holds."""
    node = FileNode(tmp_path)
    node.add([BATCH, OTHER])
    settled = node.tick(now(snapshot([BATCH, OTHER], cpus=8, cores_used=7.0, monotonic=100.0)), QUOTA)
    assert [(d.change.kind, d.change.group) for d in settled.done] == [("throttle", BATCH.workload.id)]
    held = node.read(BATCH.workload.id, "cpu.max")
    assert held != "max 100000"
    return node, held


def test_a_reset_hold_put_back_and_a_gone_workloads_hold_given_back_are_in_the_history(tmp_path: Path) -> None:
    """A quota kubelet reset behind the hold is put back the next tick, and the hold of a workload that is no longer
    seen is given back: `why` shows both after the throttle, and nothing held at the end."""
    node, held = throttled(tmp_path)

    (node.root / BATCH.workload.id / "cpu.max").write_text("max 100000\n")  # kubelet puts its limit back
    settled = node.tick(now(snapshot([BATCH, OTHER], cpus=8, cores_used=5.9, monotonic=101.0)), QUOTA)
    assert settled.done == [] and [(d.change.kind, d.before, d.after) for d in settled.upkeep] == [
        ("reassert", "max 100000", held)
    ]
    assert node.read(BATCH.workload.id, "cpu.max") == held

    settled = node.tick(now(snapshot([OTHER], cpus=8, cores_used=5.9, monotonic=102.0)), QUOTA)
    assert [(d.change.kind, d.before, d.after) for d in settled.upkeep] == [("give_back", held, "max 100000")]
    assert node.read(BATCH.workload.id, "cpu.max") == "max 100000"
    node.close()

    answer = why_json(BATCH.workload.id, "--history", node.history.path)
    assert [e["kind"] for e in answer["entries"] if e["kind"] != "start"] == ["throttle", "reassert", "give_back"]
    reasserted, given = only(answer, "reassert"), only(answer, "give_back")
    assert reasserted["values"] == ["max 100000", held] and reasserted["holds_back"] and not reasserted["release"]
    assert (
        reasserted["workload"]["id"] == BATCH.workload.id
        and reasserted["reason"] == "put back after someone changed it"
    )
    assert given["values"] == [held, "max 100000"] and given["release"] and not given["holds_back"]
    assert given["metric"] == "cpu_total_usage" and given["reason"] == "its workload is no longer seen: put back"
    assert answer["held"] == [], "given back: nothing held"
    text = why(BATCH.workload.id, "--history", node.history.path).stdout
    assert (
        f"give_back  cpu.max on {BATCH.workload.id}" in text and "why: its workload is no longer seen: put back" in text
    )


def test_the_hold_of_a_pod_whose_cgroup_is_gone_ends_in_the_history(tmp_path: Path) -> None:
    """A throttled pod deleted (its cgroup removed with it): the next tick records the hold's end, and `why` no longer
    shows the pod held."""
    node, held = throttled(tmp_path)
    shutil.rmtree(node.root / BATCH.workload.id)  # kubelet removed the pod's cgroup
    settled = node.tick(now(snapshot([OTHER], cpus=8, cores_used=5.9, monotonic=101.0)), QUOTA)
    assert [(d.change.kind, d.before, d.after, d.change.release) for d in settled.upkeep] == [
        ("give_back", held, "", True)
    ]
    node.close()
    answer = why_json(BATCH.workload.id, "--history", node.history.path)
    given = only(answer, "give_back")
    assert given["reason"] == "its cgroup is gone" and given["after"] == "its cgroup is gone"
    assert answer["held"] == [], "the hold ended with the pod"
