"""Multi-tick planner scenarios on a simulated node, recorded as decision traces.

Each scenario drives ``plan()`` tick after tick: a small node model turns the
limits the last plan set (read back from its trace, so the model does not
depend on the plan's Python types) into the next snapshot, and the plan's
state goes on to the next tick. ``test_trace_corpus`` compares the traces with
the ones recorded in ``data/trace_corpus.json``: a refactoring of the planner
must leave every decision as it was.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from nodeguard.model.samples import CpuMax
from nodeguard.model.snapshot import WorkloadUsage
from nodeguard.model.workloads import QosClass
from nodeguard.policy.planner import plan
from nodeguard.policy.settings import GuardSettings
from nodeguard.policy.state import GuardState
from nodeguard.policy.trace import plan_to_data
from tests.policy.builders import GiB, MiB, cpu_throttle, guard, snapshot, usage

RECORDED = Path(__file__).parent / "data" / "trace_corpus.json"


@dataclass
class Sim:
    """A workload of the simulated node: what it wants, and the limits nodeguard set on it."""

    wid: str
    demand: float  # cores it would use without a limit
    qos: QosClass = QosClass.BEST_EFFORT
    priority: int = 0
    quota: float | None = None  # cores, None: unlimited
    memory: int = 512 * MiB
    memory_high: float = math.inf
    request: float | None = None
    memory_stall: float | None = None
    protected: bool = False


@dataclass
class Node:
    workloads: list[Sim]
    cpus: int = 8
    memory_total: int = 16 * GiB
    load: float = 1.0
    lowered: set[str] = field(default_factory=set)  # groups whose weight is down
    waits: dict[str, float] = field(default_factory=dict)  # a workload's wait this tick, cores (scripted)

    def usages(self) -> list[WorkloadUsage]:
        out = []
        for sim in self.workloads:
            limit = math.inf if sim.quota is None else sim.quota
            cores = min(sim.demand, limit)
            waiting = self.waits.get(sim.wid, max(0.0, sim.demand - cores) if sim.demand > cores else 0.0)
            period = 100_000
            cpu_max = CpuMax(None if sim.quota is None else round(sim.quota * period), period)
            u = usage(sim.wid, qos=sim.qos, priority=sim.priority, cores=cores, cpu_max=cpu_max,
                      memory=sim.memory, request=sim.request, waiting=waiting, protected=sim.protected)  # fmt: skip
            out.append(u._replace(memory_high=sim.memory_high, memory_stall_pct=sim.memory_stall))
        return out

    def cores_used(self) -> float:
        return min(float(self.cpus), sum(u.cores or 0.0 for u in self.usages()))

    def memory_used(self) -> int:
        return sum(min(s.memory, int(s.memory_high) if s.memory_high != math.inf else s.memory) for s in self.workloads)

    def apply(self, data: dict[str, Any]) -> None:
        """What the plan's trace says was set: quotas, memory.high, evictions, weights."""
        by_id = {s.wid: s for s in self.workloads}
        for action in data["actions"]:
            if action["dry_run"]:
                continue
            sim = by_id.get(action["workload"]["id"])
            if sim is None:
                continue
            if "quota" in action:
                quota = action["quota"]
                sim.quota = None if quota["quota_us"] is None else quota["quota_us"] / quota["period_us"]
            elif "memory_high" in action:
                high = action["memory_high"]
                sim.memory_high = math.inf if high == "max" else float(high)
                sim.memory = min(sim.memory, int(sim.memory_high)) if high != "max" else sim.memory
            elif action["kind"] == "evict":
                self.workloads.remove(sim)
        for reweigh in data["reweighs"]:
            if not reweigh["dry_run"]:
                (self.lowered.add if reweigh["lower"] else self.lowered.discard)(reweigh["group"])


Step = Callable[[Node, int], dict[str, Any]]  # may change the node before the tick; snapshot keyword overrides


def run(node: Node, settings: GuardSettings, ticks: int, step: Step | None = None) -> list[dict[str, Any]]:
    state = GuardState()
    traces = []
    for tick in range(ticks):
        extra = step(node, tick) if step is not None else {}
        node_args: dict[str, Any] = {
            "cpus": node.cpus,
            "cores_used": node.cores_used(),
            "memory_total": node.memory_total,
            "memory_used": node.memory_used(),
            "load1": node.load,
            **extra,
        }
        snap = snapshot(node.usages(), monotonic=100.0 + tick, **node_args)
        p = plan(snap, state, settings)
        data = json.loads(json.dumps(plan_to_data(p), allow_nan=False))
        traces.append(data)
        node.apply(data)
        state = p.state
    return traces


def batch(n: int, demand: float, qos: QosClass = QosClass.BEST_EFFORT, prefix: str = "w") -> list[Sim]:
    return [Sim(f"{prefix}{i}", demand, qos=qos, priority=-i) for i in range(n)]


# --- the scenarios ---------------------------------------------------------------------------------------------


def cpu_waterline() -> list[dict[str, Any]]:
    """Throttle precisely past 6 cores, then restore step by step once the batch calms down."""
    node = Node(
        [*batch(6, 1.4), Sim("g", 0.5, qos=QosClass.GUARANTEED, quota=1.0), *batch(2, 0.6, QosClass.BURSTABLE, "b")]
    )

    def step(n: Node, tick: int) -> dict[str, Any]:
        if tick == 8:
            for sim in n.workloads:
                sim.demand = min(sim.demand, 0.4)
        return {}

    settings = guard(cpu_throttle(6.0, 5.0), minChangePercent=1, restoreStepPercent=10)
    return run(node, settings, 24, step)


def cpu_margin_and_refill() -> list[dict[str, Any]]:
    """A margin under the waterline, starved work, and the dead-band's room given back to it."""
    node = Node(batch(8, 1.2))

    def step(n: Node, tick: int) -> dict[str, Any]:
        if tick == 5:
            for sim in n.workloads[:3]:
                sim.demand = 0.2
        return {}

    settings = GuardSettings.model_validate({"objectives": [cpu_throttle(7.0, 4.0)], "targetMarginPercent": 3})
    return run(node, settings, 16, step)


def closed_loop_load() -> list[dict[str, Any]]:
    """load_average is not quantified: one workload a step, a cool-down, then restores one at a time."""
    node = Node(batch(5, 1.0), load=20.0)

    def step(n: Node, tick: int) -> dict[str, Any]:
        n.load = 20.0 if tick < 9 else 0.5
        return {}

    objective = {"metric": "load_average", "threshold": 2, "restoreBelow": 1, "action": "throttle",
                 "triggerAfter": 2, "restoreAfter": 2}  # fmt: skip
    return run(node, guard(objective, cooldownTicks=2), 22, step)


def evict_memory() -> list[dict[str, Any]]:
    """Memory past an evict line: the fewest workloads, the budget, pending evictions, one that outlives its
    timeout."""
    node = Node([Sim(f"m{i}", 0.2, priority=-i, memory=(3 + i) * GiB) for i in range(4)])
    stuck: set[str] = set()
    leave = node.apply

    def apply(data: dict[str, Any]) -> None:
        """The first workload asked to leave never does (its eviction outlives the timeout); the others go."""
        evicted = [a["workload"]["id"] for a in data["actions"] if a["kind"] == "evict"]
        if evicted and not stuck:
            stuck.add(evicted[0])
        kept = [s for s in node.workloads if s.wid in stuck]
        leave(data)
        node.workloads.extend(s for s in kept if s not in node.workloads)

    node.apply = apply  # type: ignore[method-assign]
    objective = {"metric": "memory_total_usage", "threshold": "10Gi", "action": "evict", "triggerAfter": 1}
    settings = guard(objective, evictions={"maxPerTick": 1, "minIntervalSeconds": 1, "terminationTimeoutSeconds": 3})
    return run(node, settings, 10)


def memory_high() -> list[dict[str, Any]]:
    """A memory throttle line on cgroup v2: memory.high comes down on the candidates, then goes back up."""
    node = Node([Sim(f"m{i}", 0.2, priority=-i, memory=3 * GiB, memory_high=math.inf) for i in range(4)])

    def step(n: Node, tick: int) -> dict[str, Any]:
        if tick == 6:
            for sim in n.workloads:
                sim.memory = 1 * GiB
        return {}

    objective = {"metric": "memory_total_usage", "threshold": "10Gi", "restoreBelow": "8Gi", "action": "throttle",
                 "triggerAfter": 1, "restoreAfter": 1}  # fmt: skip
    return run(node, guard(objective), 20, step)


def memory_stall() -> list[dict[str, Any]]:
    """protected_memory_stall: every candidate's memory.high a step down, a cool-down, and back once calm."""
    protected = Sim("kp/podg", 0.3, qos=QosClass.GUARANTEED, memory=1 * GiB, memory_high=math.inf, memory_stall=12.0)
    node = Node([*(Sim(f"kp/besteffort/pod{i}", 0.2, priority=-i, memory=2 * GiB) for i in range(3)), protected])

    def step(n: Node, tick: int) -> dict[str, Any]:
        protected.memory_stall = 12.0 if tick < 6 else 0.0
        return {}

    objective = {"metric": "protected_memory_stall", "threshold": "5%", "restoreBelow": "1%", "action": "throttle",
                 "triggerAfter": 1, "restoreAfter": 1}  # fmt: skip
    return run(node, guard(objective, cooldownTicks=1), 18, step)


def _kubelet(stalls: list[float]) -> tuple[Node, Step]:
    burners = [
        Sim(f"kp/{tier}/pod{i}", 1.0, qos=QosClass.BURSTABLE if tier == "burstable" else QosClass.BEST_EFFORT,
            priority=-i)
        for i, tier in enumerate(["burstable", "burstable", "besteffort", "besteffort"])
    ]  # fmt: skip
    important = Sim("kp/podg", 0.4, qos=QosClass.GUARANTEED, quota=0.5)
    node = Node([*burners, important], cpus=2)

    def step(n: Node, tick: int) -> dict[str, Any]:
        share = stalls[min(tick, len(stalls) - 1)]
        n.waits = {"kp/podg": share, **{s.wid: (0.0 if tick >= len(stalls) - 6 else 0.5) for s in burners}}
        return {"cores_used": min(2.0, n.cores_used())}

    return node, step


def protect_weights_then_quotas() -> list[dict[str, Any]]:
    """The weight lever first, the streak, quotas on trial, a futile verdict, and the weights back when calm."""
    stalls = [0.2, 0.2, 0.18, 0.18, 0.18, 0.18, 0.18, 0.17, 0.17, 0.17, 0.17, 0.17, 0.17, 0.17, 0.17,
              0.004, 0.004, 0.004, 0.004, 0.004, 0.004, 0.004, 0.004, 0.004, 0.004]  # fmt: skip
    node, step = _kubelet(stalls)
    objective = {"metric": "protected_cpu_stall", "threshold": "5%", "restoreBelow": "1%", "action": "throttle",
                 "triggerAfter": 1, "restoreAfter": 1}  # fmt: skip
    settings = guard(objective, minQuotaCores=0.05,
                     protect={"weightHoldSeconds": 3, "trialTicks": 3, "quotaOffSeconds": 4, "quietTicks": 2})  # fmt: skip
    return run(node, settings, len(stalls) + 4, step)


def protect_draining() -> list[dict[str, Any]]:
    """Weights that cut the stall make quotas wait while it drains."""
    stalls = [0.3, 0.06, 0.06, 0.06, 0.06, 0.06, 0.005, 0.005, 0.005, 0.005, 0.005]
    node, step = _kubelet(stalls)
    objective = {"metric": "protected_cpu_stall", "threshold": "5%", "restoreBelow": "1%", "action": "throttle",
                 "triggerAfter": 1, "restoreAfter": 1}  # fmt: skip
    settings = guard(objective, minQuotaCores=0.05, protect={"weightHoldSeconds": 2, "quietTicks": 1})
    return run(node, settings, len(stalls) + 3, step)


def protect_quota_lever() -> list[dict[str, Any]]:
    """guard.protectLever "quota": quotas at once, a cool-down between steps, restores when calm."""
    stalls = [0.2, 0.2, 0.2, 0.1, 0.003, 0.003, 0.003, 0.003, 0.003, 0.003, 0.003, 0.003]
    node, step = _kubelet(stalls)
    objective = {"metric": "protected_cpu_stall", "threshold": "5%", "restoreBelow": "1%", "action": "throttle",
                 "triggerAfter": 1, "restoreAfter": 1}  # fmt: skip
    return run(node, guard(objective, minQuotaCores=0.05, protectLever="quota"), len(stalls), step)


def dry_runs() -> list[dict[str, Any]]:
    """A dry-run objective beside a real one, and a guard-wide dry run: logged actions, nothing held."""
    node = Node(batch(8, 1.0))
    line = cpu_throttle(6.0, 5.0, dryRun=True)
    evict = {"metric": "cpu_total_usage", "threshold": 7.5, "action": "evict", "triggerAfter": 1, "dryRun": True}
    traces = run(node, guard(line, evict), 4)
    return traces + run(Node(batch(8, 1.0)), guard(cpu_throttle(6.0, 5.0), dryRun=True), 3)


def departed() -> list[dict[str, Any]]:
    """A throttled workload that leaves the node is departed: dropped from the state."""
    node = Node(batch(8, 1.0))

    def step(n: Node, tick: int) -> dict[str, Any]:
        if tick == 3:
            n.workloads = [s for s in n.workloads if s.quota is None] + [s for s in n.workloads if s.quota][1:]
        return {}

    return run(node, guard(cpu_throttle(6.0, 5.0)), 6, step)


SCENARIOS: dict[str, Callable[[], list[dict[str, Any]]]] = {
    fn.__name__: fn
    for fn in (
        cpu_waterline,
        cpu_margin_and_refill,
        closed_loop_load,
        evict_memory,
        memory_high,
        memory_stall,
        protect_weights_then_quotas,
        protect_draining,
        protect_quota_lever,
        dry_runs,
        departed,
    )
}


def traces() -> Iterator[tuple[str, list[dict[str, Any]]]]:
    for name, scenario in SCENARIOS.items():
        yield name, scenario()


def record() -> None:
    """Write the corpus (``python -m tests.policy.trace_corpus``): only when a change of decisions is intended."""
    RECORDED.write_text(json.dumps(dict(traces()), indent=1, sort_keys=True) + "\n")


if __name__ == "__main__":
    record()
