"""Child cgroups in this machine's real hierarchies, with busy processes, for tests and benchmarks."""

from __future__ import annotations

import contextlib
import os
import select
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from nodeguard.model.samples import CpuMax
from nodeguard.scratch_cgroups import remove_cgroup_dir
from nodeguard.sources.cgroupfs import parse_cfs_quota, parse_cpu_max, shares_to_weight

CGROUP_ROOT = Path("/sys/fs/cgroup")
BUSY_LOOP = "while True: pass"
SHELL_BUSY_LOOP = "while :; do :; done"
# Prepended to a process's code when its start is awaited (wait_started): one byte on its stdout once its
# interpreter is up, just before its loop. Under emulation an interpreter takes about a second to start.
ANNOUNCE = "import os; os.write(1, b'.')\n"


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


def start_in(groups: tuple[Path, ...], code: str, *args: str, announce: bool = False) -> subprocess.Popen[bytes]:
    """``python -c code args`` placed in every given group (one per hierarchy); ``announce``: see ANNOUNCE."""
    code = ANNOUNCE + code if announce else code
    return _placed(subprocess.Popen([sys.executable, "-c", code, *args], stdout=subprocess.PIPE if announce else None),
                   groups)  # fmt: skip


def start_busy(*groups: Path, announce: bool = False) -> subprocess.Popen[bytes]:
    """A real CPU-burning process placed in every given group (one per hierarchy)."""
    return start_in(groups, BUSY_LOOP, announce=announce)


def wait_started(procs: list[subprocess.Popen[bytes]], timeout: float) -> None:
    """Until every process started with ``announce`` is in its loop; fails when one exits or is late."""
    deadline = time.monotonic() + timeout
    for proc in procs:
        if proc.stdout is None:
            continue
        ready, _, _ = select.select([proc.stdout], [], [], max(0.0, deadline - time.monotonic()))
        assert ready, f"process {proc.pid} not started within {timeout:g} s"
        assert os.read(proc.stdout.fileno(), 1) == b".", f"process {proc.pid} exited with {proc.wait()}"


def start_shell_busy(*groups: Path, announce: bool = False) -> subprocess.Popen[bytes]:
    """A shell loop burning CPU from its first millisecond, placed in every given group; ``announce``: one byte
    on its stdout, as ANNOUNCE. Six burners started at once need no six interpreters: seconds of the emulated VM."""
    script = f"printf .; {SHELL_BUSY_LOOP}" if announce else SHELL_BUSY_LOOP
    return _placed(subprocess.Popen(["/bin/sh", "-c", script], stdout=subprocess.PIPE if announce else None), groups)


def _placed(proc: subprocess.Popen[bytes], groups: tuple[Path, ...]) -> subprocess.Popen[bytes]:
    """``proc`` moved into every given group."""
    for group in groups:
        (group / "cgroup.procs").write_text(str(proc.pid))
    return proc


def stop(proc: subprocess.Popen[bytes]) -> None:
    proc.kill()
    proc.wait()
    if proc.stdout is not None:
        proc.stdout.close()


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


@dataclass
class Hierarchy:
    """Where a test's cgroups live: the v1 cpu (+ cpuacct) hierarchies on this host, or a v2 mount."""

    version: str
    roots: list[Path]  # the writable hierarchy first (v1: cpu, then cpuacct when separate)

    @property
    def writable(self) -> Path:
        return self.roots[0]

    def dirs(self, rel: str) -> list[Path]:
        return [root / rel for root in self.roots]

    def limit(self, rel: str) -> CpuMax:
        group = self.writable / rel
        if self.version == "v2":
            return parse_cpu_max((group / "cpu.max").read_text())
        return parse_cfs_quota((group / "cpu.cfs_quota_us").read_text(), (group / "cpu.cfs_period_us").read_text())

    def held_rate(self, rel: str) -> float | None:
        """The CPU rate in force for a group, in cores (None: unlimited): its own limit, or its direct children's
        together where each has one (a v1 pod held through its containers)."""
        own = self.limit(rel).cores
        children = [p for p in (self.writable / rel).iterdir() if p.is_dir()]
        limits = [self.limit(str(p.relative_to(self.writable))).cores for p in children]
        through = None if not limits or any(c is None for c in limits) else sum(c for c in limits if c is not None)
        rates = [r for r in (own, through) if r is not None]
        return min(rates) if rates else None

    def set_limit(self, rel: str, limit: CpuMax) -> None:
        """Write a limit as kubelet or a runtime would (v1: period, then quota)."""
        group = self.writable / rel
        if self.version == "v2":
            (group / "cpu.max").write_text(limit.render_v2())
            return
        if limit.period_us != parse_cfs_quota("-1", (group / "cpu.cfs_period_us").read_text()).period_us:
            (group / "cpu.cfs_period_us").write_text(str(limit.period_us))
        (group / "cpu.cfs_quota_us").write_text(str(-1 if limit.quota_us is None else limit.quota_us))

    @property
    def weight_file(self) -> str:
        """The CPU weight kubelet writes: cpu.shares on v1, cpu.weight on v2."""
        return "cpu.shares" if self.version == "v1" else "cpu.weight"

    def kubelet_weight(self, shares: int) -> int:
        """A weight in cpu.shares as kubelet writes it here (v2: converted to cpu.weight)."""
        return shares if self.version == "v1" else shares_to_weight(shares)

    def weight(self, rel: str) -> int:
        return int((self.writable / rel / self.weight_file).read_text())

    def set_shares(self, rel: str, shares: int) -> None:
        (self.writable / rel / self.weight_file).write_text(str(self.kubelet_weight(shares)))

    @contextlib.contextmanager
    def groups(self, *rels: str) -> Iterator[None]:
        """Create the groups in every hierarchy (v2: with the cpu controller enabled down to them)."""
        if self.version == "v1":
            with cgroups(*[d for rel in rels for d in self.dirs(rel)]):
                yield
            return
        made = sorted({p for rel in rels for p in [rel, *[str(q) for q in Path(rel).parents if str(q) != "."]]},
                      key=lambda p: p.count("/"))  # fmt: skip
        with cgroups(*[self.writable / rel for rel in made]):
            for rel in made:
                if any(other.startswith(rel + "/") for other in made):
                    (self.writable / rel / "cgroup.subtree_control").write_text("+cpu")
            yield


def v1_cpu_hierarchy() -> Hierarchy:
    import pytest

    reason = why_no_v1_cpu()
    if reason:
        pytest.skip(reason)
    cpu, cpuacct = v1_hierarchy("cpu"), v1_hierarchy("cpuacct")
    assert cpu is not None and cpuacct is not None
    return Hierarchy("v1", [cpu] if cpu == cpuacct else [cpu, cpuacct])


def v2_cpu_hierarchy() -> Hierarchy:
    mount = v2_mount()
    assert mount is not None
    return Hierarchy("v2", [mount])


@dataclass
class KubeletPod:
    """A pod as kubelet lays it out: pod cgroup, a sandbox, a container (crun puts its processes in a
    ``container`` subgroup), with CPU limits written at the pod and the container level."""

    hierarchy: Hierarchy
    pod: str
    sandbox: str
    container: str
    inner: str

    def start_busy(self, announce: bool = False) -> subprocess.Popen[bytes]:
        return start_busy(*self.hierarchy.dirs(self.inner), announce=announce)


def pod_uid() -> str:
    return str(uuid.uuid4())


@contextlib.contextmanager
def kubelet_pod(hierarchy: Hierarchy, parent: str, tier: str | None, limit: CpuMax | None) -> Iterator[KubeletPod]:
    """A pod under ``parent``/kubepods[/tier]; ``limit`` on the pod and its container, as kubelet writes them."""
    base = f"{parent}/kubepods" + (f"/{tier}" if tier else "")
    pod = f"{base}/pod{pod_uid()}"
    sandbox, container = f"{pod}/{uuid.uuid4().hex * 2}", f"{pod}/{uuid.uuid4().hex * 2}"
    inner = f"{container}/container"
    with hierarchy.groups(sandbox, inner):
        if limit is not None:
            hierarchy.set_limit(pod, limit)  # the parent first: v1 refuses a child above it
            hierarchy.set_limit(container, limit)
        # The runtime's weights: the sandbox (pause) container at the least, the container at its request (here
        # its limit, or 0.1 core without one), as kubelet converts them.
        hierarchy.set_shares(sandbox, 2)
        cores = 0.1 if limit is None or limit.cores is None else limit.cores
        hierarchy.set_shares(container, max(2, round(cores * 1024)))
        yield KubeletPod(hierarchy, pod, sandbox, container, inner)
