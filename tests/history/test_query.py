"""The history's answer: times as people give them, a pod by name, UID or path, and what held it at a moment."""

from __future__ import annotations

import datetime
import json
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import CollectorRegistry

from nodeguard.history.jsonl import VERSION
from nodeguard.history.query import BadQuestion, Question, answer, parse_time, respond
from nodeguard.history.reading import Named, Scan, record_of
from nodeguard.history.recorder import encode
from nodeguard.history.segments import Segments
from nodeguard.surfaces.http import HttpServer
from tests.history.files import why

NOW = 1_800_000_000.0
UID = "0a1b2c3d-4e5f-4000-8000-000000000001"
POD = f"kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod{UID.replace('-', '_')}.slice"
TIER = "kubepods.slice/kubepods-burstable.slice"


def entry(at: float, kind: str, group: str | None, **extra: Any) -> dict[str, Any]:
    lever = {"throttle": "cpu.max", "restore": "cpu.max", "reweigh": "cpu.weight"}.get(kind)
    return {"v": VERSION, "at": at, "kind": kind, "lever": lever, "group": group, **extra}


def scan_of(*entries: dict[str, Any]) -> Scan:
    records = [record_of(e) for e in entries]
    assert all(r is not None for r in records)
    return Scan(records=[r for r in records if r is not None], files=1)


POD_DATA = {"id": POD, "name": "batch/etl-7", "kind": "pod", "uid": UID, "class": "Burstable", "priority": 0}
HISTORY = scan_of(
    entry(NOW - 600, "throttle", POD, workload=POD_DATA, holds_back=True, before="2 cores", after="0.5 cores"),
    entry(NOW - 500, "reweigh", TIER, holds_back=True, workloads=[], under=[{"id": POD, "name": "batch/etl-7"}]),
    entry(NOW - 400, "restore", POD, workload=POD_DATA, before="0.5 cores", after="1 cores"),
    entry(NOW - 300, "stop", None, how="keep", restored=[], kept=[POD, TIER]),
    entry(NOW - 290, "start", None, how="adopt", restored=[], kept=[POD, TIER]),
    entry(NOW - 200, "restore", POD, workload=POD_DATA, release=True, before="1 cores", after="2 cores"),
    entry(NOW - 100, "stop", None, how="restore", restored=[TIER]),
    entry(NOW - 50, "throttle", "kubepods.slice/other", holds_back=True),
)


def held(at: float, pod: str | None = "batch/etl-7") -> list[tuple[str, str]]:
    found = answer(HISTORY, Question(pod, at=at), now=NOW)["held"]
    return [(h["lever"], h["group"]) for h in found]


@pytest.mark.parametrize(
    ("text", "seconds"),
    [("-15m", NOW - 900), ("15m", NOW - 900), ("-2h", NOW - 7200), ("-1.5d", NOW - 129_600), ("-30s", NOW - 30),
     ("now", NOW), ("2027-01-15T08:00:00+00:00", NOW), ("2027-01-15T08:00:00Z", NOW),
     ("2027-01-15T09:30:00+01:30", NOW), ("2027-01-15T08:00:00.25Z", NOW + 0.25)],
)  # fmt: skip
def test_times_relative_or_iso(text: str, seconds: float) -> None:
    """Relative times count back from now; ISO 8601 with a zone is that moment."""
    assert parse_time(text, NOW) == seconds


def test_a_time_without_a_zone_is_local() -> None:
    moment = datetime.datetime(2027, 1, 15, 8, 0, 0)
    assert parse_time("2027-01-15T08:00:00", NOW) == moment.timestamp()


@pytest.mark.parametrize("text", ["yesterday", "-15x", "", "15 minutes ago", "2027-13-01"])
def test_a_bad_time_says_what_is_expected(text: str) -> None:
    with pytest.raises(BadQuestion, match=r"ISO 8601 .* -15m"):
        parse_time(text, NOW)


@pytest.mark.parametrize("ask", ["batch/etl-7", UID, UID.upper(), POD, "/" + POD])
def test_a_pod_by_name_uid_or_cgroup_path(ask: str) -> None:
    """namespace/name, the UID (any case; the systemd driver writes it with underscores) and the cgroup path all
    find the pod, its own changes and its tier's."""
    found = answer(HISTORY, Question(ask), now=NOW)
    assert found["workloads"] == [{"id": POD, "name": "batch/etl-7", "uid": UID}]
    kinds = [(e["kind"], e["relation"]) for e in found["entries"]]
    assert kinds == [("throttle", "workload"), ("reweigh", "group"), ("restore", "workload"), ("stop", "daemon"),
                     ("start", "daemon"), ("restore", "workload"), ("stop", "daemon")]  # fmt: skip


def test_what_held_the_pod_at_each_moment() -> None:
    """A throttle holds until released; a raise keeps the hold at the new value; a stop that keeps the values and an
    adopting start keep them; a stop that restores gives back what it lists."""
    assert held(NOW - 700) == []
    assert held(NOW - 550) == [("cpu.max", POD)]
    assert held(NOW - 450) == [("cpu.max", POD), ("cpu.weight", TIER)]
    assert held(NOW - 295) == [("cpu.max", POD), ("cpu.weight", TIER)], "kept across the restart"
    assert held(NOW - 150) == [("cpu.weight", TIER)], "the quota released"
    assert held(NOW) == [], "the tier given back at the stop"
    assert held(NOW, None) == [("cpu.max", "kubepods.slice/other")], "without a pod: everything held"


def test_since_and_at_bound_the_entries() -> None:
    found = answer(HISTORY, Question("batch/etl-7", since=NOW - 450, at=NOW - 150), now=NOW)
    assert [e["kind"] for e in found["entries"]] == ["restore", "stop", "start", "restore"]
    assert found["entries"][1]["kept_groups"] == [POD, TIER] and found["entries"][1]["groups"] == []


def test_an_unknown_name_is_said_and_an_unknown_path_still_finds_its_parents() -> None:
    """A name no entry has resolves to nothing of its own; a cgroup path no entry names still shows its tier's
    hold."""
    nobody = answer(HISTORY, Question("default/nobody"), now=NOW)
    assert nobody["entries"] == [] and nobody["workloads"] == [{"id": "default/nobody", "name": "", "uid": None}]
    other = answer(HISTORY, Question(f"{TIER}/podnew.slice"), now=NOW)
    assert [(e["kind"], e["relation"]) for e in other["entries"]] == [("reweigh", "group"), ("stop", "daemon"),
                                                                       ("start", "daemon"), ("stop", "daemon")]  # fmt: skip


def test_live_workloads_resolve_names_the_history_does_not_have() -> None:
    """/history also knows the pods running now: a pod under the tier that no entry names is found by name."""
    live = [Named(f"{TIER}/podnew.slice", "batch/new", None)]
    found = answer(HISTORY, Question("batch/new"), live, now=NOW)
    assert [(e["kind"], e["through"]) for e in found["entries"] if e["relation"] == "group"] == [("reweigh", TIER)]


def test_history_endpoint_answers_and_refuses_a_bad_time(tmp_path: Path) -> None:
    """/history?pod=...&since=...: the answer as JSON; a bad time is a 400 saying what is expected; without a history
    the endpoint says it is off."""
    segments = Segments(str(tmp_path), 1 << 20, 256 << 10)
    segments.append(encode(r.data) for r in HISTORY.records)
    segments.close()
    server = HttpServer(CollectorRegistry(), dict, dict, history=lambda params: respond(str(tmp_path), params, now=NOW))
    response = server.route("GET", "/history?pod=batch%2Fetl-7&since=-450s")
    assert response.status == 200 and response.content_type == "application/json"
    assert [e["kind"] for e in json.loads(response.body)["entries"]] == ["restore", "stop", "start", "restore", "stop"]
    everything = json.loads(server.route("GET", "/history").body)
    assert len(everything["entries"]) == len(HISTORY.records) and everything["pod"] is None
    bad = server.route("GET", "/history?pod=x&since=yesterday")
    assert bad.status == 400 and b"is not a time" in bad.body
    off = HttpServer(CollectorRegistry(), dict, dict).route("GET", "/history")
    assert off.status == 404 and b"history.enabled" in off.body


def test_why_refuses_a_bad_time_with_exit_1(tmp_path: Path) -> None:
    done = why("batch/etl-7", "--since", "yesterday", "--history", str(tmp_path))
    assert done.returncode == 1 and "is not a time" in done.stderr and "Traceback" not in done.stderr
