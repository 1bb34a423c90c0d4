"""Child cgroups in this machine's real hierarchies, with busy processes, for tests and benchmarks."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from nodeguard.surfaces.demo import remove_cgroup_dir

CGROUP_ROOT = Path("/sys/fs/cgroup")
BUSY_LOOP = "while True: pass"


def v2_mount() -> Path | None:
    """The cgroup2 mount: the root on a pure v2 host, ``unified`` on a hybrid one."""
    for candidate in (CGROUP_ROOT, CGROUP_ROOT / "unified"):
        if (candidate / "cgroup.controllers").exists():
            return candidate
    return None


def v1_hierarchy(controller: str) -> Path | None:
    for name in (controller, "cpu,cpuacct"):
        path = CGROUP_ROOT / name
        if path.is_dir() and (path / "cgroup.procs").exists() and not (path / "cgroup.controllers").exists():
            if controller == "cpu" and not (path / "cpu.cfs_quota_us").exists():
                continue
            if controller == "cpuacct" and not (path / "cpuacct.usage").exists():
                continue
            return path
    return None


def why_no_v1_cpu() -> str | None:
    if os.geteuid() != 0:
        return "creating cgroups needs root"
    if v1_hierarchy("cpu") is None or v1_hierarchy("cpuacct") is None:
        return "this host has no cgroup v1 cpu and cpuacct hierarchies"
    return None


def why_no_v2() -> str | None:
    if os.geteuid() != 0:
        return "creating cgroups needs root"
    if v2_mount() is None:
        return "this host has no cgroup2 mount"
    return None


# Where a cgroup v2 test runs: this host's cgroup2 mount beside the v1 controllers
# ("hybrid"), and a pure cgroup v2 kernel with every controller ("pure", the
# ``kernel`` mark: inside the QEMU VM). Each machine runs each behaviour once.
V2_KINDS = ["hybrid", pytest.param("pure", marks=pytest.mark.kernel)]


def why_no_v2_of(kind: str) -> str | None:
    """Why a test of this kind of v2 tree cannot run here (the ``kernel`` mark skips "pure" off a pure v2 host)."""
    if reason := why_no_v2():
        return reason
    if kind == "hybrid" and v2_mount() == CGROUP_ROOT:
        return "a pure cgroup v2 host: the kernel-marked 'pure' variant of this test covers it"
    return None


def unique_name(prefix: str = "ngtest") -> str:
    return f"{prefix}-{os.getpid()}-{uuid.uuid4().hex[:8]}"


def remove_cgroup(path: Path) -> None:
    """Kill what is inside (children first) and remove the directory tree."""
    if not path.exists():
        return
    for child in sorted((p for p in path.rglob("*") if p.is_dir()), key=lambda p: -len(p.parts)):
        remove_cgroup(child)
    kill_file = path / "cgroup.kill"
    with contextlib.suppress(OSError):
        if kill_file.exists():
            kill_file.write_text("1")
    if not remove_cgroup_dir(path):
        path.rmdir()  # raises what keeps it


@contextlib.contextmanager
def cgroups(*paths: Path) -> Iterator[list[Path]]:
    """Create the groups (and parents), remove them all afterwards even on failure."""
    created: list[Path] = []
    try:
        for path in paths:
            for parent in reversed([path, *path.parents]):
                if not parent.exists():
                    parent.mkdir()
                    created.append(parent)
        yield list(paths)
    finally:
        for path in reversed(created):
            remove_cgroup(path)


def start_busy(*groups: Path) -> subprocess.Popen[bytes]:
    """A real CPU-burning process placed in every given group (one per hierarchy)."""
    proc = subprocess.Popen([sys.executable, "-c", BUSY_LOOP])
    for group in groups:
        (group / "cgroup.procs").write_text(str(proc.pid))
    return proc


def stop(proc: subprocess.Popen[bytes]) -> None:
    proc.kill()
    proc.wait()


@dataclass(frozen=True)
class V1Group:
    """One workload's groups in the v1 cpu and cpuacct hierarchies (one directory when they are joined)."""

    name: str
    cpu: Path
    cpuacct: Path
    dirs: list[Path]


@contextlib.contextmanager
def v1_cpu_group() -> Iterator[V1Group]:
    """A fresh group in this host's v1 cpu (and cpuacct) hierarchy; skips the test where there is none."""
    reason = why_no_v1_cpu()
    if reason:
        pytest.skip(reason)
    cpu, cpuacct = v1_hierarchy("cpu"), v1_hierarchy("cpuacct")
    assert cpu is not None and cpuacct is not None
    name = unique_name()
    dirs = [cpu / name] if cpu == cpuacct else [cpu / name, cpuacct / name]
    with cgroups(*dirs):
        yield V1Group(name, cpu / name, cpuacct / name, dirs)
