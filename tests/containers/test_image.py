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

import json
import os
import urllib.request
import uuid
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


def daemonset_options(node_name: str, config_dir: Path, run_dir: Path) -> tuple[list[str], list[str]]:
    """podman options and the command's arguments for the DaemonSet's nodeguard container.

    The ConfigMap's volume is ``config_dir``; the host's ``/run/nodeguard`` is
    ``run_dir`` here (this machine may run other nodeguards: the ledger and the
    gate socket of this one stay in the test's directory).
    """
    pod = manifest("daemonset.yaml")["spec"]["template"]["spec"]
    [container] = pod["containers"]
    security = container["securityContext"]
    assert pod["hostPID"] is True and security["privileged"] is True and security["runAsUser"] == 0
    options = ["--privileged", "--pid", "host", "--user", "0"]
    if security.get("readOnlyRootFilesystem"):
        options += ["--read-only", "--read-only-tmpfs=false"]  # Kubernetes adds no tmpfs either
    env = {"NODE_NAME": node_name, "NODEGUARD_POD_UID": str(uuid.uuid4())}
    assert {e["name"] for e in container["env"]} == set(env)
    options += [arg for key, value in env.items() for arg in ("--env", f"{key}={value}")]
    volumes = {v["name"]: v for v in pod["volumes"]}
    for mount in container["volumeMounts"]:
        volume = volumes[mount["name"]]
        if "configMap" in volume:
            source = config_dir
        elif "secret" in volume:
            # An optional Secret that is not there (no MQTT password here): kubelet mounts an empty directory.
            assert volume["secret"].get("optional") is True, volume
            source = run_dir.parent / f"empty-{mount['name']}"
            source.mkdir(exist_ok=True)
        elif volume["hostPath"]["path"] == "/run/nodeguard":
            source = run_dir
        else:
            source = Path(volume["hostPath"]["path"])
        options += ["--volume", f"{source}:{mount['mountPath']}" + (":ro" if mount.get("readOnly") else "")]
    return options, list(container["args"])


def get(port: int, path: str) -> tuple[int, str]:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=5) as response:
            return response.status, str(response.read().decode())
    except OSError:
        return 0, ""


def test_the_image_run_as_the_daemonset_throttles_a_burner_on_the_host_and_serves_http(
    tmp_path: Path, podman: Podman, busybox_image: str, nodeguard_image: str
) -> None:
    """The built image, run with the DaemonSet's options and the ConfigMap's config, throttles a burner container on
    the host (its quota file changes, its measured CPU falls), serves /healthz and /metrics, and SIGTERM restores it."""
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

        def logs() -> str:
            return podman.result("logs", daemon).stderr[-4000:]

        try:
            wait_until(lambda: get(port, "/healthz") == (200, "ok\n"), 60, "/healthz")
        except AssertionError as exc:
            raise AssertionError(f"{exc}; container log:\n{logs()}") from None
        try:
            wait_until(lambda: hierarchy.limit(pod) != UNLIMITED, 30, "the burner throttled")
        except AssertionError as exc:
            raise AssertionError(f"{exc}; container log:\n{logs()}") from None
        throttled = hierarchy.limit(pod)
        assert throttled.cores is not None and throttled.cores < 1, throttled
        during = cores_used(hierarchy, pod, 2.0)
        allowed = max(throttled.cores, hierarchy.limit(pod).cores or 1.0)
        assert during <= allowed + 0.05, f"used {during:.2f} cores under a quota of {allowed:.2f}"
        status, text = get(port, "/metrics")
        assert status == 200 and "nodeguard_throttled_workloads 1.0" in text, text[-2000:]
        assert f'nodeguard_workload_cpu_quota_cores{{class="BestEffort",kind="pod",workload="{pod}"}}' in text
        # The ConfigMap's gate: its socket in the host's /run/nodeguard, for the group its init containers run as.
        socket = run_dir / "gate.sock"
        assert socket.is_socket() and os.stat(socket).st_gid == config["global"]["gate"]["socketGroup"]

        podman("stop", "--time", "30", daemon)
        assert podman("inspect", "--format", "{{.State.ExitCode}}", daemon) == "0", logs()
        assert hierarchy.limit(pod) == UNLIMITED
        assert not Ledger.load(str(run_dir / "ledger.json")).of("cpu.max")
        assert '"event": "restored every lever on exit"' in logs()
        print(f"\nburner under the image's daemon: {during:.2f} cores under a quota of {throttled.cores:.2f}")
