"""Discovery of Kubernetes pod cgroups (cgroupfs and systemd drivers) and configured groups."""

from __future__ import annotations

from pathlib import Path

from nodeguard.config import WorkloadGroup
from nodeguard.model.workloads import QosClass
from nodeguard.sources.discovery import discover, discover_groups, discover_pods, parse_container_dir

CID = "a" * 64
CID2 = "b" * 64
UID_G = "0f6a2f6e-3b1c-4c5e-9d7e-1a2b3c4d5e6f"
UID_B = "11111111-2222-3333-4444-555555555555"
UID_BE = "66666666-7777-8888-9999-000000000000"
STATIC_UID = "d41d8cd98f00b204e9800998ecf8427e"


def _mkdirs(root: Path, *paths: str) -> None:
    for path in paths:
        (root / path).mkdir(parents=True, exist_ok=True)


def test_cgroupfs_driver_layout(tmp_path: Path) -> None:
    """kubepods/pod<uid> is Guaranteed, burstable/ and besteffort/ pods get their class and containers."""
    _mkdirs(
        tmp_path,
        f"kubepods/pod{UID_G}/{CID}",
        f"kubepods/burstable/pod{UID_B}/{CID}",
        f"kubepods/burstable/pod{UID_B}/{CID2}",
        f"kubepods/besteffort/pod{UID_BE}",
        "kubepods/besteffort/not-a-pod",
    )
    pods = {p.pod_uid: p for p in discover_pods(str(tmp_path))}
    assert set(pods) == {UID_G, UID_B, UID_BE}
    assert pods[UID_G].qos_class is QosClass.GUARANTEED
    assert pods[UID_G].id == f"kubepods/pod{UID_G}"
    assert pods[UID_B].qos_class is QosClass.BURSTABLE
    assert [c.id for c in pods[UID_B].containers] == [CID, CID2]
    assert pods[UID_B].containers[0].path == f"kubepods/burstable/pod{UID_B}/{CID}"
    assert pods[UID_BE].qos_class is QosClass.BEST_EFFORT and pods[UID_BE].containers == ()


def test_systemd_driver_layout(tmp_path: Path) -> None:
    """kubepods.slice pods: underscores become dashes in the UID; runtime scopes name containers."""
    b = UID_B.replace("-", "_")
    g = UID_G.replace("-", "_")
    _mkdirs(
        tmp_path,
        f"kubepods.slice/kubepods-pod{g}.slice/cri-containerd-{CID}.scope",
        f"kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod{b}.slice/crio-{CID}.scope/container",
        f"kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod{b}.slice/crio-conmon-{CID}.scope",
        f"kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod{b}.slice/crio-{CID2}",
        f"kubepods.slice/kubepods-besteffort.slice/kubepods-besteffort-pod{STATIC_UID}.slice/docker-{CID}.scope",
    )
    pods = {p.pod_uid: p for p in discover_pods(str(tmp_path))}
    assert set(pods) == {UID_G, UID_B, STATIC_UID}
    assert pods[UID_G].qos_class is QosClass.GUARANTEED
    assert pods[UID_G].containers[0].runtime == "containerd"
    burstable = pods[UID_B]
    assert burstable.qos_class is QosClass.BURSTABLE
    # conmon is not a container; CRI-O's sandbox dir has no .scope.
    assert [(c.id, c.runtime, c.sandbox) for c in burstable.containers] == [(CID, "crio", False), (CID2, "crio", True)]
    assert pods[STATIC_UID].qos_class is QosClass.BEST_EFFORT
    assert pods[STATIC_UID].containers[0].runtime == "docker"


def test_container_names() -> None:
    """Container cgroup names of each runtime parse; other names are not containers."""
    assert parse_container_dir(f"cri-containerd-{CID}.scope") == (CID, "containerd", False)
    assert parse_container_dir(f"crio-{CID}") == (CID, "crio", True)
    assert parse_container_dir(CID) == (CID, "", False)
    assert parse_container_dir(f"crio-conmon-{CID}.scope") is None
    assert parse_container_dir("container") is None


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
    assert found["system.slice/sshd.service"].qos_class is QosClass.GUARANTEED


def test_pods_win_over_groups_and_kubepods_can_be_off(tmp_path: Path) -> None:
    """A directory that is both a pod and a group match is a pod; kubepods discovery can be disabled."""
    _mkdirs(tmp_path, f"kubepods/besteffort/pod{UID_BE}")
    groups = [WorkloadGroup.model_validate({"match": "kubepods/besteffort/*", "priority": 9})]
    both = discover(str(tmp_path), groups)
    assert both[f"kubepods/besteffort/pod{UID_BE}"].kind == "pod"
    only_groups = discover(str(tmp_path), groups, kubepods=False)
    assert only_groups[f"kubepods/besteffort/pod{UID_BE}"].kind == "group"


def test_missing_tree_finds_nothing(tmp_path: Path) -> None:
    """A root without kubepods or matches is simply empty, not an error."""
    assert discover(str(tmp_path / "absent"), []) == {}


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
    assert not by_uid[f"kubepods/besteffort/pod{UID_BE}"].protected
