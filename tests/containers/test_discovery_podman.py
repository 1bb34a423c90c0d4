"""Discovery of real container cgroups: pods and containers that podman (runc, cgroupfs manager) made.

Pods are cgroups shaped as kubelet's cgroupfs driver shapes them
(``<parent>/kubepods[/<tier>]/pod<uid>``), given to ``podman run
--cgroup-parent``; podman puts each container in ``libpod-<id>`` there and its
monitors in one ``conmon`` child. Without ``--cgroup-parent`` podman uses its
own ``libpod_parent/libpod-<id>``. (This host has no systemd as PID 1, so
podman's systemd manager, and with it a ``.slice`` parent, is not available:
podman refuses a slice under cgroupfs, which the first test shows.)
"""

from __future__ import annotations

import signal
import urllib.request
import uuid
from pathlib import Path

from nodeguard.actuators.ledger import Ledger
from nodeguard.model.samples import CpuMax
from tests.containers import runtime
from tests.containers.pods import BURN, cores_used, host_hierarchy, kubepods_parent, pod_run, snapshot
from tests.containers.runtime import Podman
from tests.support import cgroups as rc
from tests.support.daemon import DaemonProcess
from tests.support.ports import free_port

SLEEP = ["sleep", "3600"]
POD_LIMIT = CpuMax(150000)  # 1.5 cores, written on the pod as kubelet would, and by podman --cpus on the container


def test_pods_and_their_podman_containers_are_found(tmp_path: Path, podman: Podman, busybox_image: str) -> None:
    """Pods of every QoS tier with podman containers in them are found with their container ids; conmon is none."""
    with kubepods_parent(podman) as (parent, names):
        uids = {tier: str(uuid.uuid4()) for tier in ("besteffort", "burstable", "guaranteed")}
        pods = {
            tier: f"{parent}/kubepods/{tier}/pod{uid}" if tier != "guaranteed" else f"{parent}/kubepods/pod{uid}"
            for tier, uid in uids.items()
        }
        ids = {
            "besteffort": {pod_run(podman, names, busybox_image, pods["besteffort"], SLEEP) for _ in range(2)},
            "burstable": {pod_run(podman, names, busybox_image, pods["burstable"], SLEEP)},
            "guaranteed": {pod_run(podman, names, busybox_image, pods["guaranteed"], SLEEP)},
        }
        hierarchy = host_hierarchy()
        assert (hierarchy.writable / pods["besteffort"] / "conmon").is_dir(), "podman's monitors' cgroup"
        slice_pod = f"/{parent}/kubepods.slice/kubepods-besteffort.slice/kubepods-besteffort-pod{uids['besteffort'].replace('-', '_')}.slice"
        refused = podman.result(
            "run", "--rm", *runtime.ulimit_args(), "--cgroup-parent", slice_pod, busybox_image, "true"
        )
        assert (
            refused.returncode != 0 and "systemd slice received as cgroup parent when using cgroupfs" in refused.stderr
        )

        config = {"global": {"sensing": {"kubepodsPaths": [f"{parent}/kubepods"]}, "http": {"enabled": False}}}
        found = {w["workload"]["id"]: w["workload"] for w in snapshot(config, tmp_path)["workloads"]}
        classes = {"besteffort": "BestEffort", "burstable": "Burstable", "guaranteed": "Guaranteed"}
        assert set(found) == set(pods.values()), sorted(found)
        for tier, pod in pods.items():
            workload = found[pod]
            assert (workload["kind"], workload["pod_uid"], workload["qos_class"]) == ("pod", uids[tier], classes[tier])
            containers = workload["containers"]
            assert {c["id"] for c in containers} == ids[tier], containers
            assert {(c["runtime"], c["sandbox"]) for c in containers} == {("podman", False)}
            assert {c["path"] for c in containers} == {f"{pod}/libpod-{cid}" for cid in ids[tier]}


def test_podmans_own_layout_is_found_by_a_group_pattern(tmp_path: Path, podman: Podman, busybox_image: str) -> None:
    """A plain ``podman run`` container (libpod_parent/libpod-<id>) is a workload through workloads.groups; conmon is not."""
    with runtime.containers(podman) as names:
        names.append(rc.unique_name())
        cid = podman.run(names[0], busybox_image, SLEEP)
        config = {
            "global": {
                "sensing": {"kubepods": False},
                "workloads": {"groups": [{"match": "libpod_parent/libpod-*", "class": "BestEffort"}]},
                "http": {"enabled": False},
            }
        }
        found = {w["workload"]["id"]: w["workload"] for w in snapshot(config, tmp_path)["workloads"]}
        assert f"libpod_parent/libpod-{cid}" in found, sorted(found)
        assert found[f"libpod_parent/libpod-{cid}"]["qos_class"] == "BestEffort"
        assert "libpod_parent/conmon" not in found


def metrics(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
        return str(response.read().decode())


def test_the_daemon_throttles_a_podman_burner_and_restores_both_limits_exactly(
    tmp_path: Path, podman: Podman, busybox_image: str
) -> None:
    """A burner container (pod limit as kubelet writes it, container limit written by podman --cpus) is throttled,
    its measured CPU falls to the new quota, and SIGTERM puts both limits back exactly."""
    hierarchy = host_hierarchy()
    with kubepods_parent(podman) as (parent, names):
        pod = f"{parent}/kubepods/besteffort/pod{uuid.uuid4()}"
        with hierarchy.groups(pod):
            hierarchy.set_limit(pod, POD_LIMIT)
            cid = pod_run(podman, names, busybox_image, pod, BURN, "--cpus", "1.5")
            container = f"{pod}/libpod-{cid}"
            assert hierarchy.limit(container) == POD_LIMIT, "podman --cpus wrote the container's limit"
            before = cores_used(hierarchy, pod, 1.0)
            port = free_port()
            config = {
                "global": {
                    "sensing": {"tickSeconds": 0.5, "kubepodsPaths": [f"{parent}/kubepods"]},
                    "guard": {"objectives": [
                        {"metric": "cpu_total_usage", "threshold": 0.3, "restoreBelow": 0.01, "action": "throttle"},
                    ], "candidates": {"podsWithoutMetadata": True}},  # no API server: no pod has metadata
                    "actuation": {"ledgerPath": str(tmp_path / "run" / "ledger.json")},
                    "http": {"listen": f"127.0.0.1:{port}"},
                    "gate": {"enabled": False},
                }
            }  # fmt: skip
            runtime.wait_for_the_node(hierarchy.writable)
            daemon = DaemonProcess(config, tmp_path).start()
            try:
                # The rate in force: the pod's own limit, or on v1 its containers' together (the container's own
                # limit of 1.5 cores is above the hold, so the pod is held through its containers).
                daemon.wait_for(lambda: (hierarchy.held_rate(pod) or 1.5) < 1.5, 30, "the burner's pod throttled")
                throttled = hierarchy.held_rate(pod)
                assert throttled is not None and throttled < 1.5, throttled
                if hierarchy.version == "v1":
                    assert hierarchy.limit(pod) == POD_LIMIT, "the pod's own limit stays: a restart can write 1.5"
                during = cores_used(hierarchy, pod, 2.0)
                allowed = max(throttled, hierarchy.held_rate(pod) or 1.5)
                assert during <= allowed + 0.05, f"used {during:.2f} cores under a quota of {allowed:.2f}"
                assert f'workload="{pod}"' in metrics(port)
                daemon.signal(signal.SIGTERM)
                assert daemon.wait(timeout=15) == 0
            finally:
                daemon.kill()
            assert hierarchy.limit(pod) == POD_LIMIT and hierarchy.limit(container) == POD_LIMIT
            assert not Ledger.load(str(tmp_path / "run" / "ledger.json")).of("cpu.max")
            print(f"\nburner: {before:.2f} cores before, {during:.2f} under a quota of {throttled:.2f}")
