"""Discovery of Kubernetes pod cgroups in every kubelet layout, runtime names, tiers and configured groups."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from structlog.testing import capture_logs

from nodeguard.config import Settings
from nodeguard.errors import ConfigError
from nodeguard.model.workloads import QosClass, Workload
from nodeguard.sources.discovery import (
    SEARCH_DEPTH,
    SEARCH_FANOUT,
    ContainerName,
    KubepodsLocator,
    containers_in,
    discover,
    discover_groups,
    discover_pods,
    discover_tiers,
    find_kubepods,
    kubepods_tops,
    parse_container_dir,
    parse_pod_dir,
)
from nodeguard.sources.sensor import Sensor
from nodeguard.sources.settings import WorkloadGroup
from tests.support import cgroups as rc

CID = "a" * 64
CID2 = "b" * 64
SBID = "c" * 64
UID_G = "0f6a2f6e-3b1c-4c5e-9d7e-1a2b3c4d5e6f"
UID_B = "11111111-2222-3333-4444-555555555555"
UID_BE = "66666666-7777-8888-9999-000000000000"
STATIC_UID = "d41d8cd98f00b204e9800998ecf8427e"


def _mkdirs(root: Path, *paths: str) -> None:
    for path in paths:
        (root / path).mkdir(parents=True, exist_ok=True)


def _us(uid: str) -> str:
    """A pod UID as the systemd driver writes it in a slice name."""
    return uid.replace("-", "_")


def _pods(tree: Path) -> dict[str, Workload]:
    return {p.pod_uid or "": p for p in discover_pods(str(tree))}


def test_cgroupfs_driver_layout(tmp_path: Path) -> None:
    """kubepods/pod<uid> is Guaranteed, burstable/ and besteffort/ pods get their class and containers."""
    _mkdirs(
        tmp_path,
        f"kubepods/pod{UID_G}/{CID}",
        f"kubepods/burstable/pod{UID_B}/{CID}",
        f"kubepods/burstable/pod{UID_B}/{CID2}",
        f"kubepods/besteffort/pod{UID_BE}",
        "kubepods/besteffort/not-a-pod",
        "system.slice/sshd.service",
    )
    assert find_kubepods(str(tmp_path)) == ("kubepods",)
    pods = _pods(tmp_path)
    assert set(pods) == {UID_G, UID_B, UID_BE}
    assert pods[UID_G].qos_class is QosClass.GUARANTEED
    assert pods[UID_G].id == f"kubepods/pod{UID_G}"
    assert pods[UID_B].qos_class is QosClass.BURSTABLE
    assert [c.id for c in pods[UID_B].containers] == [CID, CID2]
    assert pods[UID_B].containers[0].path == f"kubepods/burstable/pod{UID_B}/{CID}"
    assert pods[UID_BE].qos_class is QosClass.BEST_EFFORT and pods[UID_BE].containers == ()


def test_systemd_driver_layout(tmp_path: Path) -> None:
    """kubepods.slice pods: underscores become dashes in the UID, tiers from the slice names."""
    _mkdirs(
        tmp_path,
        f"kubepods.slice/kubepods-pod{_us(UID_G)}.slice/cri-containerd-{CID}.scope",
        f"kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod{_us(UID_B)}.slice/crio-{CID}.scope",
        f"kubepods.slice/kubepods-besteffort.slice/kubepods-besteffort-pod{STATIC_UID}.slice/docker-{CID}.scope",
        "system.slice/containerd.service",
    )
    assert find_kubepods(str(tmp_path)) == ("kubepods.slice",)
    pods = _pods(tmp_path)
    assert set(pods) == {UID_G, UID_B, STATIC_UID}
    assert pods[UID_G].qos_class is QosClass.GUARANTEED
    assert pods[UID_G].id == f"kubepods.slice/kubepods-pod{_us(UID_G)}.slice"
    assert pods[UID_B].qos_class is QosClass.BURSTABLE
    assert pods[STATIC_UID].qos_class is QosClass.BEST_EFFORT


def test_kind_layout(tmp_path: Path) -> None:
    """kind (kubelet in a container, --cgroup-root=/kubelet, systemd driver): kubelet-kubepods- slices are found."""
    top = "kubelet.slice/kubelet-kubepods.slice"
    _mkdirs(
        tmp_path,
        f"{top}/kubelet-kubepods-pod{_us(UID_G)}.slice/cri-containerd-{CID}.scope",
        f"{top}/kubelet-kubepods-burstable.slice/kubelet-kubepods-burstable-pod{_us(UID_B)}.slice/"
        f"cri-containerd-{CID}.scope",
        f"{top}/kubelet-kubepods-burstable.slice/kubelet-kubepods-burstable-pod{_us(UID_B)}.slice/"
        f"cri-containerd-{CID2}.scope",
        f"{top}/kubelet-kubepods-besteffort.slice/kubelet-kubepods-besteffort-pod{_us(UID_BE)}.slice",
        "system.slice/containerd.service",
        "init.scope",
    )
    assert find_kubepods(str(tmp_path)) == (top,)
    pods = _pods(tmp_path)
    assert {uid: p.qos_class for uid, p in pods.items()} == {
        UID_G: QosClass.GUARANTEED,
        UID_B: QosClass.BURSTABLE,
        UID_BE: QosClass.BEST_EFFORT,
    }
    assert pods[UID_B].id == f"{top}/kubelet-kubepods-burstable.slice/kubelet-kubepods-burstable-pod{_us(UID_B)}.slice"
    assert [(c.id, c.runtime) for c in pods[UID_B].containers] == [(CID, "containerd"), (CID2, "containerd")]
    assert discover_tiers(str(tmp_path), (top,)) == {
        QosClass.BURSTABLE: (f"{top}/kubelet-kubepods-burstable.slice",),
        QosClass.BEST_EFFORT: (f"{top}/kubelet-kubepods-besteffort.slice",),
    }


@pytest.mark.parametrize(
    ("top", "pod"),
    [
        # --cgroup-root=/custom/root, cgroupfs driver
        ("custom/root/kubepods", f"burstable/pod{UID_B}"),
        # --cgroup-root=/k8s/nodes, systemd driver: every level a slice named by the path so far
        ("k8s.slice/k8s-nodes.slice/k8s-nodes-kubepods.slice",
         f"k8s-nodes-kubepods-burstable.slice/k8s-nodes-kubepods-burstable-pod{_us(UID_B)}.slice"),
        # --cgroup-root=/my-root, systemd driver: a dash inside a name becomes "_"
        ("my_root.slice/my_root-kubepods.slice",
         f"my_root-kubepods-burstable.slice/my_root-kubepods-burstable-pod{_us(UID_B)}.slice"),
    ],
)  # fmt: skip
def test_cgroup_root_moves_kubepods(tmp_path: Path, top: str, pod: str) -> None:
    """kubelet's --cgroup-root puts kubepods below other cgroups; the search finds it, tiers and all."""
    _mkdirs(tmp_path, f"{top}/{pod}/{CID}", "system.slice/kubelet.service", f"{top}/besteffort")
    assert find_kubepods(str(tmp_path)) == (top,)
    [workload] = discover_pods(str(tmp_path))
    assert workload.id == f"{top}/{pod}"
    assert workload.pod_uid == UID_B and workload.qos_class is QosClass.BURSTABLE
    assert discover_tiers(str(tmp_path), (top,))[QosClass.BURSTABLE] == (f"{top}/{pod.partition('/')[0]}",)


def test_search_is_bounded_and_configured_paths_win(tmp_path: Path) -> None:
    """Deeper than the search depth nothing is found unless configured; a configured path wins over the search."""
    deep = "/".join(f"d{i}" for i in range(SEARCH_DEPTH)) + "/kubepods"
    _mkdirs(tmp_path, f"{deep}/burstable/pod{UID_B}", f"kubepods/besteffort/pod{UID_BE}")
    assert find_kubepods(str(tmp_path)) == ("kubepods",)
    assert kubepods_tops(str(tmp_path)) == ("kubepods",)
    assert kubepods_tops(str(tmp_path), [deep]) == (deep,)
    found = discover(str(tmp_path), [], kubepods_tops(str(tmp_path), [deep]))
    assert [w.pod_uid for w in found.values()] == [UID_B]
    # Nearest level wins: the top at depth 1 hides any deeper one.
    (tmp_path / "kubepods" / "besteffort" / f"pod{UID_BE}").rmdir()
    (tmp_path / "kubepods" / "besteffort").rmdir()
    (tmp_path / "kubepods").rmdir()
    assert find_kubepods(str(tmp_path)) == ()
    assert find_kubepods(str(tmp_path), depth=SEARCH_DEPTH + 1) == (deep,)


def test_search_skips_sessions_and_crowded_directories(tmp_path: Path) -> None:
    """user.slice and a directory with more children than the fan-out limit are not walked into."""
    crowded = [f"farm/w{i:04d}" for i in range(SEARCH_FANOUT + 1)]
    _mkdirs(tmp_path, "user.slice/user-1000.slice/kubepods", "farm/w0000/kubepods", *crowded)
    assert find_kubepods(str(tmp_path)) == ()
    _mkdirs(tmp_path, "farm/kubepods")  # a crowded directory's own children are still looked at
    assert find_kubepods(str(tmp_path)) == ("farm/kubepods",)


def test_containerd_names() -> None:
    """containerd: cri-containerd-<id>.scope (systemd driver), a bare id (cgroupfs driver); no sandbox by name."""
    assert parse_container_dir(f"cri-containerd-{CID}.scope") == ContainerName(CID, "containerd", True)
    assert parse_container_dir(CID) == ContainerName(CID, "", False)
    assert [c.sandbox for c in containers_in("p", [f"cri-containerd-{CID}.scope", f"cri-containerd-{SBID}.scope"])] == [
        False,
        False,
    ]


def test_docker_names() -> None:
    """docker: docker-<id>.scope (systemd driver), a bare id (cgroupfs driver)."""
    assert parse_container_dir(f"docker-{CID}.scope") == ContainerName(CID, "docker", True)
    [container] = containers_in("pod", [CID])
    assert (container.id, container.runtime, container.sandbox, container.path) == (CID, "", False, f"pod/{CID}")


def test_podman_names(tmp_path: Path) -> None:
    """podman: libpod-<id> (cgroupfs manager) and libpod-<id>.scope (systemd) are containers; its monitors are not
    (libpod-conmon-<id>.scope under systemd, one ``conmon`` child under cgroupfs); no sandbox by name."""
    assert parse_container_dir(f"libpod-{CID}") == ContainerName(CID, "podman", False)
    assert parse_container_dir(f"libpod-{CID}.scope") == ContainerName(CID, "podman", True)
    assert parse_container_dir(f"libpod-conmon-{CID}.scope") is None
    assert parse_container_dir("conmon") is None
    cgroupfs = f"kubepods/besteffort/pod{UID_BE}"
    systemd = f"kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod{_us(UID_B)}.slice"
    _mkdirs(
        tmp_path,
        f"{cgroupfs}/libpod-{CID}",
        f"{cgroupfs}/libpod-{CID2}",
        f"{cgroupfs}/conmon",
        f"{systemd}/libpod-{CID}.scope/container",
        f"{systemd}/libpod-conmon-{CID}.scope",
    )
    pods = _pods(tmp_path)
    assert {uid: [(c.id, c.runtime, c.sandbox) for c in pod.containers] for uid, pod in pods.items()} == {
        UID_BE: [(CID, "podman", False), (CID2, "podman", False)],
        UID_B: [(CID, "podman", False)],
    }


def test_crio_systemd_driver(tmp_path: Path) -> None:
    """CRI-O, systemd driver: crio-<id>.scope is a container, its crio-conmon-<id>.scope is not, crio-<id> is the sandbox."""
    pod = f"kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod{_us(UID_B)}.slice"
    _mkdirs(tmp_path, f"{pod}/crio-{CID}.scope", f"{pod}/crio-conmon-{CID}.scope", f"{pod}/crio-{SBID}")
    [workload] = discover_pods(str(tmp_path))
    assert [(c.id, c.runtime, c.sandbox) for c in workload.containers] == [(CID, "crio", False), (SBID, "crio", True)]


def test_crio_cgroupfs_driver(tmp_path: Path) -> None:
    """CRI-O, cgroupfs driver: no name is a scope; a crio-<id> with a crio-conmon-<id> monitor is a container,
    the one without (the dropped infra container's cgroup) is the sandbox."""
    pod = f"kubepods/burstable/pod{UID_B}"
    _mkdirs(
        tmp_path,
        f"{pod}/crio-{CID}",
        f"{pod}/crio-conmon-{CID}",
        f"{pod}/crio-{CID2}",
        f"{pod}/crio-conmon-{CID2}",
        f"{pod}/crio-{SBID}",
    )
    [workload] = discover_pods(str(tmp_path))
    assert [(c.id, c.sandbox) for c in workload.containers] == [(CID, False), (CID2, False), (SBID, True)]
    assert parse_container_dir(f"crio-conmon-{CID}") is None


def test_crun_container_subgroup(tmp_path: Path) -> None:
    """crun's ``container`` child of a scope is no container of its own: the scope is the container, the pod the workload."""
    pod = f"kubepods.slice/kubepods-besteffort.slice/kubepods-besteffort-pod{_us(UID_BE)}.slice"
    _mkdirs(tmp_path, f"{pod}/crio-{CID}.scope/container", f"{pod}/crio-conmon-{CID}.scope")
    found = discover(str(tmp_path), [])
    assert list(found) == [pod]
    [container] = found[pod].containers
    assert container.path == f"{pod}/crio-{CID}.scope" and not container.sandbox
    assert parse_container_dir("container") is None


def test_pod_dir_names_of_every_layout() -> None:
    """Pod cgroup names give the UID (and the class where the name says it) with any --cgroup-root prefix."""
    assert parse_pod_dir(f"pod{UID_B}") == (UID_B, None)
    assert parse_pod_dir(f"kubepods-pod{_us(UID_G)}.slice") == (UID_G, QosClass.GUARANTEED)
    assert parse_pod_dir(f"kubelet-kubepods-burstable-pod{_us(UID_B)}.slice") == (UID_B, QosClass.BURSTABLE)
    assert parse_pod_dir(f"k8s-nodes-kubepods-besteffort-pod{STATIC_UID}.slice") == (STATIC_UID, QosClass.BEST_EFFORT)
    assert parse_pod_dir("kubepods-burstable.slice") is None
    assert parse_pod_dir("kubelet-kubepods.slice") is None


def test_tiers_are_known_and_never_workloads(tmp_path: Path) -> None:
    """Tier cgroups are listed by class and stay out of the workloads even when a group pattern matches them."""
    _mkdirs(
        tmp_path,
        f"kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod{_us(UID_B)}.slice",
        "kubepods.slice/kubepods-besteffort.slice",
    )
    tiers = discover_tiers(str(tmp_path), ("kubepods.slice",))
    assert tiers == {
        QosClass.BURSTABLE: ("kubepods.slice/kubepods-burstable.slice",),
        QosClass.BEST_EFFORT: ("kubepods.slice/kubepods-besteffort.slice",),
    }
    groups = [WorkloadGroup.model_validate({"match": "kubepods.slice*"}),
              WorkloadGroup.model_validate({"match": "kubepods.slice/*"})]  # fmt: skip
    found = discover(str(tmp_path), groups)
    assert list(found) == [f"kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod{_us(UID_B)}.slice"]


def test_configured_groups_by_glob(tmp_path: Path) -> None:
    """Glob patterns select directories with the group's class, priority and protection."""
    _mkdirs(tmp_path, "system.slice/batch-1.service", "system.slice/batch-2.service", "system.slice/sshd.service")
    (tmp_path / "system.slice/batch-file.service").write_text("not a dir")
    groups = [
        WorkloadGroup.model_validate({"match": "system.slice/batch-*.service", "class": "BestEffort", "priority": 5}),
        WorkloadGroup.model_validate({"match": "system.slice/sshd.service", "class": "Guaranteed", "protected": True}),
    ]
    found = {w.id: w for w in discover_groups(str(tmp_path), groups)}
    assert set(found) == {"system.slice/batch-1.service", "system.slice/batch-2.service", "system.slice/sshd.service"}
    assert found["system.slice/batch-1.service"].priority == 5
    assert found["system.slice/sshd.service"].protected is True
    assert found["system.slice/sshd.service"].protected_by == "workloads.groups[1].protected"
    assert found["system.slice/batch-1.service"].protected_by is None
    assert found["system.slice/sshd.service"].qos_class is QosClass.GUARANTEED
    assert all(w.metadata_known and w.namespace is None for w in found.values()), "a group has no pod metadata"


def test_a_pod_found_by_its_cgroup_has_no_metadata(tmp_path: Path) -> None:
    """A pod cgroup says only its UID and class: its workload is marked without metadata (never acted on unless
    the config allows it), with no namespace and no labels."""
    _mkdirs(tmp_path, f"kubepods/burstable/pod{UID_B}", f"kubepods/pod{UID_BE}")
    found = discover(str(tmp_path), [])
    assert [(w.metadata_known, w.namespace, dict(w.labels)) for w in found.values()] == [(False, None, {})] * 2


def test_pods_win_over_groups_and_kubepods_can_be_off(tmp_path: Path) -> None:
    """A directory that is both a pod and a group match is a pod; with no kubepods top it is a group."""
    _mkdirs(tmp_path, f"kubepods/besteffort/pod{UID_BE}")
    groups = [WorkloadGroup.model_validate({"match": "kubepods/besteffort/*", "priority": 9})]
    both = discover(str(tmp_path), groups)
    assert both[f"kubepods/besteffort/pod{UID_BE}"].kind == "pod"
    only_groups = discover(str(tmp_path), groups, tops=())
    assert only_groups[f"kubepods/besteffort/pod{UID_BE}"].kind == "group"


def test_missing_tree_finds_nothing(tmp_path: Path) -> None:
    """A root without kubepods or matches is simply empty, not an error."""
    assert discover(str(tmp_path / "absent"), []) == {}
    assert discover_tiers(str(tmp_path / "absent"), ("kubepods",)) == {}


def test_kubepods_paths_config() -> None:
    """sensing.kubepodsPaths takes kubepods cgroups below the root; anything else is an error naming its path."""
    settings = Settings.model_validate({"sensing": {"kubepodsPaths": ["/kubelet.slice/kubelet-kubepods.slice/"]}})
    assert settings.sensing.kubepods_paths == ["kubelet.slice/kubelet-kubepods.slice"]
    from nodeguard.config import parse_document

    with pytest.raises(ConfigError) as caught:
        parse_document({"global": {"sensing": {"kubepodsPaths": ["kubepods", "../kubepods", "kubelet.slice"]}}})
    problems = caught.value.problems
    assert len(problems) == 2
    assert problems[0].startswith("global.sensing.kubepodsPaths[1]: ") and "'..'" in problems[0]
    assert problems[1].startswith("global.sensing.kubepodsPaths[2]: ") and "kubepods cgroup itself" in problems[1]


def test_locator_logs_where_pods_are_and_missing_configured_paths(tmp_path: Path) -> None:
    """The locator logs the kubepods top levels when they change and warns once about a configured one not there."""
    locator = KubepodsLocator()
    with capture_logs() as logs:
        assert locator.locate(str(tmp_path)) == ()
        _mkdirs(tmp_path, "kubepods.slice")
        assert locator.locate(str(tmp_path)) == ("kubepods.slice",)
        assert locator.locate(str(tmp_path)) == ("kubepods.slice",)
        assert locator.locate(str(tmp_path), ["kubelet.slice/kubelet-kubepods.slice"]) == ()
        assert locator.locate(str(tmp_path), ["kubelet.slice/kubelet-kubepods.slice"]) == ()
    events = [(e["event"], e.get("paths")) for e in logs]
    assert events == [
        ("kubepods cgroups", ["kubepods.slice"]),
        ("configured kubepods cgroup not found", ["kubelet.slice/kubelet-kubepods.slice"]),
        ("kubepods cgroups", []),
    ]


def test_nodeguard_never_guards_itself(tmp_path: Path) -> None:
    """The workload holding nodeguard's own cgroup (by path or by pod UID) is marked protected."""
    from nodeguard.sources.discovery import own_cgroup_path, protect_self

    _mkdirs(tmp_path, f"kubepods/besteffort/pod{UID_BE}/{CID}", f"kubepods/burstable/pod{UID_B}")
    v2 = own_cgroup_path(f"0::/kubepods/besteffort/pod{UID_BE}/{CID}\n", "v2")
    assert v2 == f"kubepods/besteffort/pod{UID_BE}/{CID}"
    v1 = own_cgroup_path("12:pids:/x\n4:cpu,cpuacct:/system.slice/nodeguard.service\n0::/y\n", "v1")
    assert v1 == "system.slice/nodeguard.service"
    assert own_cgroup_path("0::/\n", "v2") is None  # inside a cgroup namespace
    by_path = protect_self(discover(str(tmp_path), []), v2, None)
    assert by_path[f"kubepods/besteffort/pod{UID_BE}"].protected
    assert not by_path[f"kubepods/burstable/pod{UID_B}"].protected
    by_uid = protect_self(discover(str(tmp_path), []), None, UID_B)
    assert by_uid[f"kubepods/burstable/pod{UID_B}"].protected
    assert by_uid[f"kubepods/burstable/pod{UID_B}"].protected_by == "nodeguard itself"
    assert not by_uid[f"kubepods/besteffort/pod{UID_BE}"].protected


def test_kind_layout_in_real_v1_cgroups() -> None:
    """In this host's real v1 cpu hierarchy a kind-shaped pod is found by the search and sensed with its CPU use."""
    reason = rc.why_no_v1_cpu()
    if reason:
        pytest.skip(reason)
    cpu, cpuacct = rc.v1_hierarchy("cpu"), rc.v1_hierarchy("cpuacct")
    assert cpu is not None and cpuacct is not None
    name = rc.unique_name()
    top = "kubelet.slice/kubelet-kubepods.slice"
    pod = f"{top}/kubelet-kubepods-burstable.slice/kubelet-kubepods-burstable-pod{_us(UID_B)}.slice"
    scope = f"{pod}/cri-containerd-{CID}.scope"
    hierarchies = [cpu] if cpu == cpuacct else [cpu, cpuacct]
    with rc.cgroups(*[h / name / scope for h in hierarchies]):
        # The search, on real cgroup directories (rooted at our own parent: other tests may add kubepods elsewhere).
        assert find_kubepods(str(cpu / name)) == (top,)
        (cpu / name / pod / "cpu.cfs_quota_us").write_text("20000")
        busy = rc.start_busy(*[h / name / scope for h in hierarchies])
        settings = Settings.model_validate(
            {"sensing": {"cgroupRoot": str(rc.CGROUP_ROOT), "cgroupVersion": "v1", "kubepodsPaths": [f"{name}/{top}"]}}
        )
        sensor = Sensor(settings)
        try:
            sensor.sense()
            time.sleep(1.0)  # the interval the CPU rate is measured over, not a synchronisation
            snapshot = sensor.sense()
        finally:
            rc.stop(busy)
            sensor.close()
    usage = snapshot.workloads[f"{name}/{pod}"]
    assert usage.workload.qos_class is QosClass.BURSTABLE and usage.workload.pod_uid == UID_B
    assert [c.path for c in usage.workload.containers] == [f"{name}/{scope}"]
    assert usage.cores == pytest.approx(0.2, abs=0.08)
    assert sensor.kubepods.tops == (f"{name}/{top}",)
