"""nodeguard's image, built from the Dockerfile with podman and run the way the DaemonSet runs it.

The image is built on a local base (a minimal Debian of this host's release
with python3-pip, made with mmdebstrap: no registry is reachable here) passed
as ``--build-arg BASE_IMAGE``. The container's options come from
``packaging/kubernetes/daemonset.yaml`` (privileged, host PID namespace, root,
read-only root file system, its environment, every volume mount at its
``mountPath``) and its config from ``configmap.yaml``, with one ``perNode`` rule
for this test's node and the Kubernetes integration off (no API server runs
here). The checks are made from outside: the host's cgroup files, the burner's
measured CPU time, and the daemon's HTTP endpoints.
"""

from __future__ import annotations

import contextlib
import json
import os
import urllib.request
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml

from nodeguard.actuators.ledger import Ledger
from nodeguard.model.samples import CpuMax
from tests.containers import runtime
from tests.containers.pods import BURN, cores_used, host_hierarchy, kubepods_parent, pod_run
from tests.containers.runtime import Podman
from tests.support import cgroups as rc
from tests.support.poll import wait_until
from tests.support.ports import free_port

KUBERNETES = runtime.REPO / "packaging" / "kubernetes"
UNLIMITED = CpuMax(None)


def manifest(name: str) -> dict[str, Any]:
    return dict(yaml.safe_load((KUBERNETES / name).read_text()))


def configmap_config() -> dict[str, Any]:
    return dict(json.loads(manifest("configmap.yaml")["data"]["config.json"]))


def pod_options(pod: dict[str, Any], node_name: str, config_dir: Path, run_dir: Path) -> list[str]:
    """podman options for the one container of a pod spec of ours (the DaemonSet's, the restore Job's).

    The ConfigMap's volume is ``config_dir``; the host's ``/run/nodeguard`` is
    ``run_dir`` here (this machine may run other nodeguards: the ledger and the
    gate socket of this one stay in the test's directory); an emptyDir is a
    fresh directory beside it.
    """
    [container] = pod["containers"]
    security = container["securityContext"]
    assert pod["hostPID"] is True and security["privileged"] is True and security["runAsUser"] == 0
    options = ["--privileged", "--pid", "host", "--user", "0"]
    if security.get("readOnlyRootFilesystem"):
        options += ["--read-only", "--read-only-tmpfs=false"]  # Kubernetes adds no tmpfs either
    env = {"NODE_NAME": node_name, "NODEGUARD_POD_UID": str(uuid.uuid4())}
    assert {e["name"] for e in container["env"]} <= set(env)
    for variable in container["env"]:
        assert variable["valueFrom"] in ({"fieldRef": {"fieldPath": "spec.nodeName"}},
                                         {"fieldRef": {"fieldPath": "metadata.uid"}}), variable  # fmt: skip
        options += ["--env", f"{variable['name']}={env[variable['name']]}"]
    volumes = {v["name"]: v for v in pod["volumes"]}
    for mount in container["volumeMounts"]:
        volume = volumes[mount["name"]]
        if "configMap" in volume:
            source = config_dir
        elif "secret" in volume or "emptyDir" in volume:
            # An optional Secret that is not there (no MQTT password here): kubelet mounts an empty directory.
            assert "emptyDir" in volume or volume["secret"].get("optional") is True, volume
            source = run_dir.parent / f"empty-{uuid.uuid4().hex[:8]}-{mount['name']}"
            source.mkdir()
        elif volume["hostPath"]["path"] == "/run/nodeguard":
            source = run_dir
        elif volume["hostPath"]["path"] == "/var/lib/nodeguard":
            source = run_dir.parent / "state"  # the decision history's directory, this test's own
            source.mkdir(exist_ok=True)
        else:
            source = Path(volume["hostPath"]["path"])
        options += ["--volume", f"{source}:{mount['mountPath']}" + (":ro" if mount.get("readOnly") else "")]
    if "command" in container:
        options += ["--entrypoint", json.dumps(container["command"])]
    return options


def daemonset_options(node_name: str, config_dir: Path, run_dir: Path) -> tuple[list[str], list[str]]:
    """podman options and the command's arguments for the DaemonSet's nodeguard container."""
    pod = manifest("daemonset.yaml")["spec"]["template"]["spec"]
    [container] = pod["containers"]
    return pod_options(pod, node_name, config_dir, run_dir), list(container["args"])


def restore_job_options(node_name: str, config_dir: Path, run_dir: Path) -> tuple[list[str], list[str]]:
    """podman options and arguments for the restore Job's container, as its comment's sed makes it for a node."""
    text = (KUBERNETES / "restore-job.yaml").read_text().replace("node-to-restore", node_name)
    job = yaml.safe_load(text)
    pod = job["spec"]["template"]["spec"]
    assert pod["nodeName"] == node_name and pod["restartPolicy"] == "Never"
    [container] = pod["containers"]
    return pod_options(pod, node_name, config_dir, run_dir), list(container["args"])


def get(port: int, path: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5) as response:
            return response.status, str(response.read().decode())
    except OSError:
        return 0, ""


@dataclass
class Guarded:
    """The image's daemon run as the DaemonSet, throttling a burner pod on the host."""

    podman: Podman
    hierarchy: rc.Hierarchy
    node: str
    pod: str  # the burner's pod cgroup
    daemon: str  # the daemon's container
    port: int
    config: dict[str, Any]
    config_dir: Path
    run_dir: Path
    names: list[str]  # the test's containers, removed at its end

    def logs(self, container: str | None = None) -> str:
        result = self.podman.result("logs", container or self.daemon)
        return (result.stdout + result.stderr)[-4000:]


@contextlib.contextmanager
def throttling_daemon(tmp_path: Path, podman: Podman, busybox_image: str, nodeguard_image: str) -> Iterator[Guarded]:
    """The image run with the DaemonSet's options and the ConfigMap's config, once it throttles a burner container
    in a BestEffort pod cgroup on the host."""
    hierarchy = host_hierarchy()
    port = free_port()
    node = rc.unique_name("ngnode")
    config_dir, run_dir = tmp_path / "config", tmp_path / "run"
    config_dir.mkdir()
    run_dir.mkdir()
    with kubepods_parent(podman) as (parent, names):
        config = configmap_config()
        assert config["global"]["sensing"]["cgroupRoot"] == "/host/sys/fs/cgroup"
        # No API server here: without pod metadata nodeguard leaves every pod alone, integration or not.
        assert config["global"]["kubernetes"]["enabled"] is True
        config["global"]["kubernetes"]["enabled"] = False
        config["perNode"].append({
            "nodeSelector": {"matchLabels": {"kubernetes.io/hostname": node}},
            "sensing": {"kubepodsPaths": [f"{parent}/kubepods"], "tickSeconds": 0.5},
            "guard": {"objectives": [
                {"metric": "cpu_total_usage", "threshold": 0.3, "restoreBelow": 0.01, "action": "throttle"},
            ], "candidates": {"podsWithoutMetadata": True}},  # so the config says pods may be acted on anyway
            # The host's network here (no pod network): loopback and a free port rather than 0.0.0.0:9466.
            "http": {"listen": f"127.0.0.1:{port}"},
        })  # fmt: skip
        (config_dir / "config.json").write_text(json.dumps(config))

        pod = f"{parent}/kubepods/besteffort/pod{uuid.uuid4()}"
        pod_run(podman, names, busybox_image, pod, BURN)
        assert hierarchy.limit(pod) == UNLIMITED
        options, args = daemonset_options(node, config_dir, run_dir)
        daemon = f"{rc.unique_name()}-nodeguard"
        names.append(daemon)
        runtime.wait_for_the_node(hierarchy.writable)
        podman.run(daemon, nodeguard_image, args, options)
        guarded = Guarded(podman, hierarchy, node, pod, daemon, port, config, config_dir, run_dir, names)
        try:
            wait_until(lambda: get(port, "/healthz") == (200, "ok\n"), 60, "/healthz")
            wait_until(lambda: hierarchy.limit(pod) != UNLIMITED, 30, "the burner throttled")
        except AssertionError as exc:
            raise AssertionError(f"{exc}; container log:\n{guarded.logs()}") from None
        yield guarded


def test_the_image_run_as_the_daemonset_throttles_a_burner_on_the_host_and_serves_http(
    tmp_path: Path, podman: Podman, busybox_image: str, nodeguard_image: str
) -> None:
    """The built image, run with the DaemonSet's options and the ConfigMap's config, throttles a burner container on
    the host (its quota file changes, its measured CPU falls), serves /healthz and /metrics, and SIGTERM restores it."""
    with throttling_daemon(tmp_path, podman, busybox_image, nodeguard_image) as guarded:
        hierarchy, pod, port = guarded.hierarchy, guarded.pod, guarded.port
        throttled = hierarchy.limit(pod)
        assert throttled.cores is not None and throttled.cores < 1, throttled
        during = cores_used(hierarchy, pod, 2.0)
        allowed = max(throttled.cores, hierarchy.limit(pod).cores or 1.0)
        assert during <= allowed + 0.05, f"used {during:.2f} cores under a quota of {allowed:.2f}"
        status, text = get(port, "/metrics")
        assert status == 200 and "nodeguard_throttled_workloads 1.0" in text, text[-2000:]
        assert f'nodeguard_workload_cpu_quota_cores{{class="BestEffort",kind="pod",workload="{pod}"}}' in text
        # The ConfigMap's gate: its socket in the host's /run/nodeguard, for the group its init containers run as.
        socket = guarded.run_dir / "gate.sock"
        assert socket.is_socket() and os.stat(socket).st_gid == guarded.config["global"]["gate"]["socketGroup"]

        podman("stop", "--time", "30", guarded.daemon)
        assert podman("inspect", "--format", "{{.State.ExitCode}}", guarded.daemon) == "0", guarded.logs()
        assert hierarchy.limit(pod) == UNLIMITED
        assert not Ledger.load(str(guarded.run_dir / "ledger.json")).of("cpu.max")
        assert '"event": "restored every lever on exit"' in guarded.logs()
        print(f"\nburner under the image's daemon: {during:.2f} cores under a quota of {throttled.cores:.2f}")


def run_restore_job(guarded: Guarded, image: str, attempt: str) -> tuple[int, str]:
    """The restore Job's container run to its end, as restore-job.yaml has it for the test's node; its exit
    code and its log."""
    options, args = restore_job_options(guarded.node, guarded.config_dir, guarded.run_dir)
    name = f"{guarded.node}-restore-{attempt}"
    guarded.names.append(name)
    guarded.podman.run(name, image, args, options)
    code = int(guarded.podman("wait", name, timeout=180))
    return code, guarded.logs(name)


def test_the_restore_job_refuses_beside_the_daemon_and_restores_what_a_killed_one_held(
    tmp_path: Path, podman: Podman, busybox_image: str, nodeguard_image: str
) -> None:
    """restore-job.yaml's container, run with its own options and command against the same host directories:
    beside the running DaemonSet container it prints the hold and refuses (the node's lock crosses containers);
    after that daemon is SIGKILLed, the hold still in place, it prints the hold and puts the original back,
    leaving the ledger empty."""
    with throttling_daemon(tmp_path, podman, busybox_image, nodeguard_image) as guarded:
        hierarchy, pod, ledger = guarded.hierarchy, guarded.pod, str(guarded.run_dir / "ledger.json")

        code, beside = run_restore_job(guarded, nodeguard_image, "beside")
        assert code == 1, beside
        [line] = [line for line in beside.splitlines() if line.startswith(f"cpu.max     {pod}: held at ")]
        assert ", original unlimited, since " in line and "stop it first (SIGTERM restores)" in beside, beside
        assert hierarchy.limit(pod) != UNLIMITED  # the daemon still holds it (and moves it as it measures)

        podman("kill", "--signal", "KILL", guarded.daemon)
        assert podman("wait", guarded.daemon, timeout=60) == "137"
        held = hierarchy.limit(pod)
        assert held != UNLIMITED and held.cores is not None, "a SIGKILL restores nothing"
        record = Ledger.load(ledger).get("cpu.max", pod)
        assert record is not None and record.holds == held.render_v2(), record
        shown = f"cpu.max     {pod}: held at {held.cores:.3g} cores, original unlimited, since "
        runtime.wait_for_the_node(hierarchy.writable)  # another test run's daemon would refuse it too

        code, after = run_restore_job(guarded, nodeguard_image, "after")
        assert code == 0, after
        assert shown in after and f"restored  cpu.max    {pod}" in after, after
        assert hierarchy.limit(pod) == UNLIMITED
        assert not Ledger.load(ledger)
