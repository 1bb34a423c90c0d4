"""The owner double's scenarios against nodeguard's levers held, on one cgroup version: what the owners' writes
become, and whether nodeguard's holds come back.

A fresh node per scenario (``Owners``: kubelet started; pods ``batch`` Burstable with a container limited to 1.5
cores, ``web`` Burstable without limits, ``be`` BestEffort, ``important`` Guaranteed), then the holds today's
nodeguard makes, written as the executor writes them (``Changer``: the ledger first): quota 0.3 core on ``batch``
(v1: held through its containers, as its container's own limit is above the hold) and 0.2 core on ``web``, both
QoS tiers' weights at the lever's strongest hold (the least weight: v1 cpu.shares 2, v2 cpu.weight 1), cpu.idle on
the BestEffort pod ``be`` where the kernel has it, and on v2 ``memory.high`` 256 MiB on both pods. Then the
scenario, then ``ticks`` of the executor's drift step (``drift.adopt_moves``, then ``drift.reassert``: the part of
a tick that puts held values back), the owners' writes checked after each.

    .venv/bin/python -m tests.support.owner_scenarios v1                    # this host's cgroup v1
    .venv/bin/python -m tests.kernel.vm -- .venv/bin/python -m tests.support.owner_scenarios v2   # the VM

prints one line per scenario and, last, the results as JSON.
"""

from __future__ import annotations

import json
import sys
import tempfile
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path

from nodeguard.actuators import drift, levers
from nodeguard.actuators.cgroup_writer import CgroupWriter
from nodeguard.actuators.changes import Changer
from nodeguard.actuators.ledger import Ledger
from nodeguard.actuators.levers.base import Lever
from nodeguard.errors import CgroupGone
from nodeguard.log import configure
from nodeguard.model.levers import WEIGHT_IDLE, LeverChange
from nodeguard.sources.cgroupfs import parse_cpu_max
from tests.support import cgroups as rc
from tests.support.owners import Container, Driver, Outcome, Owners, Pod, Version, counts

TICKS = 3
HIGH = str(256 << 20)


@dataclass
class Node:
    owners: Owners
    pods: dict[str, Pod]
    ledger: Ledger
    levers: dict[str, Lever]


@dataclass
class ScenarioResult:
    scenario: str
    version: str
    done: int = 0
    refused: int = 0
    overwritten: int = 0
    refusals: list[str] = field(default_factory=list)  # owner group file errno
    failures: list[str] = field(default_factory=list)  # the owners' errors, "fatal" first where they exit
    overwritten_at: dict[str, int] = field(default_factory=dict)  # group/file -> tick
    holds_lost: list[str] = field(default_factory=list)  # nodeguard's values gone right after the scenario
    holds_back_at: int | None = None  # the tick after which every hold was in place (0: never lost; None: not back)
    nodeguard_failures: list[str] = field(default_factory=list)  # re-assertions that failed


def pods() -> dict[str, Pod]:
    gib = 1 << 30
    return {
        "batch": Pod("batch", (Container("app", 500, 1500),)),
        "web": Pod("web", (Container("app", 250),)),
        "be": Pod("be", (Container("app"),)),
        "important": Pod("important", (Container("app", 500, 500, gib, gib),)),
    }


def hold(node: Node) -> None:
    """nodeguard's holds, ledger first, as its executor writes them."""
    owners, version = node.owners, node.owners.version
    batch, web = (owners.pod_path(node.pods[name]) for name in ("batch", "web"))

    def hold(lever: str, group: str, target: str | None, metric: str) -> LeverChange:
        return LeverChange(lever, group, target, None, release=False, holds_back=True, kind="hold", metric=metric,
                           reason="owner scenario")  # fmt: skip

    changes = [
        hold("cpu.max", batch, "30000 100000", "cpu_total_usage"),
        hold("cpu.max", web, "20000 100000", "cpu_total_usage"),
        *[hold("cpu.weight", tier, None, "protected_cpu_stall")  # None: the lever's strongest hold, the least weight
          for tier in (owners.tier("Burstable"), owners.tier("BestEffort"))],
        hold("cpu.weight", owners.pod_path(node.pods["be"]), WEIGHT_IDLE, "protected_cpu_stall"),
    ]  # fmt: skip
    if version == "v2":
        changes += [hold("memory.high", pod, HIGH, "memory_usage") for pod in (batch, web)]
    results = Changer(node.ledger, node.levers).apply(changes)
    assert not results.refused and not results.withheld, (results.refused, results.withheld)


def tick(node: Node) -> list[str]:
    """The executor's drift step: new originals adopted, held values put back; the re-assertions that failed."""
    drift.adopt_moves(node.ledger, node.levers, lambda record: None)
    failed = drift.reassert(node.ledger, node.levers, lambda record: None).failed
    return [f"{node.owners.name_of(group)} {lever}: {error}" for (lever, group), error in failed.items()]


def holds_lost(node: Node) -> list[str]:
    """Every hold the kernel no longer has: a value no longer nodeguard's, or a quota whose group gets more CPU
    than held (a v1 pod held through its containers, one of which the runtime just made again)."""
    lost = []
    for record in node.ledger:
        lever = node.levers[record.lever]
        if record.lever == "cpu.max":
            try:
                rate, held = held_rate(node, record.group), parse_cpu_max(record.holds).cores
            except CgroupGone:
                continue  # the pod left
            if held is not None and (rate is None or rate > held + 1e-6):
                lost.append(f"{node.owners.name_of(record.group)} {record.lever} gets {rate} cores (held {held})")
            continue
        for path, value in [(record.group, record), *record.children.items()]:
            try:
                now = lever.read(path)
            except CgroupGone:
                continue
            if not value.is_ours(now):
                lost.append(f"{node.owners.name_of(path)} {record.lever}={now} (held {value.applied})")
    return lost


def held_rate(node: Node, group: str) -> float | None:
    """The CPU rate in force for a group, in cores (None: unlimited): its own limit, or its direct children's
    together where each has one."""
    quota = node.levers["cpu.max"]
    own = parse_cpu_max(quota.read(group)).cores
    root = Path(node.owners.root)
    limits = []
    for child in sorted(p for p in (root / group).iterdir() if p.is_dir()):
        try:
            limits.append(parse_cpu_max(quota.read(str(child.relative_to(root)))).cores)
        except CgroupGone:
            continue
    through = None if not limits or None in limits else sum(c for c in limits if c is not None)
    rates = [r for r in (own, through) if r is not None]
    return min(rates) if rates else None


SCENARIOS: dict[str, Callable[[Node], object]] = {
    "kubelet_start": lambda n: n.owners.kubelet_start(),
    "qos_update": lambda n: n.owners.qos_update(),
    "pod_create": lambda n: n.owners.pod_create(Pod("new", (Container("app", 200, 400),))),
    "pod_delete": lambda n: n.owners.pod_delete(n.pods["web"]),
    "container_restart": lambda n: n.owners.container_restart(n.pods["batch"], "app"),
    "resize_up": lambda n: n.owners.resize(n.pods["batch"], n.pods["batch"].resized(app=(500, 2000))),
    "resize_down": lambda n: n.owners.resize(n.pods["batch"], n.pods["batch"].resized(app=(500, 1000))),
    "resize_below_hold": lambda n: n.owners.resize(n.pods["batch"], n.pods["batch"].resized(app=(100, 200))),
    "daemon_reload": lambda n: n.owners.daemon_reload(),
    "daemon_reload_children_first": lambda n: n.owners.daemon_reload(children_first=True),
}


def run(
    version: Version, scenario: str, ticks: int = TICKS, after: Callable[[Node], None] | None = None
) -> ScenarioResult:
    """One scenario on a fresh node with nodeguard's holds in place; ``after`` sees the node at the end."""
    driver: Driver = "systemd" if scenario.startswith("daemon_reload") else "cgroupfs"
    base = rc.v1_cpu_hierarchy().writable if version == "v1" else rc.v2_cpu_hierarchy().writable
    with rc.cgroups(base / rc.unique_name()) as [root], tempfile.TemporaryDirectory() as state:
        owners = Owners(root, version, driver=driver)
        try:
            node = Node(owners, pods(), Ledger(str(Path(state) / "ledger.json")),
                        levers.build(CgroupWriter(str(root)), version))  # fmt: skip
            owners.kubelet_start()
            for pod in node.pods.values():
                owners.pod_create(pod)
            assert not owners.failures and not owners.refused(), (owners.failures, owners.refused())
            hold(node)
            mark = len(owners.writes)
            SCENARIOS[scenario](node)
            result = ScenarioResult(scenario, version, holds_lost=holds_lost(node), holds_back_at=None)
            for i in range(1, ticks + 1):
                result.nodeguard_failures += tick(node)
                owners.check(tick=i)
                if result.holds_back_at is None and not holds_lost(node):
                    result.holds_back_at = 0 if not result.holds_lost else i
            mine = owners.writes[mark:]
            result.done, result.refused, result.overwritten = (counts(mine)[o.value] for o in Outcome)
            result.overwritten_at = {f"{owners.name_of(w.path)} {w.file}": w.tick or 0
                                     for w in mine if w.outcome is Outcome.OVERWRITTEN}  # fmt: skip
            result.refusals = [f"{w.owner} {owners.name_of(w.path)} {w.file}={w.value} {w.errno}"
                               for w in mine if w.outcome is Outcome.REFUSED]  # fmt: skip
            result.failures = [("fatal: " if f.fatal else "") + f"{f.owner}: {f.message}" for f in owners.failures]
            if after is not None:
                after(node)
            return result
        finally:
            owners.close()


def main(argv: list[str]) -> int:
    configure("error", json=False)  # nodeguard's own errors on stderr; its drift warnings are in the results
    version: Version = "v2" if argv[1:2] == ["v2"] else "v1"
    chosen = argv[2:] or list(SCENARIOS)
    results = [run(version, name) for name in chosen]
    for r in results:
        print(f"{r.version} {r.scenario:30} done {r.done:3} refused {r.refused} overwritten {r.overwritten:2}"
              f" holds lost {len(r.holds_lost)} back at tick {r.holds_back_at}"
              f"{'  REFUSED: ' + '; '.join(r.refusals) if r.refusals else ''}")  # fmt: skip
    print(json.dumps([asdict(r) for r in results]))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
