"""Who a workload is: identity and importance, as discovered or configured."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from types import MappingProxyType
from typing import Literal


class QosClass(StrEnum):
    """Kubernetes QoS classes, most important first; configured groups use them too."""

    GUARANTEED = "Guaranteed"
    BURSTABLE = "Burstable"
    BEST_EFFORT = "BestEffort"


# Lower rank = more important.
QOS_RANK = {QosClass.GUARANTEED: 0, QosClass.BURSTABLE: 1, QosClass.BEST_EFFORT: 2}


@dataclass(frozen=True, slots=True)
class Container:
    id: str
    runtime: str  # containerd, crio, docker, or "" for a cgroupfs-driver name
    path: str  # relative to the cgroup root
    sandbox: bool = False  # the pod's sandbox (pause) cgroup, where the runtime says so


# What ``Workload.protected_by`` says of nodeguard's own pod or cgroup (discovery.protect_self).
OWN_WORKLOAD = "nodeguard itself"
NO_LABELS: Mapping[str, str] = MappingProxyType({})


def _no_labels() -> Mapping[str, str]:
    return NO_LABELS


@dataclass(frozen=True, slots=True)
class Workload:
    """A cgroup nodeguard may watch or act on: a pod, or a configured group."""

    id: str  # the cgroup path relative to the root: unique and stable
    name: str
    kind: Literal["pod", "group"]
    qos_class: QosClass
    priority: int = 0
    protected: bool = False
    pod_uid: str | None = None
    containers: tuple[Container, ...] = ()
    started_at: float | None = None  # wall-clock seconds; None when unknown
    cpu_request_cores: float | None = None
    memory_request_bytes: int | None = None  # the floor of a memory throttle, with guard.memory.minHigh
    # False for a pod cgroup whose pod metadata nodeguard does not have: without the Kubernetes integration, or
    # a pod the API has not listed (yet). Never acted on unless guard.candidates.podsWithoutMetadata says so.
    metadata_known: bool = True
    protected_by: str | None = None  # what protects it (annotation, priority class, group config, ...), for people
    namespace: str | None = None  # a pod's, from its metadata; None for a configured group
    labels: Mapping[str, str] = field(default_factory=_no_labels)  # a pod's, from its metadata


def is_kubepods_top(name: str) -> bool:
    """Whether a cgroup's name is kubelet's top level: ``kubepods`` (cgroupfs driver) or
    ``[<cgroup-root>-]kubepods.slice`` (systemd driver)."""
    return name in ("kubepods", "kubepods.slice") or name.endswith("-kubepods.slice")
