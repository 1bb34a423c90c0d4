"""Pods in a real runtime's cgroups, as the container tests make and measure them: a fresh kubepods parent, a
container run in a pod, the CPU a group uses, and what the daemon's discovery finds."""

from __future__ import annotations

import contextlib
import json
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from tests.containers import runtime
from tests.containers.runtime import Podman
from tests.support import cgroups as rc

BURN = ["sh", "-c", "while :; do :; done"]


def host_hierarchy() -> rc.Hierarchy:
    """Where this host's CPU limits live: the v1 cpu hierarchy (hybrid hosts), else the cgroup2 mount."""
    if rc.why_no_v1_cpu() is None:
        return rc.v1_cpu_hierarchy()
    return rc.v2_cpu_hierarchy()


def usage_seconds(hierarchy: rc.Hierarchy, rel: str) -> float:
    """CPU time a cgroup has used: v1 cpuacct.usage, v2 cpu.stat usage_usec."""
    if hierarchy.version == "v1":
        return int((hierarchy.roots[-1] / rel / "cpuacct.usage").read_text()) / 1e9
    for line in (hierarchy.writable / rel / "cpu.stat").read_text().splitlines():
        key, _, value = line.partition(" ")
        if key == "usage_usec":
            return int(value) / 1e6
    raise AssertionError(f"no usage_usec in {rel}/cpu.stat")


def cores_used(hierarchy: rc.Hierarchy, rel: str, seconds: float) -> float:
    before, start = usage_seconds(hierarchy, rel), time.monotonic()
    time.sleep(seconds)  # a measurement window, not a synchronisation
    return (usage_seconds(hierarchy, rel) - before) / (time.monotonic() - start)


@contextlib.contextmanager
def kubepods_parent(podman: Podman) -> Iterator[tuple[str, list[str]]]:
    """A fresh top-level cgroup name for this test's kubepods, and the containers started in it; all removed after."""
    parent = rc.unique_name()
    with runtime.containers(podman) as names:
        try:
            yield parent, names
        finally:
            podman.remove(*names)
            names.clear()
            runtime.remove_everywhere(parent)


def pod_run(podman: Podman, names: list[str], image: str, pod: str, command: list[str], *options: str) -> str:
    name = f"{rc.unique_name()}-{Path(pod).name[:12]}"
    names.append(name)
    return podman.run(name, image, command, ["--cgroup-parent", f"/{pod}", *options])


def snapshot(config: dict[str, Any], tmp_path: Path) -> dict[str, Any]:
    """``nodeguard snapshot --json`` with this config: what the daemon's sensor discovers."""
    path = tmp_path / "snapshot.json"
    path.write_text(json.dumps(config))
    out = subprocess.run(
        [sys.executable, "-m", "nodeguard", "snapshot", "--json", "--config", str(path)],
        capture_output=True, text=True, timeout=60, check=True,
    ).stdout  # fmt: skip
    return dict(json.loads(out.splitlines()[-1]))


GATED = Path(__file__).with_name("gated")


def read_records(records: Path) -> dict[str, dict[str, float]]:
    """name -> {"start": t, "ready": t}: each container's own first record of each event."""
    found: dict[str, dict[str, float]] = {}
    for path in records.iterdir():
        for line in path.read_text().splitlines():
            event, at = line.split()
            found.setdefault(path.name, {}).setdefault(event, float(at))
    return found
