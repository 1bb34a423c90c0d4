"""The node's owners in the tests: kubelet, the container runtime and systemd, writing what they write, in their order.

``Owners(root, version)`` lays out and writes a node's cgroups under ``root`` (a
directory of the real v1 cpu hierarchy, or of a pure cgroup v2 mount) the way
kubelet (cgroupfs or systemd driver names), containerd + runc and systemd do,
through the real kernel files. Every write it makes is recorded as an
``OwnerWrite``: done, refused (with the errno's name), or, once ``check`` finds
the file holding another value, overwritten. A refusal the owner treats as an
error is also an ``OwnerFailure`` (``fatal`` where the owner exits on it).

What each scenario writes, and where that was read:

- kubelet's start (``kubelet_start``): ``pkg/kubelet/cm/container_manager_linux.go``
  ``setupNode`` creates the node-allocatable cgroup (``kubepods``) if missing with
  the allocatable CPU as shares (``node_container_manager_linux.go``
  ``createNodeAllocatableCgroups``, an error is fatal), starts the QoS manager
  (``qos_container_manager_linux.go`` ``qosContainerManagerImpl.Start``: BestEffort
  created or updated with ``MinShares`` 2, Burstable with an empty config, which
  writes no CPU file; an error is fatal: "failed to initialize top level QOS
  containers: failed to update top level BestEffort QOS cgroup : …"), whose
  ``wait.Until`` runs ``UpdateCgroups`` at once, then enforces node allocatable
  (``enforceNodeAllocatableCgroups``: ``kubepods``' shares updated, retried every
  minute on error). Go iterates the QoS map in random order: ``tiers`` picks it.
- the QoS update (``qos_update``, every minute and on pod add/delete):
  ``qosContainerManagerImpl.UpdateCgroups`` / ``setCPUCgroupConfig``: Burstable
  ``MilliCPUToShares`` of the sum of its pods' CPU requests, BestEffort 2, the
  Guaranteed root no CPU file; the first error ends the pass (logged, retried).
- a pod's creation (``pod_create``): ``kubelet.go`` ``SyncPod`` runs
  ``UpdateQOSCgroups`` (errors logged) and then ``pod_container_manager_linux.go``
  ``EnsureExists`` → ``cgroup_manager_linux.go`` ``cgroupCommon.Create`` (``Apply(-1)``,
  then ``Set``) with ``helpers_linux.go`` ``ResourceConfigForPod`` (shares from the
  requests; quota and period only when every container has a CPU limit, or
  Guaranteed; BestEffort 2 shares); then containerd's sandbox (``pkg/cri``
  ``WithDefaultSandboxShares``: ``DefaultSandboxCPUshares`` 2) and each container
  from ``kuberuntime_container_linux.go`` ``calculateLinuxResources`` (shares from
  the request, or the limit when no request; quota from the limit; period
  100000), written by runc (``libcontainer/process_linux.go`` ``initProcess.start``:
  ``Apply`` then ``Set``).
- a container restart (``container_restart``): runc removes the old container's
  cgroup and creates the new one with the same resources (a failed create
  destroys the cgroup again: ``p.manager.Destroy()``).
- a pod's deletion (``pod_delete``): the runtime removes the container and
  sandbox cgroups, ``killPod`` runs ``UpdateQOSCgroups`` (here without the pod, as
  the pass after it left), kubelet destroys the pod cgroup.
- an in-place resize (``resize``): ``kuberuntime_manager.go``
  ``computePodResizeAction`` (``markContainerForUpdate``: decreases before
  increases) and ``doPodResizeAction``: the pod's current CPU config read from
  the kernel (``GetPodCgroupConfig``; v2 converts ``cpu.weight`` back with
  ``cm/util`` ``CPUWeightToCPUShares``, which refuses 0, what an idle group
  reads), then ``resizeContainers``: pod limit if it grows, pod shares if they
  grow, the containers (``updatePodContainerResources`` → runc ``update``), pod
  shares if they shrink, pod limit if it shrinks; the first error aborts.
  ``SetPodCgroupConfig`` is ``cgroupCommon.SetCgroupConfig`` → ``Update`` with only
  the CPU fields given. Only CPU is resized here (memory goes first in kubelet).
- the systemd driver's ``daemon-reload`` (``daemon_reload``): systemd re-realizes
  every realized unit (``src/core/cgroup.c`` ``cgroup_context_apply``; reload
  invalidates realized units, systemd PR #19886, shown resetting a quota in
  systemd-stable #301). v2: ``cgroup_apply_unified_cpu_idle`` (``cpu.idle`` 0
  unless CPUWeight=idle), ``cgroup_apply_unified_cpu_weight`` (CPUWeight, default
  100), ``cgroup_apply_unified_cpu_quota`` (``cpu.max``, period clamped by
  ``cgroup_cpu_adjust_period``), ``memory.high`` (MemoryHigh, default max). v1:
  ``cgroup_apply_legacy_cpu_shares`` (CPUShares, default 1024) and
  ``cgroup_apply_legacy_cpu_quota`` (period, then quota). Errors are logged and
  ignored. The unit properties are those runc's systemd manager sets
  (``opencontainers/cgroups`` ``systemd/v1.go``, ``systemd/v2.go`` ``Set``;
  ``systemd/common.go`` ``addCPUQuota`` rounds a quota up to 10 ms a second and
  writes the rounded quota to the files too). The realize queue's order is not
  fixed (units are queued as they are deserialized): ``children_first`` picks it.

The files: runc's ``fs/cpu.go`` ``CpuGroup.Set`` on v1 (``cpu.shares``, read back
and compared; ``cpu.cfs_period_us``, an EINVAL deferred until after the quota
when a quota follows; ``cpu.cfs_quota_us``), ``fs2/cpu.go`` ``setCPU`` on v2
(``cpu.weight``, then ``cpu.max`` "quota period" or "max period"). kubelet's own
cgroups on v2 take ``cgroup_manager_linux.go`` ``getCPUWeight`` (linear), the
runtime's take ``utils.go`` ``ConvertCPUSharesToCgroupV2Value`` (quadratic since
opencontainers/cgroups v0.0.3, runc 1.3.2 and crun 1.23; ``runtime_weight="linear"``
for older runtimes). Not modelled: memory limits and swap, hugetlb, pids and
cpuset (no lever of nodeguard's writes them, and the kernel refuses none of
them because of a nodeguard hold), Memory QoS (off by default), and systemd's
own apply of the properties at each ``SetUnitProperties`` (call
``daemon_reload`` after a step to see that). Directory creation and
``cgroup.subtree_control`` are set-up, not counted writes.
"""

from __future__ import annotations

import contextlib
import errno
import math
import os
import uuid
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field, replace
from enum import StrEnum
from pathlib import Path
from typing import Literal

Version = Literal["v1", "v2"]
Driver = Literal["cgroupfs", "systemd"]

MIN_SHARES, MAX_SHARES, SHARES_PER_CPU = 2, 262144, 1024
QUOTA_PERIOD, MIN_QUOTA = 100000, 1000
SYSTEMD_DEFAULT_WEIGHT, SYSTEMD_DEFAULT_SHARES = 100, 1024
USEC_PER_SEC = 1_000_000
TIERS = ("burstable", "besteffort")
QOS_OF_TIER = {"burstable": "Burstable", "besteffort": "BestEffort"}
Weigh = Callable[[int], int]


class Outcome(StrEnum):
    DONE = "done"
    REFUSED = "refused"
    OVERWRITTEN = "overwritten"


@dataclass(frozen=True)
class OwnerWrite:
    """One write by an owner: ``path`` relative to ``Owners.root``; ``tick``: the check that found it overwritten."""

    owner: str  # kubelet, runtime, systemd
    action: str  # the scenario: kubelet_start, qos_update, pod_create, …
    path: str
    file: str
    value: str
    outcome: Outcome
    errno: str | None = None
    tick: int | None = None


@dataclass(frozen=True)
class OwnerFailure:
    """An error an owner reports (``fatal``: it exits), in its own words."""

    owner: str
    action: str
    message: str
    fatal: bool = False


# --- kubelet's and runc's conversions -------------------------------------------------------------------------


def milli_cpu_to_shares(milli: int) -> int:
    """kubelet's ``MilliCPUToShares``."""
    if milli == 0:
        return MIN_SHARES
    return min(max(milli * SHARES_PER_CPU // 1000, MIN_SHARES), MAX_SHARES)


def milli_cpu_to_quota(milli: int, period: int = QUOTA_PERIOD) -> int:
    """kubelet's ``MilliCPUToQuota``: 0 (no quota) for no limit, at least 1 ms."""
    if milli == 0:
        return 0
    return max(milli * period // 1000, MIN_QUOTA)


def kubelet_weight(shares: int) -> int:
    """kubelet's ``getCPUWeight``: shares [2, 262144] to cpu.weight [1, 10000], linearly."""
    if shares >= MAX_SHARES:
        return 10000
    return 1 + (shares - 2) * 9999 // 262142


def runc_weight(shares: int) -> int:
    """opencontainers/cgroups' ``ConvertCPUSharesToCgroupV2Value`` (quadratic in log2, through (2, 1), (1024, 100))."""
    if shares == 0:
        return 0
    if shares <= MIN_SHARES:
        return 1
    if shares >= MAX_SHARES:
        return 10000
    log = math.log2(shares)
    return math.ceil(10 ** ((log * log + 125 * log) / 612.0 - 7.0 / 34.0))


def weight_to_shares(weight: int) -> int:
    """kubelet's ``CPUWeightToCPUShares``; ValueError for a weight out of [1, 10000] (an idle group reads 0)."""
    if not 1 <= weight <= 10000:
        raise ValueError(f"CPU weight must be greater than zero and at most 10000, but equals to {weight}")
    return (weight - 1) * 262142 // 9999 + 2


# --- pods -----------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Container:
    """A container's resources: CPU in millicores, memory in bytes (memory only decides the QoS class here)."""

    name: str
    cpu_request: int | None = None
    cpu_limit: int | None = None
    memory_request: int | None = None
    memory_limit: int | None = None

    @property
    def requested_cpu(self) -> int:
        """The request, or the limit where only a limit is given (the API server's and kubelet's default)."""
        if self.cpu_request is not None:
            return self.cpu_request
        return self.cpu_limit or 0

    @property
    def requested_memory(self) -> int:
        return self.memory_request if self.memory_request is not None else self.memory_limit or 0


@dataclass(frozen=True)
class Pod:
    name: str
    containers: tuple[Container, ...]
    uid: str = field(default_factory=lambda: str(uuid.uuid4()))

    @property
    def qos(self) -> str:
        """``GetPodQOS``: Guaranteed, Burstable or BestEffort, from CPU and memory."""
        requests = [(c.requested_cpu, c.requested_memory) for c in self.containers]
        if all(cpu == 0 and memory == 0 for cpu, memory in requests):
            return "BestEffort"
        guaranteed = all(
            c.cpu_limit and c.memory_limit and c.requested_cpu == c.cpu_limit and c.requested_memory == c.memory_limit
            for c in self.containers
        )
        return "Guaranteed" if guaranteed else "Burstable"

    @property
    def cpu_requests(self) -> int:
        return sum(c.requested_cpu for c in self.containers)

    def resized(self, **limits: tuple[int | None, int | None]) -> Pod:
        """This pod with some containers' (request, limit) in millicores changed: ``resized(app=(500, 1000))``."""
        unknown = set(limits) - {c.name for c in self.containers}
        assert not unknown, f"no such container: {sorted(unknown)}"
        containers = tuple(
            replace(c, cpu_request=limits[c.name][0], cpu_limit=limits[c.name][1]) if c.name in limits else c
            for c in self.containers
        )
        return replace(self, containers=containers)


@dataclass(frozen=True)
class Resources:
    """The CPU part of libcontainer's ``Resources``: 0 is unset, as in Go; quota -1 is unlimited."""

    shares: int = 0
    quota: int = 0
    period: int = 0


def pod_resources(pod: Pod, period: int = QUOTA_PERIOD) -> Resources:
    """``ResourceConfigForPod`` (CFS quota enforced)."""
    if pod.qos == "BestEffort":
        return Resources(shares=MIN_SHARES)
    shares = milli_cpu_to_shares(pod.cpu_requests)
    limited = all(c.cpu_limit for c in pod.containers)
    if pod.qos == "Guaranteed" or limited:
        quota = milli_cpu_to_quota(sum(c.cpu_limit or 0 for c in pod.containers), period)
        return Resources(shares, quota, period)
    return Resources(shares)


def container_resources(container: Container, period: int = QUOTA_PERIOD) -> Resources:
    """``calculateLinuxResources`` as the runtime's spec gets it (quota 0: none)."""
    return Resources(milli_cpu_to_shares(container.requested_cpu), milli_cpu_to_quota(container.cpu_limit or 0, period),
                     period)  # fmt: skip


def quota_per_sec(resources: Resources) -> int | None:
    """runc's ``addCPUQuota``: CPUQuotaPerSecUSec, rounded up to 10 ms a second (None: infinity)."""
    if resources.quota <= 0:
        return None
    per_sec = resources.quota * USEC_PER_SEC // (resources.period or QUOTA_PERIOD)
    return per_sec if per_sec % 10000 == 0 else (per_sec // 10000 + 1) * 10000


@dataclass
class Unit:
    """A systemd unit's CPU properties as runc's systemd manager set them (None: never set)."""

    weight: int | None = None  # CPUWeight (v2)
    shares: int | None = None  # CPUShares (v1)
    quota_per_sec: int | None = None  # CPUQuotaPerSecUSec; None: infinity
    period: int | None = None  # CPUQuotaPeriodUSec
    cpu: bool = False  # any CPU property set: the unit's mask has the cpu controller


@dataclass
class PodState:
    pod: Pod
    sandbox: str
    containers: dict[str, str | None]  # name -> its cgroup's path; None while it does not run


class OwnerError(Exception):
    """An owner's step failed (its message is the owner's); ``errno``: the kernel's, where it refused a write."""

    def __init__(self, message: str, error: int | None = None) -> None:
        super().__init__(message)
        self.errno = error


def _error_name(exc: OSError) -> str:
    return errno.errorcode.get(exc.errno or 0, str(exc.errno))


class Owners:
    """kubelet, the runtime and systemd on one node under ``root``; see the module docstring."""

    def __init__(
        self,
        root: Path,
        version: Version,
        *,
        driver: Driver = "cgroupfs",
        allocatable_milli: int | None = None,
        runtime_weight: Literal["quadratic", "linear"] = "quadratic",
        period: int = QUOTA_PERIOD,
    ) -> None:
        self.root = root
        self.version: Version = version
        self.driver: Driver = driver
        self.allocatable_milli = allocatable_milli if allocatable_milli is not None else (os.cpu_count() or 1) * 1000
        self.runtime_weight: Weigh = runc_weight if runtime_weight == "quadratic" else kubelet_weight
        self.period = period
        self.pods: dict[str, PodState] = {}
        self.units: dict[str, Unit] = {}
        self.writes: list[OwnerWrite] = []
        self.failures: list[OwnerFailure] = []
        self.kubelet_running = False
        self._created: list[str] = []
        # Every cgroup's name as a pod spec would say it: kubepods, burstable, <pod>, <pod>/sandbox, <pod>/<container>.
        self.names = {self.kubepods: "kubepods", self.tier("Burstable"): "burstable",
                      self.tier("BestEffort"): "besteffort"}  # fmt: skip
        assert root.is_dir(), f"{root}: the node's cgroup root must exist"
        if version == "v2":
            self._enable_down_to(root)

    # --- where kubelet and the runtime put things ---------------------------------------------------------

    @property
    def kubepods(self) -> str:
        return "kubepods.slice" if self.driver == "systemd" else "kubepods"

    def tier(self, qos: str) -> str:
        """The cgroup of a QoS class's pods: the node-allocatable root for Guaranteed."""
        if qos == "Guaranteed":
            return self.kubepods
        name = qos.lower()
        return f"{self.kubepods}/kubepods-{name}.slice" if self.driver == "systemd" else f"{self.kubepods}/{name}"

    def pod_path(self, pod: Pod) -> str:
        if self.driver == "systemd":
            stem = Path(self.tier(pod.qos)).name.removesuffix(".slice")
            return f"{self.tier(pod.qos)}/{stem}-pod{pod.uid.replace('-', '_')}.slice"
        return f"{self.tier(pod.qos)}/pod{pod.uid}"

    def _container_path(self, pod: Pod) -> str:
        cid = uuid.uuid4().hex * 2
        name = f"cri-containerd-{cid}.scope" if self.driver == "systemd" else cid
        return f"{self.pod_path(pod)}/{name}"

    def container_path(self, pod: Pod, name: str) -> str | None:
        """The cgroup of a running container of a created pod (None while it does not run)."""
        return self.pods[pod.uid].containers[name]

    def name_of(self, path: str) -> str:
        """A cgroup's name as a pod spec says it (see ``names``); the path for any other."""
        return self.names.get(path, path)

    # --- scenarios ----------------------------------------------------------------------------------------

    def kubelet_start(self, tiers: Sequence[str] = TIERS) -> list[OwnerWrite]:
        """kubelet's start: node allocatable, the QoS tiers (an update refused is fatal: kubelet exits), the first
        QoS pass, node allocatable enforced."""
        mark, action = len(self.writes), "kubelet_start"
        allocatable = Resources(shares=milli_cpu_to_shares(self.allocatable_milli))
        if not (self.root / self.kubepods).is_dir():
            self._kubelet_create(action, self.kubepods, allocatable)
        for tier in tiers:
            name = self.tier(QOS_OF_TIER[tier])
            config = Resources(shares=MIN_SHARES) if tier == "besteffort" else Resources()
            if not (self.root / name).is_dir():
                self._kubelet_create(action, name, config)
                continue
            try:
                self._kubelet_set(action, name, config)
            except OwnerError as exc:
                self.kubelet_running = False
                self._fail("kubelet", action, "Failed to start ContainerManager: failed to initialize top level QOS "
                           f"containers: failed to update top level {QOS_OF_TIER[tier]} QOS cgroup : {exc}",
                           fatal=True)  # fmt: skip
                return self.writes[mark:]
        self.kubelet_running = True
        self._qos_pass(action, tiers)
        try:
            self._kubelet_set(action, self.kubepods, allocatable)
        except OwnerError as exc:
            self._fail("kubelet", action, f"Failed to update Node Allocatable Limits {self.kubepods!r}: {exc}")
        return self.writes[mark:]

    def qos_update(self, tiers: Sequence[str] = TIERS) -> list[OwnerWrite]:
        """kubelet's periodic QoS pass (also run on each pod add and delete)."""
        mark = len(self.writes)
        self._qos_pass("qos_update", tiers)
        return self.writes[mark:]

    def pod_create(self, pod: Pod) -> list[OwnerWrite]:
        """A pod's start: the QoS pass with it, its cgroup, the sandbox, then each container (runc)."""
        mark, action = len(self.writes), "pod_create"
        assert pod.uid not in self.pods, f"pod {pod.name} exists"
        if self._kubelet_down(action):
            return []
        self.pods[pod.uid] = PodState(pod, "", dict.fromkeys((c.name for c in pod.containers), None))
        self._qos_pass(action, TIERS)
        self.names[self.pod_path(pod)] = pod.name
        self._kubelet_create(action, self.pod_path(pod), pod_resources(pod, self.period))
        sandbox = self._container_path(pod)
        self.names[sandbox] = f"{pod.name}/sandbox"
        self.pods[pod.uid].sandbox = sandbox
        if not self._runtime_create(action, sandbox, Resources(shares=MIN_SHARES)):
            return self.writes[mark:]
        for container in pod.containers:
            self._start_container(action, pod, container)
        return self.writes[mark:]

    def container_restart(self, pod: Pod, name: str) -> list[OwnerWrite]:
        """The runtime replaces a container: its old cgroup goes, a new one gets the container's resources."""
        mark, action = len(self.writes), "container_restart"
        if self._kubelet_down(action):
            return []
        state = self.pods[pod.uid]
        old = state.containers[name]
        if old is not None:
            self._remove(old)
            state.containers[name] = None
        [container] = [c for c in state.pod.containers if c.name == name]
        self._start_container(action, state.pod, container)
        return self.writes[mark:]

    def pod_delete(self, pod: Pod) -> list[OwnerWrite]:
        """The pod's containers and sandbox go, the QoS pass without it, then its cgroup."""
        mark = len(self.writes)
        state = self.pods.pop(pod.uid)
        for path in [*state.containers.values(), state.sandbox]:
            if path:
                self._remove(path)
        self._qos_pass("pod_delete", TIERS)
        self._remove(self.pod_path(pod))
        return self.writes[mark:]

    def resize(self, pod: Pod, new: Pod) -> list[OwnerWrite]:
        """An in-place resize of the pod's CPU, in kubelet's order for each direction; aborted at the first error."""
        mark, action = len(self.writes), "resize"
        if self._kubelet_down(action):
            return []
        state = self.pods[pod.uid]
        assert new.uid == pod.uid and new.qos == state.pod.qos, "a resize keeps the pod and its QoS class"
        old = {c.name: c for c in state.pod.containers}
        updates: list[Container] = []
        for container in new.containers:
            was = old[container.name]
            now_limit, was_limit = container.cpu_limit or 0, was.cpu_limit or 0
            desired, current = (now_limit, was_limit) if now_limit != was_limit else (container.requested_cpu,
                                                                                      was.requested_cpu)  # fmt: skip
            if desired > current:
                updates.append(container)
            elif desired < current:
                updates.insert(0, container)  # markContainerForUpdate prepends decreases
        if not updates:
            return []
        path = self.pod_path(pod)
        try:
            current_quota, current_shares = self._pod_cpu_config(path)
            wanted = pod_resources(new, self.period)
            quota = wanted.quota if wanted.period else current_quota  # no pod limit declared: the current one kept
            limit = Resources(quota=quota, period=wanted.period or self.period)
            shares = Resources(shares=wanted.shares)
            if quota > current_quota:
                self._kubelet_set(action, path, limit)
            if wanted.shares > current_shares:
                self._kubelet_set(action, path, shares)
            state.pod = new
            for container in updates:
                target = state.containers[container.name]
                if target is not None:
                    self._runtime_set(action, target, container_resources(container, self.period))
            if wanted.shares < current_shares:
                self._kubelet_set(action, path, shares)
            if quota < current_quota:
                self._kubelet_set(action, path, limit)
        except OwnerError as exc:
            self._fail("kubelet", action, f"resize of pod {pod.name} failed: {exc}")
        return self.writes[mark:]

    def daemon_reload(self, children_first: bool = False) -> list[OwnerWrite]:
        """systemd re-applies every unit's properties (systemd driver only; nothing otherwise)."""
        mark = len(self.writes)
        if self.driver != "systemd":
            return []
        paths = sorted((p for p in self.units if (self.root / p).is_dir()), key=lambda p: p.count("/"),
                       reverse=children_first)  # fmt: skip
        for path in paths:
            self._systemd_apply(path, self.units[path])
        return self.writes[mark:]

    # --- what became of the writes ------------------------------------------------------------------------

    def check(self, tick: int | None = None) -> list[OwnerWrite]:
        """Mark every write still the owners' last to its file but no longer in it as overwritten; those marked."""
        last: dict[tuple[str, str], int] = {}
        for i, write in enumerate(self.writes):
            if write.outcome is not Outcome.REFUSED:
                last[(write.path, write.file)] = i
        found = []
        for i in last.values():
            write = self.writes[i]
            if write.outcome is not Outcome.DONE:
                continue
            try:
                now = (self.root / write.path / write.file).read_text().strip()
            except OSError:
                continue  # its group left
            if now != write.value:
                self.writes[i] = replace(write, outcome=Outcome.OVERWRITTEN, tick=tick)
                found.append(self.writes[i])
        return found

    def summary(self) -> dict[str, Counter[str]]:
        """Writes per scenario and outcome."""
        found: dict[str, Counter[str]] = {}
        for write in self.writes:
            found.setdefault(write.action, Counter())[write.outcome.value] += 1
        return found

    def refused(self) -> list[OwnerWrite]:
        return [w for w in self.writes if w.outcome is Outcome.REFUSED]

    def close(self) -> None:
        """Remove every cgroup the owners created (deepest first)."""
        for path in sorted(self._created, key=lambda p: -p.count("/")):
            self._remove(path)

    # --- kubelet's and runc's writes ----------------------------------------------------------------------

    def _kubelet_down(self, action: str) -> bool:
        """kubelet drives pods, restarts and resizes: none of them while it is not running (a failed start)."""
        if not self.kubelet_running:
            self._fail("kubelet", action, "kubelet is not running")
        return not self.kubelet_running

    def _qos_pass(self, action: str, tiers: Sequence[str]) -> None:
        if not self.kubelet_running:
            return
        burstable = sum(s.pod.cpu_requests for s in self.pods.values() if s.pod.qos == "Burstable")
        configs = {"burstable": Resources(shares=milli_cpu_to_shares(burstable)),
                   "besteffort": Resources(shares=MIN_SHARES)}  # fmt: skip
        for tier in tiers:
            try:
                self._kubelet_set(action, self.tier(QOS_OF_TIER[tier]), configs[tier])
            except OwnerError as exc:
                self._fail("kubelet", action, f"Failed to update QoS cgroup configuration: {exc}")
                return

    def _start_container(self, action: str, pod: Pod, container: Container) -> None:
        path = self._container_path(pod)
        self.names[path] = f"{pod.name}/{container.name}"
        if self._runtime_create(action, path, container_resources(container, self.period)):
            self.pods[pod.uid].containers[container.name] = path

    def _runtime_create(self, action: str, path: str, resources: Resources) -> bool:
        """runc's create: the cgroup (Apply), the resources (Set); a failure destroys the cgroup again."""
        self._mkdir(path)
        try:
            self._runtime_set(action, path, resources)
        except OwnerError as exc:
            self._remove(path)
            self._fail("runtime", action, f"failed to create containerd task: runc create failed: {exc}")
            return False
        return True

    def _kubelet_create(self, action: str, path: str, resources: Resources) -> None:
        """``cgroupCommon.Create``: the cgroup (``Apply(-1)``), then ``Set``, whose error kubelet only logs."""
        self._mkdir(path)
        try:
            self._kubelet_set(action, path, resources)
        except OwnerError as exc:
            self._fail("kubelet", action, f"cgroup manager.Set failed: {exc}")

    def _kubelet_set(self, action: str, path: str, resources: Resources) -> None:
        self._set("kubelet", action, path, resources, kubelet_weight)

    def _runtime_set(self, action: str, path: str, resources: Resources) -> None:
        self._set("runtime", action, path, resources, self.runtime_weight)

    def _set(self, owner: str, action: str, path: str, resources: Resources, weight_of: Weigh) -> None:
        """libcontainer's ``Set`` for the cpu controller (systemd driver: the unit's properties first)."""
        if self.driver == "systemd":
            resources = self._set_unit(path, resources, weight_of)
        if self.version == "v2":
            if resources.shares:
                self._write(owner, action, path, "cpu.weight", str(weight_of(resources.shares)))
            if resources.quota or resources.period:
                quota = str(resources.quota) if resources.quota > 0 else "max"
                self._write(owner, action, path, "cpu.max", f"{quota} {resources.period or QUOTA_PERIOD}")
            return
        if resources.shares:
            self._write(owner, action, path, "cpu.shares", str(resources.shares))
            read = int((self.root / path / "cpu.shares").read_text())
            if read != resources.shares:
                which = "maximum" if resources.shares > read else "minimum"
                raise OwnerError(f"the {which} allowed cpu-shares is {read}")
        deferred = False
        if resources.period:
            try:
                self._write(owner, action, path, "cpu.cfs_period_us", str(resources.period))
            except OwnerError as exc:
                if exc.errno != errno.EINVAL or not resources.quota:
                    raise
                deferred = True  # runc retries the period after the quota
        if resources.quota:
            self._write(owner, action, path, "cpu.cfs_quota_us", str(resources.quota))
            if deferred:
                self._write(owner, action, path, "cpu.cfs_period_us", str(resources.period))

    def _set_unit(self, path: str, resources: Resources, weight_of: Weigh) -> Resources:
        """Record the properties runc's systemd manager sets; the resources with the quota systemd rounds to."""
        unit = self.units.setdefault(path, Unit())
        if resources.shares:
            unit.cpu = True
            if self.version == "v2":
                unit.weight = weight_of(resources.shares)
            else:
                unit.shares = resources.shares
        if resources.quota or resources.period:
            unit.cpu = True
            if resources.period:
                unit.period = resources.period
            unit.quota_per_sec = quota_per_sec(resources)
            if unit.quota_per_sec is not None:
                period = resources.period or QUOTA_PERIOD
                return replace(resources, quota=unit.quota_per_sec * period // USEC_PER_SEC)
        return resources

    def _pod_cpu_config(self, path: str) -> tuple[int, int]:
        """``GetPodCgroupConfig``: the pod's (quota, shares) as the kernel has them (quota -1: unlimited)."""
        group = self.root / path
        try:
            if self.version == "v1":
                return int((group / "cpu.cfs_quota_us").read_text()), int((group / "cpu.shares").read_text())
            quota_text = (group / "cpu.max").read_text().split()[0]
            weight = int((group / "cpu.weight").read_text())
        except OSError as exc:
            raise OwnerError(f"GetPodCgroupConfig for CPU failed: {exc}") from None
        try:
            shares = weight_to_shares(weight)
        except ValueError as exc:
            raise OwnerError(f"GetPodCgroupConfig for CPU failed: failed to convert cgroup v1 CPU weight {weight} to "
                             f"v2 CPU shares: {exc}") from None  # fmt: skip
        return (-1 if quota_text == "max" else int(quota_text)), shares

    # --- systemd ------------------------------------------------------------------------------------------

    def _systemd_apply(self, path: str, unit: Unit) -> None:
        """``cgroup_context_apply`` for one unit: errors are logged and ignored."""
        action = "daemon_reload"
        group = self.root / path
        writes: list[tuple[str, str]] = []
        if unit.cpu:
            period = QUOTA_PERIOD
            if unit.quota_per_sec is not None:
                # cgroup_cpu_adjust_period: at least 1 ms (and 1 ms of quota), at most 1 s
                wanted = unit.period or QUOTA_PERIOD
                period = min(max(wanted, 1000, 1000 * USEC_PER_SEC // unit.quota_per_sec), USEC_PER_SEC)
            quota = None if unit.quota_per_sec is None else max(unit.quota_per_sec * period // USEC_PER_SEC, 1000)
            if self.version == "v2":
                if (group / "cpu.idle").exists():
                    writes.append(("cpu.idle", "0"))
                writes.append(("cpu.weight", str(unit.weight or SYSTEMD_DEFAULT_WEIGHT)))
                writes.append(("cpu.max", f"{'max' if quota is None else quota} {period}"))
            else:
                writes.append(("cpu.shares", str(unit.shares or SYSTEMD_DEFAULT_SHARES)))
                writes.append(("cpu.cfs_period_us", str(period)))
                writes.append(("cpu.cfs_quota_us", "-1" if quota is None else str(quota)))
        if self.version == "v2" and (group / "memory.high").exists():
            writes.append(("memory.high", "max"))
        for name, value in writes:
            try:
                self._write("systemd", action, path, name, value)
            except OwnerError as exc:
                self._fail("systemd", action, f"Failed to set '{name}' attribute on '{path}' to '{value}': {exc}")

    # --- the files ----------------------------------------------------------------------------------------

    def _write(self, owner: str, action: str, path: str, name: str, value: str) -> None:
        """One write to a kernel file, recorded; OwnerError(strerror, errno) when the kernel refuses it."""
        try:
            fd = os.open(self.root / path / name, os.O_WRONLY | os.O_TRUNC | os.O_CLOEXEC)
            try:
                os.write(fd, value.encode())
            finally:
                os.close(fd)
        except OSError as exc:
            self.writes.append(OwnerWrite(owner, action, path, name, value, Outcome.REFUSED, _error_name(exc)))
            raise OwnerError(f"{name}: {exc.strerror.lower() if exc.strerror else exc}", exc.errno) from None
        self.writes.append(OwnerWrite(owner, action, path, name, value, Outcome.DONE))

    def _fail(self, owner: str, action: str, message: str, fatal: bool = False) -> None:
        self.failures.append(OwnerFailure(owner, action, message, fatal))

    def _mkdir(self, path: str) -> None:
        """Create the cgroup and its parents; on v2 with the cpu and memory controllers enabled down to it, as runc's
        ``fs2.CreateCgroupPath`` does (set-up, not counted)."""
        parts = Path(path).parts
        for depth in range(len(parts)):
            rel = "/".join(parts[: depth + 1])
            group = self.root / rel
            if self.version == "v2":
                self._enable_controllers(group.parent)
            if not group.is_dir():
                group.mkdir()
                self._created.append(rel)
            if self.driver == "systemd" and rel.endswith((".slice", ".scope")):
                self.units.setdefault(rel, Unit())

    def _enable_down_to(self, group: Path) -> None:
        """cpu and memory enabled from the hierarchy's root down to ``group``'s children (set-up, not counted)."""
        for parent in [p for p in reversed(group.parents) if (p / "cgroup.controllers").exists()]:
            self._enable_controllers(parent)

    def _enable_controllers(self, parent: Path) -> None:
        available = set((parent / "cgroup.controllers").read_text().split())
        enabled = set((parent / "cgroup.subtree_control").read_text().split())
        wanted = sorted({"cpu", "memory"} & available - enabled)
        if wanted:
            (parent / "cgroup.subtree_control").write_text(" ".join(f"+{c}" for c in wanted))

    def _remove(self, path: str) -> None:
        """rmdir the cgroup and what the owners created below it, deepest first (a container's cgroup leaving)."""
        below = sorted((p for p in self._created if p == path or p.startswith(path + "/")), key=lambda p: -p.count("/"))
        for rel in below or [path]:
            with contextlib.suppress(FileNotFoundError):
                (self.root / rel).rmdir()
            if rel in self._created:
                self._created.remove(rel)
            self.units.pop(rel, None)


def counts(writes: Iterable[OwnerWrite]) -> dict[str, int]:
    """done / refused / overwritten of some writes."""
    found = Counter(w.outcome.value for w in writes)
    return {outcome.value: found[outcome.value] for outcome in Outcome}
