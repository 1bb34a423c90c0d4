"""What nodeguard did to a workload, when and why: the history's answer, as plain JSON values.

A pod is asked for by ``namespace/name``, by UID or by its cgroup path
(nodeguard's workload id). The answer has every entry about it in the time
asked, each with how it concerns the pod: a change of the pod itself
(``workload``), or of a group above it (``group``: a weight lowered on its
QoS tier holds every pod under it, whether or not the change listed the pod
among its candidates), or the daemon's restart putting its values back
(``daemon``); and what held it back at the moment asked (by default now):
the last change of each lever on the pod and on each group above it, unless
given back since.
"""

from __future__ import annotations

import datetime
import json
import re
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from nodeguard.history.reading import Named, Record, Scan, scan

UUID = re.compile(r"[0-9a-fA-F]{8}([-_]?[0-9a-fA-F]{4}){3}[-_]?[0-9a-fA-F]{12}")
RELATIVE = re.compile(r"-?\s*(\d+(?:\.\d*)?)\s*(s|m|h|d)")
SECONDS = {"s": 1, "m": 60, "h": 3600, "d": 86_400}
LIMIT = 1000  # entries in one answer at most, the newest
LIFECYCLE = ("start", "stop")


class BadQuestion(ValueError):
    """A time or a parameter that cannot be read; the message says what is expected."""


def parse_time(text: str, now: float) -> float:
    """Seconds since the epoch for ISO 8601 (a time without a zone is local) or for a time relative to now: ``-15m``,
    ``-2h``, ``-1d``, ``-30s`` (the sign may be left out), or ``now``."""
    raw = text.strip()
    if raw == "now":
        return now
    relative = RELATIVE.fullmatch(raw)
    if relative is not None:
        return now - float(relative.group(1)) * SECONDS[relative.group(2)]
    try:
        moment = datetime.datetime.fromisoformat(raw)
    except ValueError:
        raise BadQuestion(
            f"{text!r} is not a time: expected ISO 8601 like 2024-05-01T14:02:00 (local time unless it has a zone) "
            "or a time before now like -15m, -2h, -1d, -30s"
        ) from None
    return moment.timestamp()


def shown_time(at: float) -> str:
    """Local time with its offset, to the second."""
    return datetime.datetime.fromtimestamp(at).astimezone().isoformat(timespec="seconds")


@dataclass(frozen=True, slots=True)
class Question:
    pod: str | None  # None: every entry
    since: float | None = None
    at: float | None = None  # None: now

    @classmethod
    def of(cls, pod: str | None, since: str | None, at: str | None, now: float | None = None) -> Question:
        now = time.time() if now is None else now
        pod = None if pod is None or not pod.strip() else pod.strip()
        return cls(pod, None if since is None else parse_time(since, now), None if at is None else parse_time(at, now))


def named_in(records: Iterable[Record]) -> Iterable[Named]:
    for record in records:
        if record.workload is not None:
            yield record.workload
        yield from record.listed
        yield from record.under


def _uid_form(text: str) -> str:
    return text.lower().replace("-", "_")


def resolve(pod: str, records: Iterable[Record], live: Iterable[Named] = ()) -> list[Named]:
    """The workloads ``pod`` names: by name (``namespace/name``), UID or cgroup path, among those the history
    names and ``live`` ones (the daemon's last snapshot). A pod recreated under the same name is each of them. A
    path no entry names is taken as a cgroup path all the same (its parents' holds are still found)."""
    path = pod.strip("/")
    uid = _uid_form(pod) if UUID.fullmatch(pod) else None
    found: dict[str, Named] = {}
    for named in [*live, *named_in(records)]:
        if named.id == path or named.name == pod:
            hit = True
        elif uid is not None:
            hit = (named.uid is not None and _uid_form(named.uid) == uid) or uid in _uid_form(named.id)
        else:
            hit = False
        if hit and (named.id not in found or found[named.id].uid is None):
            found[named.id] = named
    if not found and uid is None:
        found[path] = Named(path, "")  # named nowhere: a cgroup path
    return sorted(found.values(), key=lambda n: n.id)


def _above(group: str, ids: Iterable[str]) -> bool:
    prefix = group + "/"
    return any(wid.startswith(prefix) for wid in ids)


def relation(record: Record, ids: frozenset[str]) -> dict[str, Any] | None:
    """How an entry concerns the workloads ``ids``; None: it does not."""
    if record.kind in LIFECYCLE:
        back = [g for g in record.restored if g in ids or _above(g, ids)]
        kept = [g for g in record.kept if g in ids or _above(g, ids)]
        return {"relation": "daemon", "groups": back, "kept_groups": kept} if back or kept else None
    group = record.group or ""
    if group in ids or (record.workload is not None and record.workload.id in ids):
        return {"relation": "workload"}
    if _above(group, ids):
        return {
            "relation": "group",
            "through": group,
            "listed": any(n.id in ids for n in record.listed),  # among the candidates the change named
        }
    if any(n.id in ids for n in record.listed):
        return {"relation": "group", "through": group, "listed": True}
    return None


def held_at(records: Iterable[Record], at: float) -> tuple[list[Record], list[Record]]:
    """(the last change of each lever on each group that still held it back at ``at``, the evictions asked until
    then), from ``records`` in the order written."""
    held: dict[tuple[str, str], Record] = {}
    evictions: list[Record] = []
    for record in records:
        if record.at > at:
            continue
        if record.kind in LIFECYCLE:
            back = set(record.restored)
            held = {key: r for key, r in held.items() if key[1] not in back}
        elif record.kind == "evict":
            evictions.append(record)
        elif record.lever is not None and record.group is not None:
            key = (record.lever, record.group)
            if record.release:
                held.pop(key, None)
            else:
                held[key] = record
    return list(held.values()), evictions


def _shown(record: Record, about: Mapping[str, Any] | None) -> dict[str, Any]:
    return {"time": shown_time(record.at), **record.data, **(about or {})}


def answer(scan: Scan, question: Question, live: Iterable[Named] = (), now: float | None = None) -> dict[str, Any]:
    """The answer to ``question`` from a scan of the history, as JSON values (``nodeguard why --json``, /history)."""
    now = time.time() if now is None else now
    at = now if question.at is None else question.at
    records = scan.records
    workloads: list[Named] = []
    concerning: list[tuple[Record, dict[str, Any] | None]]
    if question.pod is not None:
        workloads = resolve(question.pod, records, live)
        ids = frozenset(n.id for n in workloads)
        about = [(r, relation(r, ids)) for r in records]
        concerning = [(r, rel) for r, rel in about if rel is not None]
    else:
        concerning = [(r, None) for r in records]
    held, evictions = held_at((r for r, _ in concerning), at)
    relations = {id(r): rel for r, rel in concerning}
    oldest = scan.oldest
    window = [(r, rel) for r, rel in concerning if (question.since is None or r.at >= question.since) and r.at <= at]
    return {
        "pod": question.pod,
        "workloads": [{"id": n.id, "name": n.name, "uid": n.uid} for n in workloads],
        "at": at,
        "at_time": shown_time(at),
        "since": question.since,
        "since_time": None if question.since is None else shown_time(question.since),
        "history": {
            "files": scan.files,
            "bytes": scan.bytes,
            "entries": scan.entries,
            "malformed": scan.malformed,
            "oldest": oldest,
            "oldest_time": None if oldest is None else shown_time(oldest),
        },
        "held": [_shown(r, relations.get(id(r))) for r in held],
        "evictions": [_shown(r, relations.get(id(r))) for r in evictions],
        "entries": [_shown(r, rel) for r, rel in window[-LIMIT:]],
        "truncated": max(0, len(window) - LIMIT),
    }


def respond(
    directory: str, params: Mapping[str, list[str]], live: Iterable[Named] = (), now: float | None = None
) -> tuple[int, dict[str, Any] | str]:
    """/history?pod=POD&since=TIME&at=TIME (every entry without a pod): (200, the answer), or (400, what is wrong)."""

    def one(name: str) -> str | None:
        values = params.get(name)
        return None if not values else values[-1]

    try:
        question = Question.of(one("pod"), one("since"), one("at"), now)
    except BadQuestion as exc:
        return 400, str(exc)
    return 200, answer(read(directory, question), question, live, now)


def read(directory: str, question: Question) -> Scan:
    """The history's entries that may concern the question: about a pod, only the lines that name it (by name, UID
    or path) and every group's change and daemon start or stop (a group above it may hold it); the rest are not
    parsed."""
    return scan(directory, None if question.pod is None else mentions(question.pod))


GROUP_CHANGE = b'"workload":null'
LIFECYCLE_KINDS = tuple(b'"kind":"%s"' % kind.encode() for kind in LIFECYCLE)


def _json_text(text: str) -> bytes:
    """How a string appears inside a line: JSON-escaped, without its quotes."""
    return json.dumps(text)[1:-1].encode()


def mentions(pod: str) -> Callable[[bytes], bool]:
    """A cheap test on a line's bytes: whether it may concern ``pod`` (it names it, or changes a group, or is a
    daemon's start or stop)."""
    forms = {pod, pod.strip("/")}
    if UUID.fullmatch(pod):
        forms |= {pod.lower(), pod.lower().replace("-", "_")}
    tokens = [_json_text(form) for form in forms if form]

    def keep(line: bytes) -> bool:
        return GROUP_CHANGE in line or any(t in line for t in tokens) or any(k in line for k in LIFECYCLE_KINDS)

    return keep
