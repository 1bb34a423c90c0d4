"""A tick's lever changes and evictions as history entries: plain JSON values, one line each.

An entry says what was done (kind, lever, group, the value before and after
as people read them), to whom (the workload, or for a group such as a QoS
tier the candidates it listed and every workload under it), and why, as the
tick saw it: the readings, the gaps, the objective's waterline, the
workload's place in the candidate order with its sort key, its class and
priority against ``guard.candidates``, and the rule that made it a candidate
(``rule``, as the plan's trace words it: policy.selection). Pure: built from the tick's immutable plan and
snapshot.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from nodeguard.actuators.changes import Done
from nodeguard.history.jsonl import VERSION
from nodeguard.model.levers import LeverChange
from nodeguard.model.snapshot import Snapshot
from nodeguard.model.workloads import Workload
from nodeguard.policy.actions import Evict
from nodeguard.policy.metrics import Metric
from nodeguard.policy.planner import Plan
from nodeguard.policy.ranking import ordering
from nodeguard.policy.settings import Candidates
from nodeguard.policy.waterlines import ActionKind, Waterline

# A group's change lists the candidates it named and the workloads it holds (the group's own and those under it),
# in about this many bytes at most (``workloads_more`` and ``under_more`` count the rest): a line stays well below
# the least file size (history.settings.MIN_FILE_BYTES), so that it always fits in a file.
GROUP_BYTES = 32 << 10
DIGITS = 4  # readings and gaps are rounded to this many decimals: what a person compares, at half the bytes

Entry = dict[str, Any]


def workload_data(workload: Workload) -> dict[str, Any]:
    return {
        "id": workload.id,
        "name": workload.name,
        "kind": workload.kind,
        "uid": workload.pod_uid,
        "class": str(workload.qos_class),
        "priority": workload.priority,
    }


def _rounded(values: Mapping[Metric, float | None]) -> dict[str, float]:
    return {str(metric): round(value, DIGITS) for metric, value in values.items() if value is not None}


def _by_id(workload: Workload) -> str:
    return workload.id


def _key_part(part: object) -> object:
    if isinstance(part, tuple):
        return list(part)
    return round(part, DIGITS) if isinstance(part, float) else part


def _round(value: float | None) -> float | None:
    return None if value is None else round(value, DIGITS)


class TickContext:
    """What every entry of one tick shares, worked out once: readings, gaps, the candidate orders' positions."""

    def __init__(self, plan: Plan, snapshot: Snapshot, candidates: Candidates) -> None:
        self.plan = plan
        self.snapshot = snapshot
        self.candidates = candidates
        self.readings = _rounded(plan.readings)
        gaps = plan.gaps
        every = {"throttle_down": gaps.throttle_down, "throttle_up": gaps.throttle_up, "evict": gaps.evict}
        self.gaps = {name: _rounded(values) for name, values in every.items() if values}
        self._positions: dict[tuple[str, ...], dict[str, int]] = {}

    def line(self, metric: str, action: ActionKind) -> Waterline | None:
        try:
            return self.plan.waterlines.get((Metric(metric), action))
        except ValueError:
            return None

    def objective(self, line: Waterline | None) -> dict[str, Any] | None:
        if line is None:
            return None
        return {
            "name": line.objective,
            "metric": str(line.metric),
            "action": line.action,
            "threshold": round(line.threshold, DIGITS),
            "restore_below": None if line.restore_below is None else round(line.restore_below, DIGITS),
            "sort_by": list(line.sort_by),
        }

    def rank(self, workload: Workload, line: Waterline | None) -> dict[str, Any] | None:
        """The workload's sort key in the objective's candidate order and, where the plan ranked the candidates,
        its place (1: the first acted on) among them."""
        usage = self.snapshot.workloads.get(workload.id)
        if line is None or usage is None:
            return None
        names = line.sort_by
        key = ordering(names).key(usage)
        data: dict[str, Any] = {"key": dict(zip(names, map(_key_part, key), strict=False))}  # in sort order
        ranked = self.plan.rankings.get(names)
        if ranked is not None:
            positions = self._positions.get(names)
            if positions is None:
                positions = self._positions[names] = {u.workload.id: i for i, u in enumerate(ranked, 1)}
            data["position"] = positions.get(workload.id)
            data["of"] = len(ranked)
        return data

    def candidate(self, workload: Workload) -> dict[str, Any]:
        """Why the workload could be acted on: its class and priority against ``guard.candidates``."""
        spec = self.candidates
        return {
            "class": str(workload.qos_class),
            "priority": workload.priority,
            "classes": [str(c) for c in spec.classes],
            "below_priority": spec.below_priority,
        }

    def rule(self, workload: Workload) -> str | None:
        """The rule that made the workload a candidate (or protected, exempt: policy.selection), as the plan's
        trace words it; None where the plan has no choice for it."""
        choices = self.plan.choices
        if choices is None or workload.id not in choices:
            return None
        return choices[workload.id].rule

    def why(self, metric: str, action: ActionKind, workload: Workload | None) -> Entry:
        line = self.line(metric, action)
        return {
            "objective": self.objective(line),
            "readings": self.readings,
            "gaps": self.gaps,
            "rank": None if workload is None else self.rank(workload, line),
            "candidate": None if workload is None else self.candidate(workload),
            "rule": None if workload is None else self.rule(workload),
            "protect_phase": str(self.plan.state.protect.phase),
        }

    def members(self, group: str, listed: Sequence[str]) -> dict[str, Any]:
        """A group's change: the candidates it listed (ids), and every workload it holds back (the group's own, a QoS
        tier's pods) with its name, the listed first; as many as fit in GROUP_BYTES, and how many more of each."""
        prefix = group + "/"
        held = {wid: u.workload for wid, u in self.snapshot.workloads.items() if wid == group or wid.startswith(prefix)}
        first = [held[wid] for wid in listed if wid in held]
        named = set(listed)
        order = [*first, *sorted((w for wid, w in held.items() if wid not in named), key=_by_id)]
        budget = GROUP_BYTES
        ids: list[str] = []
        for wid in listed:
            budget -= len(wid) + 3
            if budget < 0:
                break
            ids.append(wid)
        under: list[dict[str, str]] = []
        for workload in order:
            budget -= len(workload.id) + len(workload.name) + 20
            if budget < 0:
                break
            under.append({"id": workload.id, "name": workload.name})
        data: dict[str, Any] = {"workloads": ids, "under": under}
        if len(ids) < len(listed):
            data["workloads_more"] = len(listed) - len(ids)
        if len(under) < len(order):
            data["under_more"] = len(order) - len(under)
        return data


def change_entry(done: Done, tick: TickContext) -> Entry:
    """A lever change the executor made."""
    change: LeverChange = done.change
    entry: Entry = {
        "v": VERSION,
        "at": round(tick.snapshot.wall_time, 3),
        "kind": change.kind,
        "lever": change.lever,
        "group": change.group,
        "holds_back": done.holds_back,
        "release": change.release,
        "before": done.shown[0],
        "after": done.shown[1],
        "values": [done.before, done.after],  # as the lever writes them
        "original": change.give_back,  # before nodeguard first changed it (None: the value before this change)
        "children": done.children,
        "metric": change.metric,
        "reason": change.reason,
        "gap": _round(change.gap_before),
        "predicted_release": _round(change.predicted_release),
        "releases": _round(change.releases),
        "workload": None if change.workload is None else workload_data(change.workload),
    }
    if change.workload is None:
        entry.update(tick.members(change.group, change.workloads))
    entry.update(tick.why(change.metric, "throttle", change.workload))
    return entry


def evict_entry(action: Evict, tick: TickContext) -> Entry:
    """An eviction asked of the evictor."""
    entry: Entry = {
        "v": VERSION,
        "at": round(tick.snapshot.wall_time, 3),
        "kind": "evict",
        "lever": None,
        "group": action.workload.id,
        "holds_back": True,
        "release": False,
        "metric": str(action.metric),
        "reason": action.reason,
        "gap": _round(action.gap_before),
        "predicted_release": _round(action.predicted_release),
        "cores": _round(action.cores),
        "memory_bytes": action.memory_bytes,
        "workload": workload_data(action.workload),
    }
    entry.update(tick.why(str(action.metric), "evict", action.workload))
    return entry


def tick_entries(plan: Plan, snapshot: Snapshot, done: Iterable[Done], candidates: Candidates) -> list[Entry]:
    """One entry per lever change made and per eviction asked (not a dry run's) in one tick, in the order made."""
    evictions = [a for a in plan.actions if isinstance(a, Evict) and not a.dry_run]
    made = list(done)
    if not made and not evictions:
        return []
    tick = TickContext(plan, snapshot, candidates)
    return [*(change_entry(d, tick) for d in made), *(evict_entry(a, tick) for a in evictions)]


def lifecycle_entry(kind: str, at: float, how: str, restored: Iterable[str], kept: Iterable[str] = ()) -> Entry:
    """The daemon started or stopped: what it put back (every lever of those groups), what it kept holding."""
    return {
        "v": VERSION,
        "at": round(at, 3),
        "kind": kind,
        "lever": None,
        "group": None,
        "how": how,
        "restored": sorted(set(restored)),
        "kept": sorted(set(kept)),
    }
