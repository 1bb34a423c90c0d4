"""``nodeguard why POD``: what nodeguard did to a pod, when and why, from the decision history, for people."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from nodeguard.history.query import shown_time
from nodeguard.policy.metrics import CAPABILITIES, Metric
from nodeguard.quantity import Unit

SHOWN = 50  # entries printed at most, the newest (--json has them all)
RELATIONS = {"workload": "on it", "group": "above it", "daemon": "at the daemon's"}


def _number(value: object) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)


def _in_unit(metric: object, value: object) -> str:
    """A metric's value in its unit, as people read it: 2.5 cores, 3.2 GiB, 85%, 1.2/core."""
    try:
        unit = CAPABILITIES[Metric(str(metric))].unit
    except ValueError:
        return _number(value)
    if isinstance(value, bool) or not isinstance(value, int | float):
        return _number(value)
    if unit is Unit.BYTES:
        return f"{value / (1 << 30):.3g} GiB"
    if unit is Unit.PERCENT:
        return f"{value:.3g}%"
    if unit is Unit.CORES:
        return f"{value:.3g} cores"
    return f"{value:.3g}/core"


def _where(entry: Mapping[str, Any]) -> str:
    """Which group the entry changed, as it concerns the pod asked for."""
    lever = entry.get("lever") or ""
    relation = entry.get("relation")
    group = entry.get("group")
    if relation == "group":
        listed = "; the pod was one of the candidates it listed" if entry.get("listed") else ""
        return f"{lever} on {group}, a group above the pod (every pod under it is held){listed}"
    workload = entry.get("workload")
    name = workload.get("name") if isinstance(workload, Mapping) else None
    return f"{lever} on {name or group}".strip() if lever else f"{name or group}"


def _objective(entry: Mapping[str, Any]) -> str | None:
    objective = entry.get("objective")
    if not isinstance(objective, Mapping):
        return None
    metric, restore = objective.get("metric"), objective.get("restore_below")
    threshold = _in_unit(metric, objective.get("threshold"))
    text = f"objective {objective.get('name')}: {objective.get('action')} past {metric} {threshold}"
    return text + (f", restore below {_in_unit(metric, restore)}" if restore is not None else "")


def _readings(entry: Mapping[str, Any]) -> str | None:
    readings = entry.get("readings")
    if not isinstance(readings, Mapping) or not readings:
        return None
    gaps = entry.get("gaps")
    parts = [f"{metric} {_in_unit(metric, value)}" for metric, value in readings.items()]
    text = "readings: " + ", ".join(parts)
    if isinstance(gaps, Mapping):
        shown = [f"{kind} {metric} {_in_unit(metric, v)}" for kind, by in gaps.items() if isinstance(by, Mapping)
                 for metric, v in by.items()]  # fmt: skip
        if shown:
            text += "; gaps: " + ", ".join(shown)
    return text


def _candidate(entry: Mapping[str, Any]) -> str | None:
    candidate = entry.get("candidate")
    if not isinstance(candidate, Mapping):
        return None
    classes = candidate.get("classes")
    below = candidate.get("below_priority")
    spec = "classes " + ", ".join(map(str, classes)) if isinstance(classes, list) else "?"
    if below is not None:
        spec += f", priority below {below}"
    rule = entry.get("rule")
    return (
        f"candidate: {candidate.get('class')}, priority {candidate.get('priority')} "
        f"(guard.candidates: {spec}); rule: {rule if rule is not None else 'none'}"
    )


def _rank(entry: Mapping[str, Any]) -> str | None:
    rank = entry.get("rank")
    if not isinstance(rank, Mapping):
        return None
    key = rank.get("key")
    keys = ", ".join(f"{name} {value}" for name, value in key.items()) if isinstance(key, Mapping) else ""
    position = rank.get("position")
    place = f"ranked {position} of {rank.get('of')} candidates (1 is acted on first); " if position is not None else ""
    return f"{place}sort key (lower first): {keys}"


def _values(entry: Mapping[str, Any]) -> str:
    if entry.get("kind") == "evict":
        return "eviction asked"
    if entry.get("relation") == "daemon":
        return ""
    return f"{entry.get('before')} -> {entry.get('after')}"


def entry_lines(entry: Mapping[str, Any]) -> list[str]:
    kind = entry.get("kind")
    if kind in ("start", "stop"):
        what = "started" if kind == "start" else "stopped"
        done = []
        if back := entry.get("groups", entry.get("restored")):
            done.append(f"put back every lever of {', '.join(map(str, back))}")
        if kept := entry.get("kept_groups", entry.get("kept")):
            done.append(f"kept holding {', '.join(map(str, kept))}")
        return [f"{entry.get('time')}  daemon {what} ({entry.get('how')}): {'; '.join(done) or 'nothing held'}"]
    lines = [f"{entry.get('time')}  {kind}  {_where(entry)}: {_values(entry)}"]
    gap = entry.get("gap")
    lines.append(
        f"    why: {entry.get('reason')}"
        + (f"; gap left to close: {_in_unit(entry.get('metric'), gap)}" if gap is not None else "")
    )
    for part in (_objective(entry), _readings(entry), _candidate(entry), _rank(entry)):
        if part is not None:
            lines.append(f"    {part}")
    listed, under = entry.get("workloads"), entry.get("under")
    if isinstance(listed, list) and listed:
        known = {w.get("id"): w.get("name") for w in under if isinstance(w, Mapping)} if isinstance(under, list) else {}
        more = entry.get("workloads_more")
        lines.append(f"    candidates it listed: {', '.join(str(known.get(w) or w) for w in listed)}"
                     + (f" and {more} more" if more else ""))  # fmt: skip
    return lines


def _held_line(entry: Mapping[str, Any]) -> str:
    since = shown_time(entry["at"]) if isinstance(entry.get("at"), int | float) else "?"
    return f"  {_where(entry)}: {entry.get('after')} (was {entry.get('before')}) since {since}, {entry.get('reason')}"


def _named(workload: Mapping[str, Any]) -> str:
    if not workload.get("name"):
        return f"{workload['id']} (no entry names it: taken as a cgroup path)"
    uid = f" (uid {workload['uid']})" if workload.get("uid") else ""
    return f"{workload['name']} at {workload['id']}{uid}"


def render(answer: Mapping[str, Any], directory: str) -> str:
    """The answer of ``history.query.answer`` as text."""
    out: list[str] = []
    history = answer["history"]
    workloads: Sequence[Mapping[str, Any]] = answer["workloads"]
    if answer.get("pod") is not None:
        named = "; ".join(_named(w) for w in workloads)
        out.append(f"{answer['pod']}: {named or 'no workload of that UID in the history'}")
    oldest = history.get("oldest_time")
    span = f"{history['entries']} entries since {oldest}" if oldest else "no entries"
    if not history["files"]:
        span = "no files (has the daemon acted yet? is history.path right?)"
    skipped = f"; {history['malformed']} malformed lines skipped" if history["malformed"] else ""
    out += [f"history {directory}: {span}{skipped}", ""]
    held = answer["held"]
    if held:
        out.append(f"Held back at {answer['at_time']}:")
        out += [_held_line(entry) for entry in held]
    else:
        out.append(f"Nothing nodeguard holds back at {answer['at_time']}" + (" (that the history knows of)." if
                                                                            oldest else "."))  # fmt: skip
    evictions = answer["evictions"]
    if evictions:
        last = evictions[-1]
        out.append(f"  eviction asked at {last['time']}: {last.get('reason')}")
    entries = answer["entries"]
    since = answer.get("since_time")
    window = f"from {since} " if since else ""
    out += ["", f"What nodeguard did {window}until {answer['at_time']} ({len(entries)} entries):"]
    if len(entries) > SHOWN:
        out.append(f"  ({len(entries) - SHOWN} earlier entries not shown: --since, or --json for all)")
    for entry in entries[-SHOWN:]:
        out += entry_lines(entry)
    if not entries:
        out.append("  nothing")
    return "\n".join(out)
