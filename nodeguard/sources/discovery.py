"""Finding workloads: Kubernetes pod cgroups (both drivers) and configured groups."""

from __future__ import annotations

import dataclasses
import glob
import os
import re
from collections.abc import Iterable, Iterator

from nodeguard.config import WorkloadGroup
from nodeguard.model.workloads import Container, QosClass, Workload

# cgroupfs driver: kubepods/[burstable|besteffort/]pod<uid>/<container id>
_CGROUPFS_POD = re.compile(r"pod([0-9a-fA-F-]{32,36})")
_CGROUPFS_TIERS = {"burstable": QosClass.BURSTABLE, "besteffort": QosClass.BEST_EFFORT}
# systemd driver: kubepods.slice/kubepods-<tier>.slice/kubepods-<tier>-pod<uid_with_underscores>.slice
_SYSTEMD_POD = re.compile(r"kubepods(?:-(burstable|besteffort))?-pod([0-9a-fA-F_]{32,36})\.slice")
_SYSTEMD_TIERS = {
    "kubepods-burstable.slice": QosClass.BURSTABLE,
    "kubepods-besteffort.slice": QosClass.BEST_EFFORT,
}
_HEX_ID = r"[0-9a-fA-F]{12,128}"
# A container's scope under either driver. CRI-O's sandbox is "crio-<id>" without
# ".scope"; its monitor "crio-conmon-<id>.scope" is not a container.
_CONTAINER = re.compile(
    rf"(?:(?P<runtime>cri-containerd|crio|docker)-(?P<id>{_HEX_ID})(?P<scope>\.scope)?|(?P<bare>{_HEX_ID}))"
)
_RUNTIME_NAMES = {"cri-containerd": "containerd", "crio": "crio", "docker": "docker"}
KUBEPODS_DIRS = ("kubepods", "kubepods.slice")


def _subdirs(path: str) -> Iterator[os.DirEntry[str]]:
    try:
        with os.scandir(path) as entries:
            yield from (e for e in entries if e.is_dir(follow_symlinks=False))
    except (FileNotFoundError, NotADirectoryError):
        return


def _created(path: str) -> float | None:
    try:
        return os.stat(path).st_ctime
    except OSError:
        return None


def parse_container_dir(name: str) -> tuple[str, str, bool] | None:
    """(id, runtime, is_sandbox) for a container cgroup's name, or None if it is not one."""
    match = _CONTAINER.fullmatch(name)
    if match is None:
        return None
    if match.group("bare"):
        return match.group("bare"), "", False
    runtime = _RUNTIME_NAMES[match.group("runtime")]
    sandbox = runtime == "crio" and not match.group("scope")
    return match.group("id"), runtime, sandbox


def _containers(tree: str, pod_rel: str) -> tuple[Container, ...]:
    found = []
    for entry in _subdirs(os.path.join(tree, pod_rel)):
        parsed = parse_container_dir(entry.name)
        if parsed is not None:
            cid, runtime, sandbox = parsed
            found.append(Container(cid, runtime, f"{pod_rel}/{entry.name}", sandbox))
    return tuple(sorted(found, key=lambda c: c.id))


def _pod(tree: str, rel: str, uid: str, qos: QosClass) -> Workload:
    return Workload(
        id=rel,
        name=f"pod/{uid}",
        kind="pod",
        qos_class=qos,
        pod_uid=uid,
        containers=_containers(tree, rel),
        started_at=_created(os.path.join(tree, rel)),
    )


def parse_pod_dir(name: str) -> tuple[str, QosClass | None] | None:
    """(uid, qos from the name where the name says it) for a pod cgroup's name."""
    if match := _CGROUPFS_POD.fullmatch(name):
        return match.group(1), None
    if match := _SYSTEMD_POD.fullmatch(name):
        tier = match.group(1)
        qos = QosClass.GUARANTEED if tier is None else _CGROUPFS_TIERS[tier]
        return match.group(2).replace("_", "-"), qos
    return None


def discover_pods(tree: str) -> Iterator[Workload]:
    """Pods under ``kubepods`` (cgroupfs driver) or ``kubepods.slice`` (systemd driver)."""
    for top in KUBEPODS_DIRS:
        for entry in _subdirs(os.path.join(tree, top)):
            tier = _CGROUPFS_TIERS.get(entry.name) or _SYSTEMD_TIERS.get(entry.name)
            if tier is not None:
                for pod in _subdirs(entry.path):
                    parsed = parse_pod_dir(pod.name)
                    if parsed is not None:
                        yield _pod(tree, f"{top}/{entry.name}/{pod.name}", parsed[0], tier)
                continue
            parsed = parse_pod_dir(entry.name)
            if parsed is not None:  # Guaranteed pods sit directly under kubepods
                yield _pod(tree, f"{top}/{entry.name}", parsed[0], QosClass.GUARANTEED)


def discover_groups(tree: str, groups: Iterable[WorkloadGroup]) -> Iterator[Workload]:
    """Configured workload groups: cgroup directories matching each glob."""
    prefix = tree.rstrip("/") + "/"
    for group in groups:
        for path in sorted(glob.glob(prefix + group.match)):
            if not os.path.isdir(path) or os.path.islink(path):
                continue
            rel = path[len(prefix) :]
            yield Workload(
                id=rel,
                name=rel,
                kind="group",
                qos_class=group.class_,
                priority=group.priority,
                protected=group.protected,
                started_at=_created(path),
            )


def discover(tree: str, groups: Iterable[WorkloadGroup], kubepods: bool = True) -> dict[str, Workload]:
    """All workloads by id; a pod wins over a group pattern that matches it too."""
    found: dict[str, Workload] = {}
    for workload in discover_groups(tree, groups):
        found.setdefault(workload.id, workload)
    if kubepods:
        for workload in discover_pods(tree):
            found[workload.id] = workload
    return found


def own_cgroup_path(proc_self_cgroup: str, version: str) -> str | None:
    """nodeguard's own cgroup, relative to the hierarchy root, from /proc/self/cgroup text.

    None when it cannot be told (a cgroup namespace shows "/").
    """
    for line in proc_self_cgroup.splitlines():
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        hierarchy, controllers, path = parts
        is_v2 = hierarchy == "0" and controllers == ""
        if (version == "v2" and is_v2) or (version == "v1" and "cpu" in controllers.split(",")):
            path = path.strip().strip("/")
            return path or None
    return None


def protect_self(found: dict[str, Workload], own_path: str | None, own_pod_uid: str | None) -> dict[str, Workload]:
    """Mark the workload nodeguard itself runs in as protected: it must never throttle or evict itself."""
    for wid, workload in found.items():
        inside = own_path is not None and (own_path == wid or own_path.startswith(wid + "/"))
        if (inside or (own_pod_uid is not None and workload.pod_uid == own_pod_uid)) and not workload.protected:
            found[wid] = dataclasses.replace(workload, protected=True)
    return found
