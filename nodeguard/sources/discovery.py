"""Finding workloads: Kubernetes pod cgroups wherever kubelet puts them, and configured groups.

kubelet names a pod's cgroup by a list of names: its ``--cgroup-root`` parts,
then ``kubepods``, the QoS tier (none for Guaranteed) and ``pod<uid>``. The
cgroupfs driver joins them with ``/`` (``kubepods/burstable/pod<uid>``); the
systemd driver makes each level a slice named by every name so far joined with
``-``, dashes inside a name becoming ``_``
(``kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod<uid_>.slice``).
A ``--cgroup-root`` of ``/kubelet`` (kind) thus gives
``kubelet.slice/kubelet-kubepods.slice/kubelet-kubepods-burstable.slice/…``.
The kubepods top level is configured, or found by a bounded search.
"""

from __future__ import annotations

import dataclasses
import glob
import os
import re
from collections.abc import Iterable, Iterator, Sequence
from typing import NamedTuple

from nodeguard.log import get_logger
from nodeguard.model.workloads import OWN_WORKLOAD, Container, QosClass, Workload, is_kubepods_top
from nodeguard.sources.settings import WorkloadGroup

log = get_logger("nodeguard.discovery")

_TIERS = {"burstable": QosClass.BURSTABLE, "besteffort": QosClass.BEST_EFFORT}
_CGROUPFS_POD = re.compile(r"pod([0-9a-fA-F-]{32,36})")
# Any --cgroup-root prefix ("kubelet-" in kind) before kubepods.
_SYSTEMD_POD = re.compile(r"(?:.+-)?kubepods(?:-(burstable|besteffort))?-pod([0-9a-fA-F_]{32,36})\.slice")
_HEX_ID = r"[0-9a-fA-F]{12,128}"
# A container's cgroup: "<runtime>-<id>.scope" (systemd driver), "crio-<id>"
# (CRI-O, cgroupfs driver; or its sandbox, either driver), "libpod-<id>"
# (podman, cgroupfs manager), or a bare id (containerd and docker, cgroupfs driver).
_CONTAINER = re.compile(
    rf"(?:(?P<runtime>cri-containerd|crio|docker|libpod)-(?P<id>{_HEX_ID})(?P<scope>\.scope)?|(?P<bare>{_HEX_ID}))"
)
# The monitor of one container, beside it: not a container. CRI-O's
# crio-conmon-<id>[.scope]; podman's libpod-conmon-<id>.scope (systemd manager;
# its cgroupfs manager puts every monitor in one "conmon" child, no container
# by its name either).
_CONMON = re.compile(rf"(?:crio|libpod)-conmon-({_HEX_ID})(?:\.scope)?")
_RUNTIME_NAMES = {"cri-containerd": "containerd", "crio": "crio", "docker": "docker", "libpod": "podman"}

# The search for the kubepods top level: how deep below the root it looks
# (kind seen from its host: system.slice/docker-<id>.scope/kubelet.slice/kubelet-kubepods.slice),
# and what it never walks into: login sessions and PID 1, units that hold no
# cgroups, and directories with so many children that they hold workloads,
# not a kubelet root (their children's names are still looked at).
SEARCH_DEPTH = 4
SEARCH_FANOUT = 256
_SEARCH_SKIP = frozenset({"user.slice", "init.scope"})
_SEARCH_SKIP_SUFFIXES = (".mount", ".socket", ".swap", ".device")


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


def _join(parent: str, name: str) -> str:
    return f"{parent}/{name}" if parent else name


def find_kubepods(tree: str, depth: int = SEARCH_DEPTH) -> tuple[str, ...]:
    """The kubepods top levels nearest to the root, at most ``depth`` levels down; () when none.

    Breadth first, so a node's usual ``kubepods``/``kubepods.slice`` costs one
    directory listing; the search stops at the first level with a match.
    """
    level = [""]
    for current in range(1, depth + 1):
        found: list[str] = []
        below: list[str] = []
        for parent in level:
            names = [entry.name for entry in _subdirs(os.path.join(tree, parent))]
            descend = current < depth and len(names) <= SEARCH_FANOUT
            for name in names:
                if is_kubepods_top(name):
                    found.append(_join(parent, name))
                elif descend and name not in _SEARCH_SKIP and not name.endswith(_SEARCH_SKIP_SUFFIXES):
                    below.append(_join(parent, name))
        if found:
            return tuple(sorted(found))
        level = below
    return ()


def kubepods_tops(tree: str, configured: Sequence[str] = ()) -> tuple[str, ...]:
    """The kubepods top levels: the configured paths that exist, or else those the search finds."""
    if configured:
        return tuple(path for path in configured if os.path.isdir(os.path.join(tree, path)))
    return find_kubepods(tree)


class KubepodsLocator:
    """Finds the kubepods top levels at each discovery and logs where they are when that changes."""

    def __init__(self) -> None:
        self.tops: tuple[str, ...] = ()
        self._missing: tuple[str, ...] = ()

    def locate(self, tree: str, configured: Sequence[str] = ()) -> tuple[str, ...]:
        tops = kubepods_tops(tree, configured)
        missing = tuple(path for path in configured if path not in tops)
        if missing != self._missing and missing:
            log.warning("configured kubepods cgroup not found", paths=list(missing), root=tree)
        if tops != self.tops:
            log.info("kubepods cgroups", paths=list(tops), configured=bool(configured), root=tree)
        self.tops, self._missing = tops, missing
        return tops


def _tier_dirs(top: str) -> dict[str, QosClass]:
    """The names of the tier cgroups directly under a kubepods top level."""
    name = os.path.basename(top)
    if name.endswith(".slice"):
        stem = name[: -len(".slice")]
        return {f"{stem}-{tier}.slice": qos for tier, qos in _TIERS.items()}
    return dict(_TIERS)


def discover_tiers(tree: str, tops: Sequence[str]) -> dict[QosClass, tuple[str, ...]]:
    """The QoS tier cgroups (Burstable, BestEffort) under each kubepods top level, by class.

    Tiers are never workloads. Guaranteed pods have no tier: they sit in the top level itself.
    """
    found: dict[QosClass, list[str]] = {}
    for top in tops:
        for name, qos in _tier_dirs(top).items():
            if os.path.isdir(os.path.join(tree, top, name)):
                found.setdefault(qos, []).append(f"{top}/{name}")
    return {qos: tuple(paths) for qos, paths in found.items()}


class ContainerName(NamedTuple):
    id: str
    runtime: str  # containerd, crio, docker, or "" for a bare id
    scope: bool  # a systemd scope (".scope")


def parse_container_dir(name: str) -> ContainerName | None:
    """What a container cgroup's name says, or None when it is not one (conmon, crun's ``container``)."""
    match = _CONTAINER.fullmatch(name)
    if match is None:
        return None
    if match.group("bare"):
        return ContainerName(match.group("bare"), "", False)
    return ContainerName(match.group("id"), _RUNTIME_NAMES[match.group("runtime")], bool(match.group("scope")))


def containers_in(pod_rel: str, names: Iterable[str]) -> tuple[Container, ...]:
    """The containers among a pod cgroup's child names, the pod's sandbox marked where the layout tells it.

    CRI-O gives a pod whose infra container it drops (no shared PID namespace,
    the default) an empty ``crio-<sandbox id>`` cgroup, without ``.scope`` under
    either driver, and starts a ``crio-conmon-<id>`` monitor beside every
    container it runs. So a ``crio-<id>`` that is not a scope and has no monitor
    is the sandbox; with the cgroupfs driver no container is a scope, and the
    monitor is what tells them apart. containerd's and docker's pause containers
    have names like any other container and are not told apart.
    """
    listed = list(names)
    monitored = {m.group(1) for name in listed if (m := _CONMON.fullmatch(name))}
    found = []
    for name in listed:
        parsed = parse_container_dir(name)
        if parsed is not None:
            sandbox = parsed.runtime == "crio" and not parsed.scope and parsed.id not in monitored
            found.append(Container(parsed.id, parsed.runtime, f"{pod_rel}/{name}", sandbox))
    return tuple(sorted(found, key=lambda c: c.id))


def _pod(tree: str, rel: str, uid: str, qos: QosClass) -> Workload:
    """A pod as its cgroup shows it: its UID and QoS class, no metadata (kubernetes.metadata lays that over)."""
    path = os.path.join(tree, rel)
    return Workload(
        id=rel,
        name=f"pod/{uid}",
        kind="pod",
        qos_class=qos,
        pod_uid=uid,
        containers=containers_in(rel, (entry.name for entry in _subdirs(path))),
        started_at=_created(path),
        metadata_known=False,
    )


def parse_pod_dir(name: str) -> tuple[str, QosClass | None] | None:
    """(uid, qos from the name where the name says it) for a pod cgroup's name, either driver."""
    if match := _CGROUPFS_POD.fullmatch(name):
        return match.group(1), None
    if match := _SYSTEMD_POD.fullmatch(name):
        tier = match.group(1)
        qos = QosClass.GUARANTEED if tier is None else _TIERS[tier]
        return match.group(2).replace("_", "-"), qos
    return None


def discover_pods(tree: str, tops: Sequence[str] | None = None) -> Iterator[Workload]:
    """Pods under each kubepods top level (searched for when ``tops`` is None)."""
    for top in find_kubepods(tree) if tops is None else tops:
        tiers = _tier_dirs(top)
        for entry in _subdirs(os.path.join(tree, top)):
            tier = tiers.get(entry.name)
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
    for index, group in enumerate(groups):
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
                protected_by=f"workloads.groups[{index}].protected" if group.protected else None,
                started_at=_created(path),
            )


def discover(tree: str, groups: Iterable[WorkloadGroup], tops: Sequence[str] | None = None) -> dict[str, Workload]:
    """All workloads by id: pods under ``tops`` (None: searched for; (): no pods) and configured groups.

    A pod wins over a group pattern that matches it too; a kubepods top level or
    tier a pattern matches is no workload.
    """
    found: dict[str, Workload] = {}
    if tops is None:
        tops = find_kubepods(tree)
    kubelet_own = set(tops).union(*discover_tiers(tree, tops).values())
    for workload in discover_groups(tree, groups):
        if workload.id not in kubelet_own:
            found.setdefault(workload.id, workload)
    for workload in discover_pods(tree, tops):
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
        if inside or (own_pod_uid is not None and workload.pod_uid == own_pod_uid):
            found[wid] = dataclasses.replace(workload, protected=True, protected_by=OWN_WORKLOAD)
    return found
