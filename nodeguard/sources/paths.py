"""Where the cgroup hierarchies are: pure v2, or v1 controllers (maybe beside a v2 mount)."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Literal

from nodeguard.errors import NodeguardError


@dataclass(frozen=True, slots=True)
class CgroupLayout:
    """The hierarchies below a cgroup root.

    ``tree`` is the hierarchy whose directories define the workloads: the v2
    mount, or the v1 cpu hierarchy. On hybrid hosts ``unified`` is the v2 mount
    beside the v1 controllers (PSI can be read there).
    """

    version: Literal["v1", "v2"]
    root: str
    tree: str
    unified: str | None
    cpu: str | None = None
    cpuacct: str | None = None
    memory: str | None = None

    @property
    def writable(self) -> str:
        """The hierarchy whose CPU limit files nodeguard writes: the v2 tree or the v1 cpu hierarchy."""
        if self.version == "v2":
            return self.tree
        assert self.cpu is not None
        return self.cpu


class LayoutError(NodeguardError):
    """No usable cgroup hierarchy under the configured root."""


def _first_dir(root: str, names: tuple[str, ...]) -> str | None:
    for name in names:
        path = os.path.join(root, name)
        if os.path.isdir(path):
            return path
    return None


def detect_layout(root: str, prefer: Literal["auto", "v1", "v2"] = "auto") -> CgroupLayout:
    """Find the hierarchies under ``root``; ``prefer`` picks one on a hybrid host."""
    root = os.path.realpath(root)
    if os.path.exists(os.path.join(root, "cgroup.controllers")):
        if prefer == "v1":
            raise LayoutError(f"{root} is a cgroup v2 mount; there is no v1 hierarchy")
        return CgroupLayout("v2", root, root, root)
    unified = _first_dir(root, ("unified",))
    if unified and not os.path.exists(os.path.join(unified, "cgroup.controllers")):
        unified = None
    cpu = _first_dir(root, ("cpu,cpuacct", "cpu"))
    cpuacct = _first_dir(root, ("cpu,cpuacct", "cpuacct"))
    memory = _first_dir(root, ("memory",))
    if prefer == "v2" or (prefer == "auto" and cpu is None):
        if unified is None:
            raise LayoutError(f"no cgroup hierarchy found under {root}")
        return CgroupLayout("v2", root, unified, unified)
    if cpu is None or cpuacct is None:
        raise LayoutError(f"no cgroup v1 cpu and cpuacct hierarchies under {root}")
    return CgroupLayout("v1", root, cpu, unified, cpu=cpu, cpuacct=cpuacct, memory=memory)
