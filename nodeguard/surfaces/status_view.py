"""``nodeguard status``: the running daemon's /status as a terminal view."""

from __future__ import annotations

import json
from typing import Any

import httpx
from rich.console import Console, Group
from rich.panel import Panel
from rich.table import Table

from nodeguard.errors import NodeguardError
from nodeguard.netaddr import split_host_port


def fetch_status(listen: str, timeout: float = 5.0) -> dict[str, Any]:
    host, port = split_host_port(listen, any_port=True)
    if host in ("0.0.0.0", "::"):
        host = "127.0.0.1"
    url = f"http://{'[' + host + ']' if ':' in host else host}:{port}/status"
    try:
        response = httpx.get(url, timeout=timeout, trust_env=False)
        response.raise_for_status()
        data: dict[str, Any] = json.loads(response.content)
        return data
    except (httpx.HTTPError, ValueError) as exc:
        raise NodeguardError(f"cannot read {url}: {exc}; is nodeguard running with http enabled?") from None


def _gib(value: Any) -> str:
    return "-" if value is None else f"{value / 2**30:.1f}"


def _fmt(value: Any, digits: int = 2) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.{digits}f}"
    return str(value)


def render(status: dict[str, Any]) -> Group:
    plan = status.get("plan") or {}
    head = Table.grid(padding=(0, 2))
    node = status.get("node_usage") or {}
    head.add_row(
        f"node [bold]{status.get('node')}[/]",
        f"cgroup {status.get('cgroup')}",
        f"ticks {status.get('ticks')} (errors {status.get('tickErrors')})",
        "[yellow]DRY RUN[/]" if status.get("dryRun") else "",
    )
    head.add_row(
        f"cpu {_fmt(node.get('cores_used'))}/{node.get('cpus')} cores",
        f"load1 {_fmt(node.get('load1'))}",
        f"memory {_gib(node.get('memory_used'))}/{_gib(node.get('memory_total'))} GiB",
        "",
    )
    problems = [f"{part}: {problem}" for part, problem in (status.get("health") or {}).items() if problem]
    head.add_row("[green]healthy[/]" if not problems else "[red]not ready:[/] " + "; ".join(problems), "", "", "")
    for warning in status.get("warnings") or ():
        head.add_row(f"[yellow]{warning['setting']}:[/] {warning['message']}", "", "", "")
    waterlines = Table(title="waterlines", expand=True)
    for column in ("metric", "action", "now", "waterline", "restore below", "gap"):
        waterlines.add_column(column)
    readings = (plan.get("inputs") or {}).get("readings") or {}
    gaps = plan.get("gaps") or {}
    for line in plan.get("waterlines", []):
        metric = line["metric"]
        gap = (gaps.get("throttle_down" if line["action"] == "throttle" else "evict") or {}).get(metric)
        over = gap is not None
        waterlines.add_row(
            metric,
            line["action"],
            f"[{'red' if over else 'green'}]{_fmt(readings.get(metric))}[/]",
            _fmt(line["threshold"]),
            _fmt(line.get("restore_below")),
            _fmt(gap),
        )
    throttles = Table(title="held back", expand=True)
    for column in ("group", "lever", "original", "now", "reason"):
        throttles.add_column(column)
    for lever, groups in sorted((status.get("held") or {}).items()):
        for group, held in sorted(groups.items()):
            shown = held.get("shown") or {"original": held["original"], "applied": held["applied"]}
            throttles.add_row(group, lever, shown["original"], shown["applied"], held["reason"])
    gate = status.get("gate") or {}
    gate_table = Table(title="gate", expand=True)
    gate_table.add_column("state")
    gate_table.add_column("loads")
    for state, count in sorted((gate.get("counts") or {}).items()):
        gate_table.add_row(str(state), str(count))
    parts: list[Any] = [Panel(head, title=f"nodeguard {status.get('version')}"), waterlines, throttles, gate_table]
    coordination = status.get("coordination") or {}
    semaphores = coordination.get("semaphores") or {}
    if semaphores:
        table = Table(title=f"cluster semaphores ({_link(coordination)})", expand=True)
        for column in ("semaphore", "cap", "allotment", "held", "waiting", "admitted"):
            table.add_column(column)
        for name, s in sorted(semaphores.items()):
            table.add_row(name, *(_fmt(s.get(key)) for key in ("cap", "allotment", "held", "waiting", "admitted")))
        parts.append(table)
        parts.append(_members(coordination, sorted(semaphores)))
    return Group(*parts)


def _members(coordination: dict[str, Any], semaphores: list[str]) -> Table:
    """The members as the bank's census shows them: state, heir and allotment per semaphore."""
    members = coordination.get("members") or {}
    bank = coordination.get("bank")
    table = Table(title=f"cluster members ({len(members)}; bank {bank or 'unknown'})", expand=True)
    for column in ("member", "state", "heir", *semaphores):
        table.add_column(column)
    for name, member in sorted(members.items()):
        allotment = member.get("allotment") or {}
        label = f"{name} (bank)" if member.get("bank") else name
        if name == coordination.get("node"):
            label += " *"
        table.add_row(label, str(member.get("state")), str(member.get("heir") or "-"),
                      *(_fmt(allotment.get(sem, 0)) for sem in semaphores))  # fmt: skip
    return table


def _link(coordination: dict[str, Any]) -> str:
    """The broker connection and whether this node may hand out slots, in a few words."""
    if coordination.get("connected"):
        link = "[green]connected[/]"
    else:
        link = f"[red]broker lost {coordination.get('outageSeconds', 0):.0f} s ago[/]"
    if coordination.get("admitting"):
        return f"{link}, admitting"
    return f"{link}, [red]not admitting: {coordination.get('fencedReason') or coordination.get('phase')}[/]"


def show(listen: str, console: Console | None = None) -> None:
    (console or Console()).print(render(fetch_status(listen)))
