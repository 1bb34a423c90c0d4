"""Benchmark: the search for kubelet's kubepods cgroup, and discovery as a whole.

Discovery runs every ``sensing.discoverySeconds`` (5 s by default), not every
tick. Times, as the median of repeated passes:
- the search on this machine's real cgroup trees as they are;
- on synthetic node shapes built of real cgroups in the cgroup2 mount (a
  temporary directory where there is none): a plain host without kubelet (the
  whole bounded search), kind's nodes seen from their host (kubepods four
  levels down), and a usual node (``kubepods.slice`` at the root), the last
  two with 500 pods of three containers each.
Prints one JSON object last.
"""

from __future__ import annotations

import contextlib
import json
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.common import rc, stop_cleanly_on_sigterm
from nodeguard.sources.discovery import discover, find_kubepods
from nodeguard.sources.paths import detect_layout

PASSES = 20
PODS = 500
CONTAINERS = 3


def median_us(fn: Callable[[], object]) -> float:
    times = []
    for _ in range(PASSES):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return round(statistics.median(times) * 1e6, 1)


def plain_host(base: str) -> list[str]:
    services = [f"{base}/system.slice/svc-{i:03d}.service" for i in range(200)]
    sessions = [f"{base}/user.slice/user-{u}.slice/session-{s}.scope" for u in range(20) for s in range(5)]
    machines = [f"{base}/machine.slice/vm-{i}.scope" for i in range(10)]
    return [*services, *sessions, *machines, f"{base}/init.scope"]


def pods(top: str, stem: str) -> list[str]:
    paths = []
    for p in range(PODS):
        pod = f"{top}/{stem}-burstable.slice/{stem}-burstable-pod{p:08x}_0000_0000_0000_000000000000.slice"
        paths += [f"{pod}/cri-containerd-{p:08x}{c:056x}.scope" for c in range(CONTAINERS)]
    return paths


@contextlib.contextmanager
def tree() -> Iterator[tuple[Path, str]]:
    """A parent directory for the synthetic trees: real cgroups where possible."""
    mount = rc.v2_mount() if rc.why_no_v2() is None else None
    if mount is not None:
        parent = mount / rc.unique_name("ngbench-discovery")
        with rc.cgroups(parent):
            yield parent, "cgroup2"
    else:
        with tempfile.TemporaryDirectory() as tmp:
            yield Path(tmp), "tmpdir"


@contextlib.contextmanager
def build(parent: Path, relative: list[str]) -> Iterator[None]:
    """The directories (with their parents), removed afterwards."""
    paths = [parent / r for r in relative]
    if parent.is_relative_to(rc.CGROUP_ROOT):
        with rc.cgroups(*paths):
            yield
        return
    for path in paths:
        path.mkdir(parents=True, exist_ok=True)
    yield


def count_dirs(root: Path) -> int:
    return sum(len(dirs) for _, dirs, _ in os.walk(root))


def main() -> int:
    result: dict[str, object] = {}
    layout = detect_layout("/sys/fs/cgroup")
    real = {"tree": layout.tree, **({"unified": layout.unified} if layout.unified else {})}
    for name, root in real.items():
        result[f"real_{name}_search_us"] = median_us(lambda root=root: find_kubepods(root))
        result[f"real_{name}_dirs"] = count_dirs(Path(root))
    with tree() as (parent, kind):
        result["synthetic_in"] = kind
        shapes = {
            "plain_host": plain_host("plain"),
            "kind_from_host": [*plain_host("host"), *pods(
                "host/system.slice/docker-1.scope/kubelet.slice/kubelet-kubepods.slice", "kubelet-kubepods")],
            "usual_node": [*plain_host("node"), *pods("node/kubepods.slice", "kubepods")],
        }  # fmt: skip
        for shape, relative in shapes.items():
            with build(parent, relative):
                root = str(parent / relative[0].split("/")[0])
                found = find_kubepods(root)
                result[f"{shape}_dirs"] = count_dirs(Path(root))
                result[f"{shape}_found"] = list(found)
                result[f"{shape}_search_us"] = median_us(lambda root=root: find_kubepods(root))
                if found:
                    assert len(discover(root, [], found)) == PODS
                    result[f"{shape}_discover_us_per_pod"] = round(
                        median_us(lambda root=root: discover(root, [])) / PODS, 2
                    )
            print(f"{shape}: {result[f'{shape}_dirs']} dirs, search {result[f'{shape}_search_us']} us", flush=True)
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    stop_cleanly_on_sigterm()
    raise SystemExit(main())
