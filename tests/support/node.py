"""The e2e tests' node: workloads in real cgroups under a unique parent, the processes in them, every limit's and
weight's original, and the daemon config that watches them.

Three shapes: ``kubelet_node`` lays pods out as kubelet does (pod, sandbox and
container cgroups under ``<parent>/kubepods[/tier]``, limits at the pod and the
container level, weights at every level), ``protected_node`` is that with six
unlimited burners beside a Guaranteed pod at equal weights (``protect_config``
guards its stall), ``plain_node`` is a plain Linux host's groups side by side,
classified by the config's ``workloads.groups``. tests/integration's
``hierarchy`` fixture runs a test on this host's cgroup v1 and, marked
``kernel``, on cgroup v2 inside the QEMU VM.
"""

from __future__ import annotations

import contextlib
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from nodeguard.model.samples import CpuMax
from nodeguard.sources.procfs import parse_proc_stat_cpu
from nodeguard.sources.readers import count_cpus
from tests.kernel.vm import IN_VM
from tests.support import cgroups as rc
from tests.support.workloads import start_duty_cycle

TICK = 0.5
SLOW = 8.0 if IN_VM else 1.0  # emulated CPUs: every wait longer
BURNERS = 6
UNLIMITED = CpuMax(None)
GUARANTEED_LIMIT = CpuMax(50000)
POD_LIMIT = CpuMax(150000)  # a burner pod's: 1.5 cores, at the pod and at its container
# The protected node: every pod at kubelet's weight for equal requests, the Guaranteed pod a sleeper.
SHARES = 512  # kubelet: the pod's request (or limit) × 1024; equal here
STALL_THRESHOLD = 5.0  # % of a tick the protected pod may wait to run
SLEEPER_SHARE = 0.3  # of each 100 ms window: wakes, works, sleeps


@dataclass
class ShapedNode:
    """One test's node; ``important`` is the Guaranteed (protected) workload, ``burners`` the batch work."""

    hierarchy: rc.Hierarchy
    parent: str
    burners: list[rc.KubeletPod]
    important: rc.KubeletPod
    sensing: dict[str, Any]  # how discovery finds these workloads
    workloads: dict[str, Any] = field(default_factory=dict)  # the config's workloads section, if any
    procs: list[subprocess.Popen[bytes]] = field(default_factory=list)  # every process started in its groups
    burning: list[subprocess.Popen[bytes]] = field(default_factory=list)  # the burners' processes among them
    originals: dict[str, CpuMax] = field(default_factory=dict)
    weights: dict[str, int] = field(default_factory=dict)

    def every_dir(self) -> list[str]:
        dirs = {
            rel for pod in [*self.burners, self.important] for rel in (pod.pod, pod.sandbox, pod.container, pod.inner)
        }
        return sorted(dirs)

    def tiers(self) -> list[str]:
        tiers = [f"{self.parent}/kubepods/{tier}" for tier in ("burstable", "besteffort")]
        return [t for t in [*tiers, f"{self.parent}/kubepods"] if (self.hierarchy.writable / t).is_dir()]

    def record_originals(self) -> None:
        self.originals = {rel: self.hierarchy.limit(rel) for rel in self.every_dir()}
        self.weights = {rel: self.hierarchy.weight(rel) for rel in [*self.every_dir(), *self.tiers()]}

    def changed(self) -> set[str]:
        """Every group whose limit or weight is not at its original."""
        limits = {rel for rel, limit in self.originals.items() if self.hierarchy.limit(rel) != limit}
        return limits | {rel for rel, w in self.weights.items() if self.hierarchy.weight(rel) != w}

    def throttled(self) -> set[str]:
        """The burners' pods held below their original limit: by their own limit, or (a v1 pod whose container
        has a limit of its own above the hold) through their containers."""
        return {pod.pod for pod in self.burners if self.held_below(pod.pod)}

    def held_below(self, pod: str) -> bool:
        """Whether the rate in force for the pod is under its original limit."""
        rate, original = self.hierarchy.held_rate(pod), self.originals[pod].cores
        return rate is not None and (original is None or rate < original - 1e-9)

    def start(
        self, burners: int = BURNERS, important_share: float = 0.3, burner_shares: list[float] | None = None
    ) -> None:
        """The important workload wakes for ``important_share`` of each 100 ms; burners spin (or run duty cycles).

        Returns once every one of them runs its loop (in the emulated VM their interpreters take seconds to start).
        """
        important = start_duty_cycle(important_share, *self.hierarchy.dirs(self.important.inner), announce=True)
        self.procs.append(important)
        pods = self.burners[:burners]
        if burner_shares is None:
            rc.wait_started([important], 30 * SLOW)  # its interpreter up first, before six shell loops take the CPUs
            started = [rc.start_shell_busy(*self.hierarchy.dirs(pod.inner), announce=True) for pod in pods]
            awaited = started
        else:
            started = [start_duty_cycle(burner_shares[i], *self.hierarchy.dirs(pod.inner), announce=True)
                       for i, pod in enumerate(pods)]  # fmt: skip
            awaited = [important, *started]
        self.procs += started
        self.burning += started
        rc.wait_started(awaited, 30 * SLOW)

    def start_burners(self) -> None:
        """One CPU-burning process in every burner pod, the important workload left as it is."""
        started = [pod.start_busy() for pod in self.burners]
        self.procs += started
        self.burning += started

    def stop_burners(self) -> None:
        """Every burner's process stopped, the burner pods left empty; the important workload keeps running."""
        for proc in self.burning:
            if proc.poll() is None:
                rc.stop(proc)
        self.burning.clear()
        left = {pod.inner: tasks for pod in self.burners if (tasks := self.tasks(pod.inner))}
        assert not left, f"processes still in burner pods: {left}"

    def tasks(self, rel: str) -> list[int]:
        """The pids in the group ``rel`` (its directory in the writable hierarchy)."""
        return [int(pid) for pid in (self.hierarchy.writable / rel / "cgroup.procs").read_text().split()]

    def stop_all(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                rc.stop(proc)

    def config(self, ledger: Path, objectives: list[dict[str, Any]], **guard: Any) -> dict[str, Any]:
        """``nodeguard run``'s config for this node: the objectives, guard settings, the ledger; no HTTP, no gate.

        No API server runs here: a kubelet-shaped node's pods have no metadata, and the config says explicitly
        that they may be acted on anyway (``guard.candidates.podsWithoutMetadata``)."""
        if "kubepodsPaths" in self.sensing:
            guard["candidates"] = {"podsWithoutMetadata": True, **guard.get("candidates", {})}
        return {
            "global": {
                "sensing": {"cgroupRoot": str(rc.CGROUP_ROOT), "cgroupVersion": self.hierarchy.version,
                            "tickSeconds": TICK, **self.sensing},
                **({"workloads": self.workloads} if self.workloads else {}),
                "guard": {"objectives": objectives, **guard},
                "actuation": {"ledgerPath": str(ledger)},
                "http": {"enabled": False},
                "gate": {"enabled": False},
            }
        }  # fmt: skip


@contextlib.contextmanager
def kubelet_node(
    hierarchy: rc.Hierarchy,
    burner_limit: CpuMax | None,
    important_limit: CpuMax,
    shares: int | None = None,
    burners: int = BURNERS,
) -> Iterator[ShapedNode]:
    """Burstable burners (``burner_limit`` at pod and container) and a Guaranteed pod, as kubelet lays them out;
    ``shares``: every pod's ``cpu.shares`` (the Burstable tier's is their sum), else the kernel's defaults."""
    parent = rc.unique_name()
    with contextlib.ExitStack() as stack:
        pods = [
            stack.enter_context(rc.kubelet_pod(hierarchy, parent, "burstable", burner_limit)) for _ in range(burners)
        ]
        important = stack.enter_context(rc.kubelet_pod(hierarchy, parent, None, important_limit))
        if shares is not None:
            for pod in [*pods, important]:
                hierarchy.set_shares(pod.pod, shares)
            hierarchy.set_shares(f"{parent}/kubepods/burstable", shares * len(pods))
        node = ShapedNode(hierarchy, parent, pods, important, {"kubepodsPaths": [f"{parent}/kubepods"]})
        node.record_originals()
        try:
            yield node
        finally:
            node.stop_all()


@contextlib.contextmanager
def plain_node(hierarchy: rc.Hierarchy, burners: int = BURNERS) -> Iterator[ShapedNode]:
    """A plain host's groups side by side: ``important`` (Guaranteed, protected) and ``be-N`` (BestEffort), no
    limits; each group is its own workload (its processes run in it)."""
    parent = rc.unique_name()
    names = ["important", *[f"be-{i}" for i in range(burners)]]
    groups = {name: rc.KubeletPod(hierarchy, *[f"{parent}/{name}"] * 4) for name in names}
    with hierarchy.groups(*[f"{parent}/{name}" for name in names]):
        node = ShapedNode(
            hierarchy, parent, [groups[n] for n in names[1:]], groups["important"], {"kubepods": False},
            workloads={"groups": [
                {"match": f"{parent}/be-*", "class": "BestEffort"},
                {"match": f"{parent}/important", "class": "Guaranteed", "priority": 1000, "protected": True},
            ]},
        )  # fmt: skip
        node.record_originals()
        try:
            yield node
        finally:
            node.stop_all()


@contextlib.contextmanager
def protected_node(hierarchy: rc.Hierarchy, important_limit: CpuMax = GUARANTEED_LIMIT) -> Iterator[ShapedNode]:
    """Six Burstable burners without limits beside a Guaranteed pod, every pod at kubelet's weight for equal
    requests."""
    with kubelet_node(hierarchy, None, important_limit, shares=SHARES) as shaped:
        yield shaped


def protect_config(node: ShapedNode, ledger: Path, **guard: Any) -> dict[str, Any]:
    """A daemon guarding the Guaranteed pod's stall, with short cool-downs and a short weight hold."""
    objective = {"metric": "protected_cpu_stall", "action": "throttle", "threshold": f"{STALL_THRESHOLD}%",
                 "restoreBelow": "1%", "triggerAfter": 2, "restoreAfter": 2}  # fmt: skip
    settings = {"restoreStepPercent": 50, "cooldownTicks": 2, "weightHoldSeconds": 3, **guard}
    return node.config(ledger, [objective], **settings)


def node_cores(seconds: float) -> float:
    """The cores this whole machine kept busy over the next ``seconds`` (a measurement window)."""

    def read() -> tuple[int, int]:
        cpu = parse_proc_stat_cpu(Path("/proc/stat").read_text())
        return cpu.busy, cpu.total

    busy0, total0 = read()
    time.sleep(seconds)  # the measured window
    busy1, total1 = read()
    return (busy1 - busy0) / (total1 - total0) * count_cpus(Path("/proc/stat").read_text())


def waterline_config(node: ShapedNode, ledger: Path, threshold: float) -> dict[str, Any]:
    """A node waterline on cpu_total_usage at ``threshold`` cores for a kubelet-shaped node: discovery finds the
    pods as kubelet laid them out (the class from the tier, Guaranteed pods at the top)."""
    objective = {"metric": "cpu_total_usage", "action": "throttle", "triggerAfter": 2, "restoreAfter": 2,
                 "threshold": round(threshold, 3), "restoreBelow": round(threshold - 0.5, 3)}  # fmt: skip
    return node.config(ledger, [objective], restoreStepPercent=25, targetMarginPercent=4)


def waterline(node_cpus: int) -> float:
    """70 % of the node, or higher where the machine's own work would not leave the burners a gap to make."""
    baseline = node_cores(1.0)
    return max(0.7 * node_cpus, min(baseline + 0.8, node_cpus - 0.4))
