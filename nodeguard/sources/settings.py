"""What the sensing part reads, and which cgroups of a plain host are workloads: config sections."""

from __future__ import annotations

from pathlib import PurePosixPath
from typing import Annotated, Literal

from pydantic import AfterValidator, Field, WithJsonSchema, field_validator

from nodeguard.config_base import AbsolutePath, Model
from nodeguard.model.workloads import QosClass, is_kubepods_top


def _kubepods_path(value: str) -> str:
    path = value.strip("/")
    parts = path.split("/")
    if not path or ".." in parts or "." in parts or "" in parts:
        raise ValueError("expected a cgroup path below the root, without '..'")
    if not is_kubepods_top(parts[-1]):
        raise ValueError("expected kubelet's kubepods cgroup itself: a path ending in kubepods or kubepods.slice")
    return path


KubepodsPath = Annotated[
    str,
    AfterValidator(_kubepods_path),
    WithJsonSchema({"type": "string", "pattern": r"(^|/)(kubepods|kubepods\.slice|[^/]*-kubepods\.slice)/?$"}),
]


class SensingSettings(Model):
    cgroup_root: AbsolutePath = Field("/sys/fs/cgroup", description="cgroup mount (/host/sys/fs/cgroup in a pod)")
    proc_root: AbsolutePath = Field("/proc", description="proc mount (/host/proc in a pod without hostPID)")
    cgroup_version: Literal["auto", "v1", "v2"] = "auto"
    tick_seconds: float = Field(1.0, gt=0.01, le=3600)
    discovery_seconds: float = Field(5.0, gt=0, le=3600, description="how often to look for new workloads")
    kubepods: bool = Field(True, description="discover Kubernetes pod cgroups")
    kubepods_paths: list[KubepodsPath] = Field(
        [],
        description="kubelet's kubepods cgroups below the cgroup root, e.g. kubepods.slice or "
        "kubelet.slice/kubelet-kubepods.slice; empty: found by searching",
    )


class WorkloadGroup(Model):
    """Cgroups of a plain host that nodeguard treats as workloads."""

    match: str = Field(description="glob of cgroup paths below the root, e.g. system.slice/batch-*.service")
    class_: QosClass = Field(QosClass.BEST_EFFORT, alias="class")
    priority: int = Field(0, ge=-(2**31), le=2**31 - 1)
    protected: bool = False

    @field_validator("match")
    @classmethod
    def _relative_glob(cls, value: str) -> str:
        parts = PurePosixPath(value).parts
        if not parts or value.startswith("/") or ".." in parts:
            raise ValueError("expected a relative cgroup path pattern without '..'")
        return value


class WorkloadSettings(Model):
    groups: list[WorkloadGroup] = []
