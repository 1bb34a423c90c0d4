"""Scratch cgroups: groups nodeguard creates for itself, for ``nodeguard demo`` and for the tests.

The one place outside ``actuators/`` that changes cgroups, and only its own:
it creates a parent group named after this process, moves the processes it
starts into children of it, and at the end kills them and removes every
group it created. It never touches a group it did not create.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from nodeguard.sources.cgroupfs import parse_pids


@dataclass
class ScratchCgroups:
    """Groups nodeguard makes for itself (the demo's, the tests'): one directory per hierarchy for each workload."""

    root: Path  # the cgroup mount nodeguard reads (v2 mount, or /sys/fs/cgroup on v1)
    version: str
    parent: str
    dirs: dict[str, list[Path]] = field(default_factory=dict)

    @property
    def created(self) -> list[Path]:
        return [d for ds in self.dirs.values() for d in ds]


def _writable_v2(root: Path) -> bool:
    try:
        return "cpu" in (root / "cgroup.controllers").read_text().split() and os.access(root, os.W_OK)
    except OSError:
        return False


def plan_cgroups(names: list[str], prefix: str, cgroup_root: Path = Path("/sys/fs/cgroup")) -> ScratchCgroups | str:
    """Where groups that really throttle can be created, or why they cannot."""
    parent = f"{prefix}-{os.getpid()}"
    if os.geteuid() != 0:
        return "creating cgroups needs root"
    if _writable_v2(cgroup_root):
        return ScratchCgroups(cgroup_root, "v2", parent, {n: [cgroup_root / parent / n] for n in names})
    cpu, cpuacct = cgroup_root / "cpu", cgroup_root / "cpuacct"
    if (cpu / "cpu.cfs_quota_us").exists() and (cpuacct / "cpuacct.usage").exists():
        hierarchies = [cpu] if cpu.resolve() == cpuacct.resolve() else [cpu, cpuacct]
        return ScratchCgroups(cgroup_root, "v1", parent, {n: [h / parent / n for h in hierarchies] for n in names})
    return "no cgroup hierarchy here can limit CPU (no cgroup v2 cpu controller, no v1 cpu hierarchy)"


def remove_cgroup_dir(path: Path) -> bool:
    """Kill what runs in the cgroup and remove its childless directory, retrying while it empties.

    False: it is still there.
    """
    for _ in range(200):
        try:
            for pid in parse_pids((path / "cgroup.procs").read_text()):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            path.rmdir()
            return True
        except FileNotFoundError:
            return True
        except OSError:
            time.sleep(0.01)
    return False


@contextlib.contextmanager
def created(
    groups: ScratchCgroups, programs: dict[str, str], args: dict[str, list[str]] | None = None
) -> Iterator[list[subprocess.Popen[bytes]]]:
    """Create the groups and start each one's Python program (with its ``args``) in it; kill and remove
    everything after."""
    procs: list[subprocess.Popen[bytes]] = []
    parents = sorted({d.parent for d in groups.created})
    try:
        for parent in parents:
            parent.mkdir()
            if groups.version == "v2":
                (parent / "cgroup.subtree_control").write_text("+cpu")
        for directory in groups.created:
            directory.mkdir()
        for name, dirs in groups.dirs.items():
            proc = subprocess.Popen([sys.executable, "-c", programs[name], *(args or {}).get(name, [])])
            procs.append(proc)
            for directory in dirs:
                (directory / "cgroup.procs").write_text(str(proc.pid))
        yield procs
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()
        for directory in groups.created:
            remove_cgroup_dir(directory)
        for parent in parents:
            remove_cgroup_dir(parent)
