"""``nodeguard demo``: the daemon at work on this machine, in about 30 seconds.

It creates its own cgroups (cgroup v2 with the cpu controller, or the v1 cpu
and cpuacct hierarchies of a hybrid host), starts one important workload and
four greedy batch burners, and runs the real guard against them with a live
view. Everything it created is restored and removed at the end, Ctrl-C
included. Where it may not create cgroups it says so and runs a dry run on the
machine's existing cgroups instead.
"""

from __future__ import annotations

import contextlib
import statistics
import tempfile
import time
from dataclasses import dataclass, field
from typing import Any

from rich.console import Console, Group
from rich.live import Live
from rich.table import Table
from rich.text import Text

from nodeguard.config import Settings
from nodeguard.daemon import Daemon
from nodeguard.log import configure
from nodeguard.model.snapshot import Snapshot
from nodeguard.scratch_cgroups import ScratchCgroups, created, plan_cgroups

BURNERS = 4
IMPORTANT_WANTS = 0.5
WATERLINE_PCT = 75.0
RESTORE_PCT = 50.0
TICK = 0.5

_IMPORTANT = """
import time
while True:
    start = time.monotonic()
    while time.monotonic() - start < %f:
        pass
    time.sleep(max(0.0, 0.1 - (time.monotonic() - start)))
""" % (IMPORTANT_WANTS * 0.1)
_BURNER = "while True: pass"


def demo_settings(groups: ScratchCgroups | None, run_dir: str) -> Settings:
    workloads: dict[str, Any]
    if groups is None:
        workloads = {"groups": [{"match": "system.slice/*", "class": "BestEffort"}]}
    else:
        workloads = {"groups": [
            {"match": f"{groups.parent}/batch-*", "class": "BestEffort"},
            {"match": f"{groups.parent}/important", "class": "Guaranteed", "priority": 1000, "protected": True},
        ]}
    return Settings.model_validate({
        "sensing": {"tickSeconds": TICK, "kubepods": False, "discoverySeconds": 1,
                    **({"cgroupVersion": groups.version} if groups else {})},
        "workloads": workloads,
        "guard": {
            "objectives": [{"metric": "cpu_total_utilization", "action": "throttle", "threshold": WATERLINE_PCT,
                            "restoreBelow": RESTORE_PCT, "triggerAfter": 2}],
            "targetMarginPercent": 3,
        },
        "actuation": {"ledgerPath": f"{run_dir}/ledger.json", "dryRun": groups is None},
        "http": {"enabled": False},
        "gate": {"enabled": False},
    })


@dataclass
class Record:
    started: float
    waterline: float = 0.0
    node: list[tuple[float, float]] = field(default_factory=list)  # (seconds, cores)
    important: list[tuple[float, float]] = field(default_factory=list)
    touched: set[str] = field(default_factory=set)
    first_action: float | None = None
    under_after_action: float | None = None


def _bar(value: float, limit: float, cpus: int, width: int = 40) -> Text:
    filled = round(min(value, cpus) / cpus * width)
    mark = round(limit / cpus * width)
    text = Text()
    for i in range(width):
        char = "█" if i < filled else "·"
        text.append("|" if i == mark else char, style="red" if i < filled and i >= mark else "green")
    return text


def view(snapshot: Snapshot, daemon: Daemon, record: Record, remaining: float, dry: bool) -> Group:
    node = snapshot.node
    cores = node.cores_used or 0.0
    head = Text.assemble(
        ("nodeguard demo", "bold"), f"  {remaining:4.0f}s left", ("  DRY RUN" if dry else "", "yellow"), "\n",
        "node CPU ", _bar(cores, record.waterline, node.cpus), f" {cores:.2f}/{node.cpus} cores",
        f"  waterline {record.waterline:.2f}",
    )
    table = Table(expand=True)
    for column in ("workload", "class", "cores", "quota", "throttled by nodeguard"):
        table.add_column(column)
    for wid, usage in sorted(snapshot.workloads.items()):
        quota = usage.cpu_max.cores if usage.cpu_max is not None else None
        held = daemon.state.throttles.get(wid)
        table.add_row(
            wid.rsplit("/", 1)[-1], str(usage.workload.qos_class), f"{usage.cores or 0:.2f}",
            "max" if quota is None else f"{quota:.2f}", "yes" if held else "",
        )
    return Group(head, table)


def summary(record: Record, groups: ScratchCgroups | None) -> str:
    before = [c for t, c in record.important if record.first_action is None or t < record.first_action]
    settled = record.under_after_action
    during = [c for t, c in record.important if settled is not None and t >= settled]
    lines = ["", "summary"]
    if record.first_action is None:
        lines.append("  the node never went past the waterline: nothing to do")
    else:
        took = None if record.under_after_action is None else record.under_after_action - record.first_action
        lines.append(f"  first throttle {record.first_action:.1f}s after start; under the waterline "
                     + ("never" if took is None else f"{took:.1f}s later"))
    lines.append(f"  workloads touched: {len(record.touched)} of {BURNERS if groups else 'the candidates'}")
    if groups is not None and before:
        share = statistics.mean(before) / IMPORTANT_WANTS
        after = f"{statistics.mean(during) / IMPORTANT_WANTS:.0%}" if during else "-"
        lines.append(f"  important workload got {share:.0%} of the CPU it wanted before, {after} during")
    lines.append("  every quota restored" + (" and every demo cgroup removed" if groups else ""))
    return "\n".join(lines)


def run_demo(seconds: float = 30.0, console: Console | None = None) -> int:
    console = console or Console()
    configure("warning")  # the live view tells the story; warnings and errors still show
    names = ["important", *[f"batch-{i}" for i in range(BURNERS)]]
    planned = plan_cgroups(names, "nodeguard-demo")
    groups = planned if isinstance(planned, ScratchCgroups) else None
    if groups is None:
        console.print(f"[yellow]cannot create cgroups here ({planned}): dry run on this machine's cgroups[/]")
    with tempfile.TemporaryDirectory(prefix="nodeguard-demo-") as run_dir, contextlib.ExitStack() as stack:
        if groups is not None:
            programs = {name: _IMPORTANT if name == "important" else _BURNER for name in names}
            stack.enter_context(created(groups, programs))
        daemon = Daemon(demo_settings(groups, run_dir))
        record = Record(started=time.monotonic())
        record.waterline = WATERLINE_PCT / 100 * daemon.sensor.node.cpus
        try:
            daemon.start()
            daemon.sensor.sense()
            with Live(console=console, auto_refresh=False, transient=False) as live:
                deadline = record.started + seconds
                while (now := time.monotonic()) < deadline:
                    time.sleep(TICK)
                    daemon.tick()
                    snapshot = daemon.last_snapshot
                    assert snapshot is not None
                    _record(record, daemon, snapshot, groups)
                    live.update(view(snapshot, daemon, record, deadline - now, groups is None), refresh=True)
        except KeyboardInterrupt:
            console.print("interrupted: restoring and cleaning up")
        finally:
            daemon.stop()
    console.print(summary(record, groups))
    return 0


def _record(record: Record, daemon: Daemon, snapshot: Snapshot, groups: ScratchCgroups | None) -> None:
    t = time.monotonic() - record.started
    cores = snapshot.node.cores_used or 0.0
    record.node.append((t, cores))
    if groups is not None:
        usage = snapshot.workloads.get(f"{groups.parent}/important")
        if usage is not None and usage.cores is not None:
            record.important.append((t, usage.cores))
    plan = daemon.last_plan
    if plan is not None and plan.actions:
        record.touched |= {a.workload_id for a in plan.actions if a.kind == "throttle"}
        if record.first_action is None:
            record.first_action = t
    elif record.first_action is not None and record.under_after_action is None and cores < record.waterline:
        record.under_after_action = t
