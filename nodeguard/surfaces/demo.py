"""``nodeguard demo``: the daemon at work on this machine, in about 30 seconds.

It creates its own cgroups (cgroup v2 with the cpu controller, or the v1 cpu
and cpuacct hierarchies of a hybrid host), starts one important workload (a
4 ms unit of work every 10 ms; how late each unit finishes is its service
level) and four greedy batch burners at equal weights, and runs the real guard
with a protected_cpu_stall objective against them, with a live view of the
important workload's stall and lateness. Everything it created is restored and removed at the end, Ctrl-C
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
from nodeguard.model.levers import TERMS
from nodeguard.model.snapshot import Snapshot
from nodeguard.policy.stall import covers, stalls, worst
from nodeguard.scratch_cgroups import ScratchCgroups, created, plan_cgroups

BURNERS = 4
UNGUARDED_SECONDS = 6.0  # the harm, measured before the guard starts
STALL_TARGET_PCT = 5.0
TICK = 0.5

# A fixed unit of work (calibrated: the fastest of 50 tries takes 4 ms) released every 10 ms; each line written
# is a unit's release and how late it finished (µs of CLOCK_MONOTONIC, which the demo shares).
_IMPORTANT = """
import sys, time
out = open(sys.argv[1], "a", buffering=1)
def work(n):
    x = 0
    for i in range(n):
        x += i
def timed(n):
    start = time.perf_counter()
    work(n)
    return time.perf_counter() - start
n = max(1000, round(20000 * 0.004 / min(timed(20000) for _ in range(20))))
n = max(1, round(n * 0.004 / min(timed(n) for _ in range(50))))
t0, k = time.monotonic(), 0
while True:
    release = t0 + k * 0.01
    now = time.monotonic()
    if now < release:
        time.sleep(release - now)
    work(n)
    out.write(f"{round(release * 1e6)} {round((time.monotonic() - release) * 1e6)}\\n")
    k += 1
"""
_BURNER = "while True: pass"


def demo_settings(groups: ScratchCgroups | None, run_dir: str) -> Settings:
    workloads: dict[str, Any]
    if groups is None:
        workloads = {"groups": [{"match": "system.slice/*", "class": "BestEffort"}]}
    else:
        workloads = {
            "groups": [
                {"match": f"{groups.parent}/batch-*", "class": "BestEffort"},
                {"match": f"{groups.parent}/important", "class": "Guaranteed", "priority": 1000, "protected": True},
            ]
        }
    return Settings.model_validate(
        {
            "sensing": {
                "tickSeconds": TICK,
                "kubepods": False,
                "discoverySeconds": 1,
                **({"cgroupVersion": groups.version} if groups else {}),
            },
            "workloads": workloads,
            "guard": {
                "objectives": [
                    {
                        "metric": "protected_cpu_stall",
                        "action": "throttle",
                        "threshold": f"{STALL_TARGET_PCT}%",
                        "restoreBelow": "1%",
                        "triggerAfter": 2,
                        "restoreAfter": 3,
                    }
                ],
                "cooldownTicks": 2,
            },
            "actuation": {"ledgerPath": f"{run_dir}/ledger.json", "dryRun": groups is None},
            "history": {"path": f"{run_dir}/history"},  # the demo's own, gone with it
            "http": {"enabled": False},
            "gate": {"enabled": False},
        }
    )


@dataclass
class Record:
    started: float  # monotonic
    lateness_path: str = ""
    cpus: int = 1
    guard_from: float = 0.0  # seconds after the start
    node: list[tuple[float, float]] = field(default_factory=list)  # (seconds, cores)
    stall: list[tuple[float, float]] = field(default_factory=list)  # (seconds, percent)
    touched: set[str] = field(default_factory=set)
    first_action: float | None = None
    under_after_action: float | None = None  # the stall under target after the first action

    def lateness_ms(self, since: float, until: float | None = None) -> list[float]:
        """The important workload's lateness of the units released in [since, until) seconds after the start."""
        try:
            with open(self.lateness_path, encoding="ascii") as handle:
                lines = handle.read().split("\n")[:-1]  # the last piece may be a line being written
        except OSError:
            return []
        found = []
        for line in lines:
            release_us, _, late_us = line.partition(" ")
            if release_us.isdigit() and late_us.isdigit():
                t = int(release_us) / 1e6 - self.started
                if t >= since and (until is None or t < until):
                    found.append(int(late_us) / 1000)
        return found


def p99(values: list[float]) -> float | None:
    return statistics.quantiles(values, n=100)[98] if len(values) >= 20 else None


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
    stall = record.stall[-1][1] if record.stall else None
    late = p99(record.lateness_ms(max(0.0, time.monotonic() - record.started - 2.0)))
    head = Text.assemble(
        ("nodeguard demo", "bold"),
        f"  {remaining:4.0f}s left",
        ("  DRY RUN" if dry else "", "yellow"),
        "  guard " + ("on" if time.monotonic() - record.started >= record.guard_from else "off (the harm, unguarded)"),
        "\n",
        "node CPU ",
        _bar(cores, node.cpus, node.cpus),
        f" {cores:.2f}/{node.cpus} cores busy\n",
        "important workload: stall ",
        ("-" if stall is None else f"{stall:.1f}%", "red" if (stall or 0.0) > STALL_TARGET_PCT else "green"),
        f" (target {STALL_TARGET_PCT:g}%)   p99 lateness (last 2 s) ",
        "-" if late is None else f"{late:.1f} ms",
        " for a 4 ms unit",
    )
    table = Table(expand=True)
    for column in ("workload", "class", "cores", "quota", "held back by nodeguard"):
        table.add_column(column)
    for wid, usage in sorted(snapshot.workloads.items()):
        quota = usage.cpu_max.cores if usage.cpu_max is not None else None
        levers = [TERMS[lever].noun for lever, groups in daemon.state.holds.items()
                  if any(covers(group, wid) for group in groups)]  # fmt: skip
        table.add_row(
            wid.rsplit("/", 1)[-1],
            str(usage.workload.qos_class),
            f"{usage.cores or 0:.2f}",
            "max" if quota is None else f"{quota:.2f}",
            ", ".join(levers),
        )
    return Group(head, table)


def summary(record: Record, groups: ScratchCgroups | None) -> str:
    first, settled = record.first_action, record.under_after_action
    lines = ["", "summary"]
    if first is None:
        lines.append("  no protected workload was harmed: nothing to do")
    else:
        took = None if settled is None else settled - first
        lines.append(
            f"  first action {first:.1f}s after start; the important workload's stall under "
            f"{STALL_TARGET_PCT:g}% " + ("never" if took is None else f"{took:.1f}s later")
        )
    lines.append(f"  workloads touched: {len(record.touched)} of {BURNERS if groups else 'the candidates'}")
    if groups is not None and first is not None:
        # Before: from one second in (the burners running) until the guard starts; during: once under target.
        start = min(1.0, record.guard_from / 2)
        before = p99(record.lateness_ms(start, record.guard_from))
        during = p99(record.lateness_ms(settled)) if settled is not None else None
        busy_before = [c for t, c in record.node if start <= t < record.guard_from]
        busy_during = [c for t, c in record.node if settled is not None and t >= settled]

        def ms(value: float | None) -> str:
            return "-" if value is None else f"{value:.1f} ms"

        def busy(values: list[float]) -> str:
            return f"{statistics.mean(values) / record.cpus:.0%}" if values else "-"

        lines.append(
            f"  important workload's p99 lateness (4 ms of work every 10 ms): {ms(before)} before, {ms(during)} during"
        )
        lines.append(f"  node busy: {busy(busy_before)} before, {busy(busy_during)} during")
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
        record = Record(started=time.monotonic(), lateness_path=f"{run_dir}/lateness")
        if groups is not None:
            programs = {name: _IMPORTANT if name == "important" else _BURNER for name in names}
            stack.enter_context(created(groups, programs, {"important": [record.lateness_path]}))
        daemon = Daemon(demo_settings(groups, run_dir))
        record.cpus = daemon.sensor.node.cpus
        try:
            daemon.start()
            daemon.sensor.sense()
            # The harm first, unguarded, then the guard at work.
            record.guard_from = min(UNGUARDED_SECONDS, seconds / 3)
            with Live(console=console, auto_refresh=False, transient=False) as live:
                deadline = record.started + seconds
                while (now := time.monotonic()) < deadline:
                    time.sleep(TICK)
                    if now - record.started < record.guard_from:
                        snapshot = daemon.sensor.sense()
                    else:
                        daemon.tick()
                        assert daemon.last_snapshot is not None
                        snapshot = daemon.last_snapshot
                    _record(record, daemon, snapshot)
                    live.update(view(snapshot, daemon, record, deadline - now, groups is None), refresh=True)
        except KeyboardInterrupt:
            console.print("interrupted: restoring and cleaning up")
        finally:
            daemon.stop()
            text = summary(record, groups)  # while the lateness file is still there
    console.print(text)
    return 0


def _record(record: Record, daemon: Daemon, snapshot: Snapshot) -> None:
    t = time.monotonic() - record.started
    cores = snapshot.node.cores_used or 0.0
    record.node.append((t, cores))
    harmed = worst(stalls(snapshot.workloads, ()))
    stall = None if harmed is None else 100.0 * harmed.share
    if stall is not None:
        record.stall.append((t, stall))
    plan = daemon.last_plan
    # The workloads held back this tick: their own group's, or a group's they are under.
    holding = [] if plan is None else [c for c in plan.changes if c.holds_back and not c.dry_run]
    acted = {c.group for c in holding if c.workload is not None} | {wid for c in holding for wid in c.workloads}
    if plan is not None and plan.monotonic == snapshot.monotonic and acted:
        record.touched |= acted
        if record.first_action is None:
            record.first_action = t
    elif (
        record.first_action is not None
        and record.under_after_action is None
        and stall is not None
        and stall < STALL_TARGET_PCT
    ):
        record.under_after_action = t
