"""Snapshots as plain-text tables and as JSON-ready data."""

from __future__ import annotations

import dataclasses
import datetime
import json
from collections.abc import Sequence
from enum import Enum
from typing import Any

from nodeguard.model.samples import Psi
from nodeguard.model.snapshot import Snapshot
from nodeguard.policy.planner import Plan
from nodeguard.policy.trace import plan_to_data

GiB = 1 << 30
MiB = 1 << 20


def to_data(value: Any) -> Any:
    """Dataclasses, enums and mappings to plain JSON values."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: to_data(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, Enum):
        return value.value
    if isinstance(value, tuple) and hasattr(value, "_asdict"):
        return {k: to_data(v) for k, v in value._asdict().items()}
    if isinstance(value, dict) or hasattr(value, "items"):
        return {str(k): to_data(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [to_data(v) for v in value]
    return value


def snapshot_data(snapshot: Snapshot) -> dict[str, Any]:
    data: dict[str, Any] = to_data(snapshot)
    node = snapshot.node
    data["node"]["memory_used"] = node.memory_used
    data["node"]["memory_utilization"] = node.memory_utilization
    data["node"]["load_per_core"] = node.load_per_core
    data["workloads"] = list(data["workloads"].values())
    return data


def table(headers: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    widths = [max(len(h), *(len(r[i]) for r in rows)) if rows else len(h) for i, h in enumerate(headers)]
    lines = ["  ".join(h.ljust(w) for h, w in zip(headers, widths, strict=True)).rstrip()]
    lines += ["  ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)).rstrip() for r in rows]
    return "\n".join(lines)


def _num(value: float | None, fmt: str = "{:.2f}", none: str = "-") -> str:
    return none if value is None else fmt.format(value)


def _psi10(psi: Psi | None) -> str:
    return "-" if psi is None or psi.some is None else f"{psi.some.avg10:.1f}%"


def render_snapshot(snapshot: Snapshot) -> str:
    node = snapshot.node
    when = datetime.datetime.fromtimestamp(snapshot.wall_time).strftime("%H:%M:%S")
    head = (
        f"node at {when}  cgroup {snapshot.cgroup_version}  cpus {node.cpus}\n"
        f"  cpu     {_num(node.cores_used)} cores ({_num(node.cpu_utilization, '{:.1f}')}%)"
        f"   load {_num(None if node.load is None else node.load.load1)} ({_num(node.load_per_core)}/core)"
        f"   psi cpu {_psi10(node.cpu_pressure)} mem {_psi10(node.memory_pressure)}"
        f" io {_psi10(node.io_pressure)}\n"
        f"  memory  {_num(None if node.memory_used is None else node.memory_used / GiB)}"
        f" of {_num(None if node.memory is None else node.memory.total / GiB)} GiB"
        f" ({_num(node.memory_utilization, '{:.1f}')}%)"
    )
    rows = []
    for usage in sorted(snapshot.workloads.values(), key=lambda u: -(u.cores or 0.0)):
        wl = usage.workload
        quota = (
            "-" if usage.cpu_max is None else ("max" if usage.cpu_max.cores is None else f"{usage.cpu_max.cores:.2f}")
        )
        rows.append(
            [
                wl.name,
                wl.qos_class.value,
                str(wl.priority),
                _num(usage.cores),
                quota,
                _num(usage.throttled_fraction, "{:.0%}"),
                _num(None if usage.memory_bytes is None else usage.memory_bytes / MiB, "{:.0f}"),
                _num(usage.cpu_stall_pct, "{:.1f}%"),
            ]
        )
    body = table(["workload", "class", "prio", "cores", "quota", "throttled", "mem MiB", "psi cpu"], rows)
    return f"{head}\n\n{len(rows)} workload(s)\n{body}"


def _quota(data: dict[str, Any]) -> str:
    cores = data.get("cores")
    return "max" if cores is None else f"{cores:.2f}"


def _period(action: dict[str, Any]) -> str:
    period = action["quota"]["period_us"]
    return "" if period == action["original"]["period_us"] else f" ({period / 1000:g} ms period)"


def _mib(value: int | str) -> str:
    return value if isinstance(value, str) else f"{value / (1 << 20):.0f}Mi"


def _limit(action: dict[str, Any]) -> str:
    """The limit an action changes: a CPU quota in cores, or memory.high."""
    if "quota" in action:
        return _quota(action["previous"]) + " -> " + _quota(action["quota"]) + _period(action)
    if "memory_high" in action:
        return f"memory.high {_mib(action['previous'])} -> {_mib(action['memory_high'])}"
    return "-"


def render_plan(plan: Plan, candidates_shown: int = 10) -> str:
    """The plan as a person reads it: readings against waterlines, gaps, actions, and why not more."""
    data = plan_to_data(plan, candidate_limit=candidates_shown)
    readings = data["inputs"]["readings"]
    lines = [f"{data['inputs']['workloads']} workload(s), {data['inputs']['candidates'] or 0} candidate(s)", ""]
    rows = []
    for line in data["waterlines"]:
        metric = line["metric"]
        gaps = data["gaps"]
        gap = gaps["throttle_down"].get(metric) if line["action"] == "throttle" else gaps["evict"].get(metric)
        rows.append(
            [
                metric,
                line["action"],
                _num(readings.get(metric), "{:.3g}"),
                _num(line["threshold"], "{:.3g}"),
                _num(line["restore_below"], "{:.3g}"),
                _num(gap, "{:.3g}"),
                _num(gaps["throttle_up"].get(metric) if line["action"] == "throttle" else None, "{:.3g}"),
                "yes" if line["dry_run"] else "",
            ]
        )
    lines.append(
        table(["metric", "action", "now", "waterline", "restore<", "gap", "up-gap", "dry-run"], rows)
        if rows
        else "no objectives configured"
    )
    lines += ["", f"{len(data['actions'])} action(s)"]
    action_rows = [
        [
            a["kind"] + (" (dry run)" if a["dry_run"] else ""),
            a["workload"]["name"],
            a["metric"],
            _num(a["gap_before"], "{:.3g}"),
            _num(a["predicted_release"], "{:.3g}"),
            _limit(a),
        ]
        for a in data["actions"]
    ]
    if action_rows:
        lines.append(table(["action", "workload", "metric", "gap", "release", "limit"], action_rows))
    for r in data["reweighs"]:
        what = "lower the CPU weight of" if r["lower"] else "put back the CPU weight of"
        dry = " (dry run)" if r["dry_run"] else ""
        lines.append(f"reweigh{dry}: {what} {r['group']} ({len(r['workloads'])} candidate(s) in it): {r['reason']}")
    protected = [p for p in data["protected"] if p["target_pct"] is not None]
    if protected:
        lines += ["", "protected workloads (protected_cpu_stall)"]
        lines.append(
            table(
                ["workload", "stall", "target", "restore<", "harmed", "lever"],
                [
                    [
                        p["name"],
                        _num(p["stall_pct"], "{:.1f}%"),
                        _num(p["target_pct"], "{:.3g}%"),
                        _num(p["restore_below_pct"], "{:.3g}%"),
                        {True: "yes", False: "no", None: "-"}[p["harmed"]],
                        ", ".join(p["levers"]) or "-",
                    ]
                    for p in protected
                ],
            )
        )
    for blocked in data["blocked"]:
        lines.append(
            f"not acting on {blocked['metric']} ({blocked['direction']}): {blocked['cause']}: {blocked['detail']}"
        )
    if data["selection"]:
        lines += ["", "what the guard may act on, and by which rule"]
        lines.append(
            table(
                ["role", "rule", "workloads"],
                [[g["role"], g["rule"], _some(g["workloads"], g["count"])] for g in data["selection"]],
            )
        )
    for names, ranked in data["candidates"].items():
        lines += ["", f"candidates by {names} (first acted on first)"]
        lines.append(
            table(
                ["workload", "sort key", "rule"],
                [[c["workload"], json.dumps(c["key"]), c.get("rule", "-")] for c in ranked],
            )
        )
    return "\n".join(lines)


def _some(workloads: Sequence[str], count: int, shown: int = 3) -> str:
    """A count of workloads and the first few of them."""
    more = f", … {count - shown} more" if count > shown else ""
    return f"{count}: " + ", ".join(workloads[:shown]) + more
