"""The shipped ConfigMap's config, run as the DaemonSet runs it, on a kubelet-shaped node with kube-system's pods.

The daemon is ``nodeguard run`` on the exact ``config.json`` of
``packaging/kubernetes/configmap.yaml``: only its paths are mapped onto this
test (the cgroup root, the ledger, the gate socket, the state directory, the
MQTT password file, the listen address; the service account's token and CA,
which the in-cluster defaults name), as a diff of the two documents proves.
It reaches the fake API server (tests/kubernetes/conftest.py, the real wire
format, TLS, bearer token) the way a pod does: ``KUBERNETES_SERVICE_HOST`` /
``_PORT``, ``NODE_NAME`` and ``NODEGUARD_POD_UID`` from the environment.

The node, on this host's cgroup v1 (cpu, cpuacct and memory hierarchies),
laid out as kubelet lays it out with real processes: kube-system's CNI agent
(Burstable, ``system-node-critical``) and CoreDNS (Burstable,
``system-cluster-critical``), nodeguard's own pod and a broker beside it in the
``nodeguard`` namespace, batch pods burning CPU (one BestEffort behind a
PodDisruptionBudget) and a Guaranteed web pod that the burners stall.

One input is imitated: node memory past the ConfigMap's 92 % eviction line
cannot be made on a shared machine, so the daemon alone reads a
``/proc/meminfo`` saying 95 % (bind-mounted in a mount namespace of its own);
everything it acts on is real. The test stands in for kubelet: a pod whose
eviction the API accepted has its processes killed and its cgroups removed.
"""

from __future__ import annotations

import contextlib
import json
import re
import signal
import subprocess
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import yaml

from nodeguard.kubernetes.settings import SERVICE_ACCOUNT_DIR
from nodeguard.model.samples import CpuMax
from tests.containers.runtime import wait_for_the_node
from tests.kubernetes.conftest import Canned, FakeKube, Pki
from tests.kubernetes.objects import NODE, budget_refusal, node, pod
from tests.support import cgroups as rc
from tests.support.daemon import DaemonProcess
from tests.support.ports import free_port
from tests.support.workloads import start_duty_cycle

REPO = Path(__file__).resolve().parents[2]
CONFIGMAP = REPO / "packaging" / "kubernetes" / "configmap.yaml"
POOL = "node.kubernetes.io/pool"
# The ConfigMap's own eviction line is 92 %: the daemon's meminfo says 95 % of this host's memory is in use.
MEMORY_IN_USE = 0.95
BIND_MEMINFO = ["unshare", "--mount", "--propagation", "private", "--",
                "sh", "-c", 'mount --bind "$0" /proc/meminfo && exec "$@"']  # fmt: skip


def shipped_config() -> dict[str, Any]:
    return dict(json.loads(yaml.safe_load(CONFIGMAP.read_text())["data"]["config.json"]))


def mapped(config: dict[str, Any], paths: dict[tuple[str, ...], Any]) -> dict[str, Any]:
    """The config with the value at each JSON path replaced (missing objects on the way are made)."""
    out: dict[str, Any] = json.loads(json.dumps(config))
    for path, value in paths.items():
        where = out
        for key in path[:-1]:
            where = where.setdefault(key, {})
        where[path[-1]] = value
    return out


def differences(a: Any, b: Any, path: tuple[str, ...] = ()) -> set[tuple[str, ...]]:
    """The JSON paths of the values where two documents differ (a missing object counts as an empty one)."""
    if isinstance(a, dict | None) and isinstance(b, dict | None) and (a, b) != (None, None):
        a, b = a or {}, b or {}
        return {p for key in a.keys() | b.keys() for p in differences(a.get(key), b.get(key), (*path, key))}
    return set() if a == b else {path}


@dataclass
class Pod:
    """One pod of the node: its API object and its cgroups, the processes in them, its files' originals."""

    name: str
    namespace: str
    cgroups: rc.KubeletPod
    obj: dict[str, Any]
    procs: list[subprocess.Popen[bytes]] = field(default_factory=list)
    originals: dict[str, tuple[CpuMax, int]] = field(default_factory=dict)

    @property
    def key(self) -> str:
        return f"{self.namespace}/{self.name}"

    @property
    def dirs(self) -> list[str]:
        return [self.cgroups.pod, self.cgroups.container]

    def files(self) -> dict[str, tuple[CpuMax, int]]:
        """The CPU limit and weight of the pod and its container, as the kernel has them now."""
        h = self.cgroups.hierarchy
        return {rel: (h.limit(rel), h.weight(rel)) for rel in self.dirs}


@dataclass
class KubeletNode:
    hierarchy: rc.Hierarchy
    parent: str
    pods: dict[str, Pod]
    own_uid: str

    def __getitem__(self, name: str) -> Pod:
        return self.pods[name]

    def api_objects(self) -> list[dict[str, Any]]:
        return [p.obj for p in self.pods.values()]


def uid_of(cgroups: rc.KubeletPod) -> str:
    return cgroups.pod.rsplit("/pod", 1)[1]


@pytest.fixture
def kubelet(tmp_path: Path) -> Iterator[KubeletNode]:
    """The node: kube-system's pods, nodeguard's own and a broker beside it, batch pods and a Guaranteed one."""
    reason = rc.why_no_v1_cpu()
    memory = rc.v1_hierarchy("memory")
    if reason or memory is None:
        pytest.skip(reason or "this host has no cgroup v1 memory hierarchy (the eviction line reads it)")
    cpu, cpuacct = rc.v1_hierarchy("cpu"), rc.v1_hierarchy("cpuacct")
    assert cpu is not None and cpuacct is not None
    hierarchy = rc.Hierarchy("v1", list(dict.fromkeys([cpu, cpuacct, memory])))
    parent = rc.unique_name()
    # name: namespace, tier, CPU limit, what runs in it, and the pod object's fields
    shapes: dict[str, tuple[str, str | None, CpuMax | None, float | None, dict[str, Any]]] = {
        "calico-node-4xkq2": ("kube-system", "burstable", None, 0.05,
                              {"priority_class": "system-node-critical", "priority": 2_000_001_000}),
        "coredns-7db6d8ff4d-x2v9q": ("kube-system", "burstable", None, 0.05,
                                     {"priority_class": "system-cluster-critical", "priority": 2_000_000_000}),
        "nodeguard-x7k2p": ("nodeguard", "burstable", None, None, {}),
        "mqtt-0": ("nodeguard", "burstable", None, 0.2, {}),
        "train-0": ("batch", "burstable", None, 1.0, {"labels": {"app": "train"}}),
        "train-1": ("batch", "burstable", None, 1.0, {"labels": {"app": "train"}}),
        "train-2": ("batch", "burstable", None, 1.0, {"labels": {"app": "train"}}),
        "etl-0": ("batch", "besteffort", None, 1.0, {"labels": {"app": "etl"}, "cpu_requests": (None,),
                                                     "memory_request": None}),
        "web-0": ("prod", None, CpuMax(50_000), 0.3, {"cpu_limits": ("500m",)}),
    }  # fmt: skip
    with contextlib.ExitStack() as stack:
        pods: dict[str, Pod] = {}
        for name, (namespace, tier, limit, _, fields) in shapes.items():
            cgroups = stack.enter_context(rc.kubelet_pod(hierarchy, parent, tier, limit))
            qos = {"burstable": "Burstable", "besteffort": "BestEffort", None: "Guaranteed"}[tier]
            obj = pod(name, uid_of(cgroups), namespace=namespace, qos=qos, **fields)
            pods[name] = Pod(name, namespace, cgroups, obj)
        for p in pods.values():
            p.originals = p.files()
        stack.callback(stop_all, pods)
        for name, (_, _, _, runs, _) in shapes.items():
            if runs is None:
                continue
            where = hierarchy.dirs(pods[name].cgroups.inner)
            pods[name].procs.append(
                rc.start_shell_busy(*where) if runs >= 1.0 else start_duty_cycle(runs, *where, announce=True)
            )
        rc.wait_started([proc for p in pods.values() for proc in p.procs], 30)
        yield KubeletNode(hierarchy, parent, pods, uid_of(pods["nodeguard-x7k2p"].cgroups))


def stop_all(pods: dict[str, Pod]) -> None:
    for p in pods.values():
        for proc in p.procs:
            if proc.poll() is None:
                rc.stop(proc)


def fake_meminfo(path: Path) -> Path:
    """This host's /proc/meminfo with MemFree and MemAvailable cut to leave MEMORY_IN_USE of it in use."""
    lines = Path("/proc/meminfo").read_text().splitlines()
    total = next(int(line.split()[1]) for line in lines if line.startswith("MemTotal:"))
    left = int(total * (1 - MEMORY_IN_USE))
    out = [re.sub(r"\d+", str(left), line, count=1) if line.startswith(("MemFree:", "MemAvailable:")) else line
           for line in lines]  # fmt: skip
    path.write_text("\n".join(out) + "\n")
    return path


def on_this_host(
    tmp_path: Path, kubelet: KubeletNode, pki: Pki, token: Path, listen: str
) -> tuple[dict[str, Any], set[tuple[str, ...]]]:
    """The ConfigMap's config with its paths mapped onto this test; and the JSON paths mapped."""
    run = tmp_path / "run"
    run.mkdir()
    paths: dict[tuple[str, ...], Any] = {
        ("global", "sensing", "cgroupRoot"): str(rc.CGROUP_ROOT),
        # The ConfigMap lets discovery search for kubelet's kubepods; this node's is below the test's own parent,
        # and a search would find other runs' beside it on a shared machine.
        ("global", "sensing", "kubepodsPaths"): [f"{kubelet.parent}/kubepods"],
        ("global", "actuation", "ledgerPath"): str(run / "ledger.json"),
        ("global", "http", "listen"): listen,
        ("global", "gate", "socket"): str(run / "gate.sock"),
        ("global", "coordination", "stateDir"): str(run),
        ("global", "coordination", "broker", "passwordFile"): str(tmp_path / "mqtt-password"),
        # The in-cluster defaults (the service account's files), which the ConfigMap leaves to the pod.
        ("global", "kubernetes", "tokenPath"): str(token),
        ("global", "kubernetes", "caPath"): str(pki.ca_path),
    }
    return mapped(shipped_config(), paths), set(paths)


class Watch:
    """What the test sees while the daemon runs: any change to the pods it must not touch, and kubelet's part
    (a pod whose eviction the API accepted terminates: its processes killed, its cgroups and object removed)."""

    def __init__(self, kubelet: KubeletNode, kube: FakeKube, untouchable: list[str]) -> None:
        self.kubelet, self.kube, self.untouchable = kubelet, kube, untouchable
        self.touched: list[str] = []
        self.evicted: list[str] = []

    def __call__(self) -> None:
        for name in self.untouchable:
            p = self.kubelet[name]
            now = p.files()
            if now != p.originals:
                self.touched.append(f"{p.key}: {p.originals} -> {now}")
        for key in evictions(self.kube):
            refused = key in self.kube.evictions and self.kube.evictions[key].status >= 300
            name = key.split("/", 1)[1]
            if not refused and name not in self.evicted:
                self.evicted.append(name)
                self.terminate(self.kubelet[name])

    def terminate(self, p: Pod) -> None:
        for proc in p.procs:
            rc.stop(proc)
        for root in self.kubelet.hierarchy.roots:
            rc.remove_cgroup(root / p.cgroups.pod)
        with self.kube.lock:
            self.kube.pods = [o for o in self.kube.pods if o["metadata"]["name"] != p.name]


def evictions(kube: FakeKube) -> list[str]:
    """The pods an eviction was asked for, in order, as namespace/name."""
    found = [re.fullmatch(r"/api/v1/namespaces/([^/]+)/pods/([^/]+)/eviction", s.path) for s in kube.requests("POST")]
    return [f"{m.group(1)}/{m.group(2)}" for m in found if m is not None]


RUNNING, BUSY = "nodeguard running", "not starting: refusing to act beside another nodeguard"


def start_on_the_node(daemon: DaemonProcess, root: Path, env: dict[str, str], tries: int = 10) -> DaemonProcess:
    """The daemon started once it holds the node: on a shared machine another run's daemon may act on it for a
    while, and a daemon started beside it refuses to run (then it is started again, up to ``tries`` times)."""
    for _ in range(tries):
        wait_for_the_node(root)
        daemon.start(env)
        if running(daemon):
            return daemon
        daemon.wait(10)
        daemon = daemon.successor()
    raise AssertionError(f"the node stayed busy through {tries} starts")


def running(daemon: DaemonProcess) -> bool:
    """Whether the daemon started acting (False: it found the node held by another and stopped)."""

    def said() -> set[str]:
        return {str(e.get("event")) for e in daemon.events()} & {RUNNING, BUSY}

    daemon.wait_for(lambda: bool(said()), 30, "the daemon's start")
    return RUNNING in said()


def status(listen: str) -> dict[str, Any]:
    with urllib.request.urlopen(f"http://{listen}/status", timeout=5) as response:
        return dict(json.loads(response.read()))


def held_back(daemon: DaemonProcess) -> list[dict[str, Any]]:
    """The lever changes the daemon made that hold a group back (its log), dry runs left out."""
    return [e for e in daemon.events() if e.get("event") in ("throttle", "memory_throttle")
            or (e.get("event") == "reweigh" and not str(e.get("reason")).startswith("weight back"))]  # fmt: skip


def covers(group: str, workload: str) -> bool:
    return workload == group or workload.startswith(group + "/")


def test_the_configmap_guards_a_kubelet_node_and_never_touches_kube_system(
    tmp_path: Path, kube: FakeKube, pki: Pki, token_file: Path, kubelet: KubeletNode
) -> None:
    """On the shipped config: the node's pool label (from the API) makes it a dry run, and a reload after the
    label changes makes it act; kube-system's pods, nodeguard's own and its namespace's are never throttled,
    lowered or evicted; the batch pods are; evictions go through the Eviction API, where a
    PodDisruptionBudget's 429 holds its pod (alive, not asked again) and the next candidate is evicted."""
    listen = f"127.0.0.1:{free_port()}"
    config, mapped_paths = on_this_host(tmp_path, kubelet, pki, token_file, listen)
    assert differences(shipped_config(), config) == mapped_paths, "only the paths are mapped"
    kube.pods = kubelet.api_objects()
    kube.nodes[NODE] = node(labels={POOL: "batch"})
    kube.evictions["batch/etl-0"] = Canned(429, budget_refusal("etl-0", "batch"))
    untouchable = ["calico-node-4xkq2", "coredns-7db6d8ff4d-x2v9q", "nodeguard-x7k2p", "mqtt-0"]
    watch = Watch(kubelet, kube, untouchable)
    env = {"KUBERNETES_SERVICE_HOST": "127.0.0.1", "KUBERNETES_SERVICE_PORT": kube.url.rsplit(":", 1)[1],
           "NODE_NAME": NODE, "NODEGUARD_POD_UID": kubelet.own_uid}  # fmt: skip
    daemon = DaemonProcess(config, tmp_path, wrapper=[*BIND_MEMINFO, str(fake_meminfo(tmp_path / "meminfo"))])
    etl = kubelet["etl-0"].cgroups.pod
    daemon = start_on_the_node(daemon, kubelet.hierarchy.writable, env)
    try:

        def seen(event: str, **fields: Any) -> bool:
            watch()
            return any(e.get("event") == event and all(e.get(k) == v for k, v in fields.items())
                       for e in daemon.events())  # fmt: skip

        # The pool=batch rule (perNode, from the Node's labels in the API): a dry run.
        daemon.wait_for(lambda: seen("dry run: would evict", workload=etl), 30, "a dry-run eviction of etl-0")
        assert evictions(kube) == [] and not any(p.files() != p.originals for p in kubelet.pods.values())
        chosen = {(g["role"], g["rule"]): g["count"] for g in status(listen)["plan"]["selection"]}
        assert chosen[("protected", "priority class system-node-critical")] == 1
        assert chosen[("protected", "priority class system-cluster-critical")] == 1
        assert chosen[("protected", "nodeguard itself")] == 1
        assert chosen[("exempt", "guard.exempt.ownNamespace: nodeguard")] == 1
        assert chosen[("candidate", "guard.candidates: class Burstable")] == 3  # the train pods

        # The node leaves the batch pool; a reload reads its labels again: the guard acts.
        kube.nodes[NODE] = node(labels={POOL: "general"})
        daemon.signal(signal.SIGHUP)
        daemon.wait_for(lambda: seen("config reloaded"), 15, "the reload")
        daemon.wait_for(lambda: seen("eviction refused by a disruption budget", pod="batch/etl-0"), 30,
                        "etl-0's eviction refused by its budget")  # fmt: skip
        daemon.wait_for(lambda: seen("evicting through the API") and bool(watch.evicted), 60,
                        "the next candidate evicted through the API")  # fmt: skip
        daemon.wait_for(lambda: seen("nodeguard running") and bool(held_back(daemon)), 30, "a batch pod held back")
        watch()
        assert evictions(kube)[0] == "batch/etl-0" and evictions(kube).count("batch/etl-0") == 1
        assert watch.evicted[0].startswith("train-"), watch.evicted
        assert all(proc.poll() is None for proc in kubelet["etl-0"].procs), "the budget held etl-0: still running"
        assert (kubelet.hierarchy.writable / etl).is_dir()
        recorded = [s.body for s in kube.requests("POST") if s.path.endswith("/events") and isinstance(s.body, dict)]
        assert any(b.get("involvedObject", {}).get("name") == watch.evicted[0] for b in recorded), "an Event"
        assert not [b for b in recorded if b.get("involvedObject", {}).get("namespace") in ("kube-system", "nodeguard")]
        spared = [kubelet[name].cgroups.pod for name in untouchable]
        batch = {p.cgroups.pod for p in kubelet.pods.values() if p.namespace == "batch"}
        for change in held_back(daemon):
            group = str(change.get("workload") or change.get("group"))
            assert not any(covers(group, pod) for pod in spared), f"holds back a pod it must not: {change}"
            assert group in batch or set(change.get("workloads") or ()) <= batch, change
        assert not [e for e in daemon.events() if e.get("event") == "evicting"], "no eviction by the cgroup"
        assert not watch.touched, watch.touched

        daemon.signal(signal.SIGTERM)
        assert daemon.wait(timeout=15) == 0
        left = {p.key for p in kubelet.pods.values() if p.name not in watch.evicted and p.files() != p.originals}
        assert not left, f"not restored on exit: {left}"
    finally:
        daemon.kill()


def test_the_service_account_paths_mapped_are_the_in_cluster_defaults() -> None:
    """The token and CA the e2e maps are the ones a pod's service account mounts, the settings' defaults."""
    from nodeguard.kubernetes.settings import KubernetesSettings

    settings = KubernetesSettings.model_validate(shipped_config()["global"]["kubernetes"])
    assert (settings.token_path, settings.ca_path) == (f"{SERVICE_ACCOUNT_DIR}/token", f"{SERVICE_ACCOUNT_DIR}/ca.crt")
    assert settings.enabled
