"""The start gate's init container in a pod, for real: podman runs the init container of
packaging/kubernetes/gate-pod-snippet.yaml (nodeguard's image, as the snippet's user and with its restrictions, the
node's /run/nodeguard bind-mounted as its hostPath volume) before the pod's app, against nodeguard daemons on the host
that share the snippet's cluster semaphore through the shipped broker (packaging/kubernetes/broker/, as
tests/packaging/test_broker.py runs it) with the ConfigMap's gate and coordination settings.

A podman pod stands in for the Kubernetes pod: its init container (``--init-ctr``) runs to completion before the
pod's other containers start, and one that fails keeps them from starting (``podman pod start`` fails), as kubelet
does with a pod's initContainers. The init container's command is the snippet's, its ``$(VAR)`` references expanded
from its env as kubelet does. What cannot be the same without a cluster: the pod runs on the host's network, so its
IP (the downward API's ``status.podIP``) is 127.0.0.1 and the app's port a free one, and the app is a busybox server
(``gated/server.sh``) that records when it starts and when the gate's probe first reached it.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import subprocess
import time
import urllib.request
import uuid
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit, urlunsplit

import pytest
import yaml

from tests.containers.pods import GATED, read_records
from tests.containers.runtime import REPO, Podman, ulimit_args
from tests.packaging.shipped_broker import ShippedBroker, coordination_section, started_broker
from tests.support.gate import Gate, wait_until
from tests.support.ports import free_port

SNIPPET = REPO / "packaging" / "kubernetes" / "gate-pod-snippet.yaml"
CONFIGMAP = REPO / "packaging" / "kubernetes" / "configmap.yaml"
NAMESPACE = "default"
POD_IP = "127.0.0.1"
# Local limits out of the way: the cluster cap is what binds.
LOCAL_LIMITS = {"maxStarting": 8, "maxStartingPerCore": None}
START = 90  # seconds for a pod's containers to start and its admission to be seen, on a busy machine


def snippet() -> dict[str, Any]:
    (pod,) = [doc for doc in yaml.safe_load_all(SNIPPET.read_text()) if doc]
    return dict(pod)


def shipped_config() -> dict[str, Any]:
    (configmap,) = [doc for doc in yaml.safe_load_all(CONFIGMAP.read_text()) if doc]
    return dict(json.loads(configmap["data"]["config.json"])["global"])


def kubelet_expand(text: str, env: dict[str, str]) -> str:
    """``$(VAR)`` replaced from the container's env as kubelet does (``$$`` is a ``$``; an unknown name stays)."""
    return re.sub(r"\$\$|\$\((\w+)\)", lambda m: "$" if m[0] == "$$" else env.get(m[1], m[0]), text)


def init_container() -> dict[str, Any]:
    (init,) = snippet()["spec"]["initContainers"]
    return dict(init)


def option(command: Sequence[str], name: str) -> str:
    (value,) = [arg.split("=", 1)[1] for arg in command if arg.startswith(f"{name}=")]
    return value


def gate_mount() -> tuple[str, str]:
    """The init container's mount of the host's gate directory: (mountPath, the hostPath volume's path)."""
    pod = snippet()
    volumes = {v["name"]: v for v in pod["spec"]["volumes"]}
    (mount,) = init_container()["volumeMounts"]
    return mount["mountPath"], volumes[mount["name"]]["hostPath"]["path"]


def snippet_semaphore() -> str:
    return option(init_container()["command"], "--semaphore")


class Node:
    """``nodeguard run`` on the host as one node: the ConfigMap's gate section (its socket in this node's stand-in for
    the host's /run/nodeguard) and, given a broker, its coordination section turned on, as this node."""

    def __init__(self, name: str, home: Path, broker: ShippedBroker | None, caps: dict[str, int]) -> None:
        config = shipped_config()
        assert Path(config["gate"]["socket"]).parent == Path(gate_mount()[1])
        self.name = name
        self.gate_dir = home / "host-run-nodeguard"  # what the pod's hostPath volume is on this node
        self.gate_dir.mkdir(parents=True)
        gate = {key: value for key, value in config["gate"].items() if key != "socket"}
        self.gate = Gate(home, {**gate, **LOCAL_LIMITS}, socket_dir=self.gate_dir)
        assert Path(self.gate.socket).name == Path(config["gate"]["socket"]).name
        self.http = f"127.0.0.1:{free_port()}"
        self.gate.config["global"]["http"] = {"listen": self.http}
        if broker is not None:
            coordination = coordination_section(broker, home)
            self.gate.config["global"]["coordination"] = {**coordination, "nodeName": name, "semaphores": caps}
        self.gate.daemon.config_path.write_text(json.dumps(self.gate.config))

    def coordination(self) -> dict[str, Any]:
        with urllib.request.urlopen(f"http://{self.http}/status", timeout=5) as response:
            return dict(json.loads(response.read())["coordination"])

    def admitting(self) -> bool:
        try:
            return bool(self.coordination()["admitting"])
        except OSError:  # its HTTP server is not up yet
            return False


@contextlib.contextmanager
def nodes(
    tmp_path: Path, broker: ShippedBroker | None, names: Sequence[str], caps: dict[str, int]
) -> Iterator[list[Node]]:
    started = [Node(name, tmp_path / name, broker, caps) for name in names]
    try:
        for node in started:
            node.gate.start(wait=False)
        for node in started:
            node.gate.wait_answering()
        if broker is not None:
            for node in started:
                wait_until(node.admitting, 30, f"{node.name} admitting")
        yield started
    finally:
        for node in started:
            node.gate.stop()


@dataclass
class Pod:
    name: str  # metadata.name
    podman_name: str
    init: str  # the init container's podman name
    app: str
    start: subprocess.Popen[str]  # ``podman pod start``: returns once the init container is done and the app started

    @property
    def load(self) -> str:
        """The gate load's name, as the snippet's --name makes it."""
        return f"{NAMESPACE}.{self.name}"


class Pods:
    """podman pods of the snippet's shape: its init container, then an app (busybox server) on the host's network."""

    def __init__(self, podman: Podman, nodeguard_image: str, app_image: str, tmp_path: Path) -> None:
        self.podman = podman
        self.nodeguard_image = nodeguard_image
        self.app_image = app_image
        self.records = tmp_path / "records"
        self.control = tmp_path / "control"  # an app whose DELAY is a file here serves once the test creates it
        self.records.mkdir()
        self.control.mkdir()
        self.prefix = f"ngtest-{os.getpid()}-{uuid.uuid4().hex[:6]}"
        self.created: list[str] = []  # podman's pod names
        self.launches: list[subprocess.Popen[str]] = []

    def init_command(self, pod: str, port: int, extra: Sequence[str]) -> list[str]:
        """The snippet's init command for this pod: its env from the downward API, the probe at the app's port."""
        init = init_container()
        fields = {"metadata.name": pod, "metadata.namespace": NAMESPACE, "status.podIP": POD_IP}
        env = {e["name"]: e.get("value") or fields[e["valueFrom"]["fieldRef"]["fieldPath"]] for e in init["env"]}
        command = [kubelet_expand(arg, env) for arg in [*init["command"], *init.get("args", [])]]
        url = urlsplit(option(command, "--ready-http"))
        assert url.hostname == POD_IP, url
        probe = urlunsplit((url.scheme, f"{POD_IP}:{port}", "/cgi-bin/ready", "", ""))  # the test server's page
        return [f"--ready-http={probe}" if arg.startswith("--ready-http=") else arg for arg in command] + list(extra)

    def init_options(self, gate_dir: Path) -> list[str]:
        """podman's options for what the snippet asks of the init container: user, restrictions, memory, volume."""
        init = init_container()
        security = init["securityContext"]
        assert security["runAsNonRoot"] and security["runAsUser"] != 0
        assert security["allowPrivilegeEscalation"] is False and security["readOnlyRootFilesystem"] is True
        assert security["capabilities"] == {"drop": ["ALL"]}
        memory = init["resources"]["limits"]["memory"]
        assert memory.endswith("Mi"), memory
        mount_path, _ = gate_mount()
        return [
            "--user", f"{security['runAsUser']}:{security['runAsGroup']}",
            "--read-only", "--cap-drop", "all", "--security-opt", "no-new-privileges",
            "--memory", f"{memory.removesuffix('Mi')}m",
            "--network", "none",  # it needs only the socket
            "--volume", f"{gate_dir}:{mount_path}",
        ]  # fmt: skip

    def start(self, name: str, gate_dir: Path, *, serve: str = "0", init_args: Sequence[str] = ()) -> Pod:
        """Create the pod and ``podman pod start`` it in the background. ``serve``: the app's DELAY (seconds, or
        ``"told"``: once :meth:`tell` is called)."""
        podman_name = f"{self.prefix}-{name}"
        init, app = f"{podman_name}-nodeguard-admit", f"{podman_name}-app"
        self.created.append(podman_name)
        self.podman("pod", "create", "--name", podman_name, "--infra=false")  # no pause image here, none needed
        port = free_port()
        command = self.init_command(name, port, init_args)
        self.podman(
            "create", "--pod", podman_name, "--init-ctr", "always", "--name", init, *ulimit_args(),
            *self.init_options(gate_dir), "--entrypoint", command[0], self.nodeguard_image, *command[1:],
        )  # fmt: skip
        delay = f"/control/{name}" if serve == "told" else serve
        self.podman(
            "create", "--pod", podman_name, "--name", app, "--network", "host", *ulimit_args(),
            "--volume", f"{self.records}:/records", "--volume", f"{self.control}:/control:ro",
            "--volume", f"{GATED}:/gate:ro", self.app_image, "sh", "/gate/server.sh", name, str(port), delay,
        )  # fmt: skip
        args = self.podman.command("pod", "start", podman_name)
        self.launches.append(subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
        return Pod(name, podman_name, init, app, self.launches[-1])

    def tell(self, pod: Pod) -> None:
        (self.control / pod.name).touch()

    def record(self, pod: Pod) -> dict[str, float]:
        return read_records(self.records).get(pod.name, {})

    def status(self, container: str) -> str:
        return self.podman("inspect", "--format", "{{.State.Status}}", container)

    def exit_code(self, container: str) -> int:
        return int(self.podman("inspect", "--format", "{{.State.ExitCode}}", container))

    def logs(self, container: str) -> str:
        result = self.podman.result("logs", container)
        return result.stdout + result.stderr

    def close(self) -> None:
        for name in self.created:
            self.podman.remove_pod(name)
        for launch in self.launches:  # a pod removed while its init container waited: its start fails now
            launch.communicate(timeout=60)


def started(pod: Pod, timeout: float = START) -> None:
    """``podman pod start`` succeeded: the init container was done and the app started."""
    out, err = pod.start.communicate(timeout=timeout)
    assert pod.start.returncode == 0, f"podman pod start exited {pod.start.returncode}: {out}{err}"


@pytest.fixture
def pods(tmp_path: Path, podman: Podman, nodeguard_image: str, busybox_image: str) -> Iterator[Pods]:
    made = Pods(podman, nodeguard_image, busybox_image, tmp_path)
    try:
        yield made
    finally:
        made.close()


def test_the_app_starts_only_once_its_init_container_has_a_slot_of_the_cluster_cap(pods: Pods, tmp_path: Path) -> None:
    """The snippet's semaphore capped at 1 across two nodes: a pod's app starts after its init container's admission;
    a pod on the other node waits in its init container, its app not started, while the first app is starting, and
    its app starts once the first is ready and the slot has moved to its node."""
    semaphore = snippet_semaphore()
    assert semaphore in shipped_config()["coordination"]["semaphores"]
    seed = shipped_config()["coordination"]["seeds"][0]  # holds the cap when the cluster first starts
    with (
        started_broker(tmp_path / "broker") as broker,
        nodes(tmp_path, broker, [seed, "node-2"], {semaphore: 1}) as (
            bank,
            other,
        ),
    ):
        first = pods.start("web-a", other.gate_dir, serve="told")
        admitted = other.gate.wait_state(first.load, "starting", timeout=START)
        admitted_at = time.time() - admitted["admittedSecondsAgo"]
        assert admitted["semaphore"] == semaphore and admitted["clusterSlot"] == "held", admitted
        started(first)
        assert pods.exit_code(first.init) == 0
        first_start = wait_until(lambda: pods.record(first).get("start"), 10, "the first app's start record")
        assert first_start > admitted_at

        second = pods.start("web-b", bank.gate_dir)
        waiting = bank.gate.wait_state(second.load, "pending", timeout=START)
        assert waiting["reason"] == f"waiting for a cluster slot of {semaphore!r}", waiting
        assert (pods.status(second.init), pods.status(second.app)) == ("running", "created")
        assert pods.record(second) == {} and second.start.poll() is None
        assert other.gate.load(first.load)["state"] == "starting"  # type: ignore[index]

        pods.tell(first)  # the first app serves: the daemon's probe sees it ready and frees the slot
        other.gate.wait_state(first.load, "ready", timeout=30)
        bank.gate.wait_state(second.load, "starting", timeout=30)
        started(second)
        second_start = wait_until(lambda: pods.record(second).get("start"), 10, "the second app's start record")
        first_ready = pods.record(first)["ready"]
        assert second_start > first_ready, (pods.record(first), pods.record(second))
        bank.gate.wait_state(second.load, "ready", timeout=30)
        for node in (bank, other):
            held = node.coordination()["semaphores"][semaphore]
            assert held["held"] == 0 and held["admitted"] == 1, (node.name, held)
        assert pods.logs(first.init) == pods.logs(second.init) == ""  # admitted: nothing to say


def test_the_broker_stopped_fails_a_starting_pods_load_and_a_waiting_pod_starts_once_it_is_back(
    pods: Pods, tmp_path: Path
) -> None:
    """The broker stopped (SIGTERM, as when its pod is deleted or its Deployment restarted) while a pod starts and
    another waits: the node revokes the starting pod's slot and its load fails in the gate, but its app goes on; the
    waiting pod waits, its app not started, until the broker is back, then starts beside the first one's app, which
    nodeguard no longer counts."""
    semaphore = snippet_semaphore()
    coordination = shipped_config()["coordination"]
    seed, lease = coordination["seeds"][0], coordination["leaseSeconds"]
    with (
        started_broker(tmp_path / "broker") as broker,
        nodes(tmp_path, broker, [seed, "node-2"], {semaphore: 1}) as (
            bank,
            other,
        ),
    ):
        first = pods.start("web-a", other.gate_dir, serve="told")  # never ready in this test
        other.gate.wait_state(first.load, "starting", timeout=START)
        started(first)
        second = pods.start("web-b", bank.gate_dir)
        bank.gate.wait_state(second.load, "pending", timeout=START)

        broker.stop()
        failed = other.gate.wait_state(first.load, "failed", timeout=lease + 10)  # at the latest when its lease ends
        assert failed["reason"] == f"cluster slot of {semaphore!r} revoked: this node lost the broker", failed
        assert pods.status(first.app) == "running" and "ready" not in pods.record(first)
        assert not other.admitting()
        assert bank.gate.load(second.load)["state"] == "pending"  # type: ignore[index]
        assert pods.status(second.app) == "created" and pods.record(second) == {}

        broker.start()
        bank.gate.wait_state(second.load, "starting", timeout=START)
        started(second)
        wait_until(lambda: "start" in pods.record(second), 10, "the second app's start record")
        assert pods.status(first.app) == "running" and "ready" not in pods.record(first)  # both apps starting
        bank.gate.wait_state(second.load, "ready", timeout=30)
        wait_until(other.admitting, 30, "the other node admitting again")


@pytest.mark.parametrize("if_unavailable", ["fail", "admit"])
def test_with_no_daemon_on_the_node_the_app_does_not_start_or_starts_ungated(
    pods: Pods, tmp_path: Path, if_unavailable: str
) -> None:
    """Nothing serves the node's gate socket: the init container gives up after --connect-timeout and exits 75, and
    the app does not start; with --if-unavailable=admit it exits 0 and the app starts ungated."""
    gate_dir = tmp_path / "host-run-nodeguard"
    gate_dir.mkdir()
    pod = pods.start("web", gate_dir, init_args=["--connect-timeout=2", f"--if-unavailable={if_unavailable}"])
    out, err = pod.start.communicate(timeout=START)
    log = pods.logs(pod.init)
    if if_unavailable == "fail":
        assert pod.start.returncode != 0 and "exited with code 75" in err, (out, err)
        assert pods.exit_code(pod.init) == 75
        assert f"nodeguard: gate unavailable ({gate_mount()[0]}/gate.sock" in log, log
        assert f"{pod.load} not admitted" in log, log
        assert pods.status(pod.app) == "created" and pods.record(pod) == {}, "the app must not have run"
    else:
        assert pod.start.returncode == 0, (out, err)
        assert pods.exit_code(pod.init) == 0
        assert f"{pod.load} goes ahead ungated" in log, log
        wait_until(lambda: "start" in pods.record(pod), 10, "the ungated app's start record")


def test_a_node_without_coordination_refuses_the_semaphore_and_the_app_does_not_start(
    pods: Pods, tmp_path: Path
) -> None:
    """The snippet's --semaphore on a node whose config has coordination off (as shipped): the gate refuses the
    start, the init container exits 1 saying why, and the app does not start."""
    assert shipped_config()["coordination"]["enabled"] is False
    with nodes(tmp_path, None, ["node-1"], {}) as (node,):
        pod = pods.start("web", node.gate_dir)
        out, err = pod.start.communicate(timeout=START)
        assert pod.start.returncode != 0 and "exited with code 1" in err, (out, err)
    log = pods.logs(pod.init)
    assert f"gate refused {pod.load}: semaphore {snippet_semaphore()!r}: cluster coordination is not enabled" in log
    assert pods.status(pod.app) == "created" and pods.record(pod) == {}, "the app must not have run"
