"""Benchmark: memory.high before eviction, on a real cgroup v2 kernel (the QEMU VM), strategies side by side.

Runs in the VM only (cgroup v2's memory controller is not on the build hosts): the
host side boots it (tests/kernel/vm.py: 1 GiB, 2 vCPUs, no swap, Python 15-25x
slower under emulation) and prints the guest's figures. Pods are laid out and
weighted as kubelet does under a unique parent (Guaranteed 500m, Burstable
requesting 100m, BestEffort; cpu.weight converted from kubelet's cpu.shares),
the memory controller enabled down to them.

``growth``: a Guaranteed pod runs the latency probe of tests/support/workloads.py (a 4 ms
unit of CPU work every 10 ms; lateness per unit is its service level) beside a
BestEffort and a Burstable pod whose anonymous memory grows steadily (8 MiB
every 0.1 s each, touched) without end. The node's waterlines are set from
the memory in use at the start of each run (``baseline``): a throttle at
baseline + THROTTLE_MIB, an eviction at baseline + EVICT_MIB. Strategies, each on
fresh pods for ``--seconds``:

- none: nothing acts: the growth runs into the kernel's OOM killer;
- evict_only: the real daemon (``nodeguard run``) with today's evict objective;
- memory_throttle: the real daemon with the throttle objective (memory.high)
  below the same evict objective.

Figures per strategy: ``evictions`` (the daemon's "evicting" lines),
``oom_kills`` (the pods' memory.events), ``node_memory_max_pct`` (MemTotal -
MemAvailable, sampled every 0.1 s), ``batch_progress`` (MiB the growing pods
allocated in the window, relative to none's before the wall), and
``protected_p99_ratio`` (the probe's p99 lateness over its p99 alone, same run),
and ``restored_exactly`` (every memory.high back to "max" after the daemon's
SIGTERM). The daemon's start under emulation takes seconds: each daemon
strategy's window starts at its first tick.

``cache``: on a real block device (a raw ext2 image the VM sees as /dev/vda,
with the guest's own page cache; not tmpfs, not 9p), a Guaranteed pod re-reads
its working set (WORKING_SET_MIB in files, 64 KiB at random offsets every
5 ms, each read timed) while a BestEffort and a Burstable pod stream through
files of STREAM_MIB each, again and again. Each strategy runs on fresh pods
with the page cache dropped: the reader's working set read once, its window
alone (``alone_p99_ms``), then the streams for ``--seconds``. Strategies:

- none: nothing acts;
- memory_throttle: the real daemon with a protected_memory_stall objective
  (the Guaranteed pod's own memory.pressure "some").

Figures: ``protected_read_p99_ratio`` (p99 read time over the same run's alone
p99), ``protected_memory_stall_pct`` (the reader pod's memory.pressure "some"
over the window), ``batch_throughput_mb_s`` (what the streams read),
``batch_memory_stall_pct`` (the streaming pods' own, averaged), and for the
daemon ``memory_high_writes``, ``memory_high_restores`` (raised while the
streams still ran: the protected reader exposed again) and ``restored_exactly``.

The last line is one JSON object ``{"scenarios": {"growth": {...}, "cache": {...}}}``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.common import (  # noqa: E402
    CPU_UNITS,
    DaemonProcess,
    p99,
    probe_lateness,
    rc,
    run_in_vm,
    start_probe,
    stop_cleanly_on_sigterm,
    vm_available,
)

MiB = 1 << 20
ROOT = rc.CGROUP_ROOT
TICK = 0.5
THROTTLE_MIB = 256
RESTORE_MIB = 192
EVICT_MIB = 384
STRATEGIES = ("none", "evict_only", "memory_throttle")
CACHE_STRATEGIES = ("none", "memory_throttle")
SCENARIOS = ("growth", "cache")
DISK_MIB = 1536
WORKING_SET_MIB = 320  # in 8 files: with the streams, more than the page cache can hold
STREAM_MIB = 448  # per streaming pod: two of them are more than the VM's page cache
DISK = Path("/dev/vda")
MOUNT = Path("/mnt/ngmem")
READER = """
import os, random, sys, time
out = open(sys.argv[1], "a", buffering=1)
fds = [os.open(path, os.O_RDONLY) for path in sys.argv[2:]]
blocks = os.fstat(fds[0]).st_size // 65536
for _ in range(2):  # the working set, read twice: active in the page cache (a workingset refault is a stall)
    for fd in fds:
        for block in range(blocks):
            os.pread(fd, 65536, block * 65536)
out.write("# warm\\n")
rng = random.Random(1)
while True:
    fd = rng.choice(fds)
    offset = rng.randrange(blocks) * 65536
    start = time.monotonic()
    os.pread(fd, 65536, offset)
    out.write(f"{round(start * 1e6)} {round((time.monotonic() - start) * 1e6)}\\n")
    time.sleep(0.005)
"""
STREAMER = """
import os, sys
path, progress = sys.argv[1], open(sys.argv[2], "w", buffering=1)
total = 0
while True:
    fd = os.open(path, os.O_RDONLY)
    while block := os.read(fd, 1 << 20):
        total += len(block)
        if total % (8 << 20) == 0:
            progress.write(f"{total}\\n")
    os.close(fd)
"""
GROWER = """
import sys, time
progress = open(sys.argv[1], "w", buffering=1)
chunks = []
while len(chunks) < 256:  # 2 GiB: more than the VM has
    chunks.append(b"\\1" * (8 << 20))  # touched: anonymous memory, which no swap can take
    progress.write(f"{len(chunks) * 8}\\n")
    time.sleep(0.1)
time.sleep(3600)
"""


def node_memory() -> tuple[int, int]:
    """(total, in use) bytes: MemTotal and MemTotal - MemAvailable."""
    fields = {k: int(v.split()[0]) * 1024 for k, v in
              (line.split(":", 1) for line in Path("/proc/meminfo").read_text().splitlines())}  # fmt: skip
    return fields["MemTotal"], fields["MemTotal"] - fields["MemAvailable"]


@contextlib.contextmanager
def pods(parent: str) -> Iterator[dict[str, rc.KubeletPod]]:
    """A Guaranteed, a BestEffort and a Burstable pod, the memory controller enabled down to their processes."""
    hierarchy = rc.v2_cpu_hierarchy()
    with contextlib.ExitStack() as stack:
        found = {
            "protected": stack.enter_context(rc.kubelet_pod(hierarchy, parent, None, None)),
            "besteffort": stack.enter_context(rc.kubelet_pod(hierarchy, parent, "besteffort", None)),
            "burstable": stack.enter_context(rc.kubelet_pod(hierarchy, parent, "burstable", None)),
        }
        above = {str(p) for pod in found.values() for p in Path(pod.inner).parents if str(p) != "."}
        for group in sorted(above, key=lambda p: p.count("/")):
            (ROOT / group / "cgroup.subtree_control").write_text("+memory")
        # kubelet's CPU weights (cpu.shares converted to cpu.weight): Guaranteed 500m, Burstable requesting 100m,
        # BestEffort the least; the tiers the sum of their pods' requests.
        for name, shares in (("protected", 512), ("besteffort", 2), ("burstable", 102)):
            for rel in (found[name].pod, found[name].container):
                hierarchy.set_shares(rel, shares)
        hierarchy.set_shares(f"{parent}/kubepods/besteffort", 2)
        hierarchy.set_shares(f"{parent}/kubepods/burstable", 102)
        yield found


def oom_kills(pod: rc.KubeletPod) -> int:
    for line in (ROOT / pod.pod / "memory.events").read_text().splitlines():
        key, value = line.split()
        if key == "oom_kill":
            return int(value)
    return 0


def progress_mib(path: Path) -> int:
    lines = path.read_text().split() if path.exists() else []
    return int(lines[-1]) if lines else 0


def daemon_config(parent: str, workdir: Path, objectives: list[dict[str, Any]]) -> dict[str, Any]:
    return {"global": {
        "sensing": {"cgroupRoot": str(ROOT), "cgroupVersion": "v2", "tickSeconds": TICK,
                    "kubepodsPaths": [f"{parent}/kubepods"]},
        "guard": {"objectives": objectives,  # no API server: pods without metadata, acted on anyway
                  "candidates": {"classes": ["BestEffort", "Burstable"], "podsWithoutMetadata": True},
                  "evictions": {"maxPerTick": 1, "minIntervalSeconds": 5}},
        "actuation": {"ledgerPath": str(workdir / "run/ledger.json"), "evictionGraceSeconds": 1},
        "http": {"enabled": False},
        "gate": {"enabled": False},
    }}  # fmt: skip


def objectives(strategy: str, baseline: int) -> list[dict[str, Any]]:
    evict = {"name": "evict", "metric": "memory_total_usage", "action": "evict",
             "threshold": baseline + EVICT_MIB * MiB, "triggerAfter": 1}  # fmt: skip
    if strategy == "evict_only":
        return [evict]
    throttle = {"name": "hold", "metric": "memory_total_usage", "action": "throttle", "triggerAfter": 1,
                "threshold": baseline + THROTTLE_MIB * MiB, "restoreBelow": baseline + RESTORE_MIB * MiB}  # fmt: skip
    return [throttle, evict]


def alone_p99(workdir: Path, seconds: float) -> float:
    """The probe's p99 lateness with nothing else running, in the protected pod's place."""
    with pods(rc.unique_name("ngmem")) as found:
        out = workdir / "alone.probe"
        probe = start_probe(out, CPU_UNITS, ROOT / found["protected"].inner)
        since = time.monotonic()
        time.sleep(seconds)
        until = time.monotonic()
        stop(probe)
        lateness = probe_lateness(out.read_text(), round(since * 1e6), round(until * 1e6))
    worst = p99(lateness)
    assert worst is not None, "the probe reported nothing"
    return worst


def stop(proc: subprocess.Popen[bytes]) -> None:
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(5)
        except subprocess.TimeoutExpired:
            rc.stop(proc)


def growth(strategy: str, workdir: Path, seconds: float, alone: float) -> dict[str, Any]:
    """One strategy on fresh pods: the figures of its window."""
    parent = rc.unique_name("ngmem")
    run = workdir / strategy
    run.mkdir()
    figures: dict[str, Any] = {}
    with pods(parent) as found:
        total, baseline = node_memory()
        daemon = None
        if strategy != "none":
            daemon = DaemonProcess(daemon_config(parent, run, objectives(strategy, baseline)), run).start()
            started = daemon.wait_for(lambda: any(e.get("event") == "tick" for e in daemon.events()), 600,
                                      "the daemon's first tick")  # fmt: skip
            figures["daemon_start_s"] = round(started, 1)
            total, baseline = node_memory()  # the daemon's own memory is part of the node before the growth
        probe = start_probe(run / "probe", CPU_UNITS, ROOT / found["protected"].inner)
        growers: list[tuple[subprocess.Popen[bytes], Path]] = []
        try:
            time.sleep(2.0)
            since = time.monotonic()
            for tier in ("besteffort", "burstable"):
                path = run / f"{tier}.progress"
                proc = subprocess.Popen([sys.executable, "-c", GROWER, str(path)], stdin=subprocess.DEVNULL)
                (ROOT / found[tier].inner / "cgroup.procs").write_text(str(proc.pid))
                growers.append((proc, path))
            peak = baseline
            while time.monotonic() - since < seconds:
                peak = max(peak, node_memory()[1])
                time.sleep(0.1)
            until = time.monotonic()
            figures["batch_mib"] = sum(progress_mib(path) for _, path in growers)
            figures["oom_kills"] = sum(oom_kills(found[tier]) for tier in ("besteffort", "burstable"))
            figures["evictions"] = 0 if daemon is None else sum(
                1 for e in daemon.events() if e.get("event") == "evicting"
            )  # fmt: skip
            figures["node_memory_max_pct"] = round(100.0 * peak / total, 1)
            figures["waterlines_pct"] = {
                "throttle": round(100.0 * (baseline + THROTTLE_MIB * MiB) / total, 1),
                "evict": round(100.0 * (baseline + EVICT_MIB * MiB) / total, 1),
            }
            stop(probe)
            lateness = probe_lateness((run / "probe").read_text(), round(since * 1e6), round(until * 1e6))
            worst = p99(lateness)
            figures["protected_p99_ratio"] = None if worst is None else round(worst / alone, 2)
            if daemon is not None:
                daemon.signal(signal.SIGTERM)
                daemon.wait(timeout=120)
                highs = [(ROOT / found[t].pod / "memory.high").read_text().strip() for t in ("besteffort", "burstable")
                         if (ROOT / found[t].pod).is_dir()]  # fmt: skip
                figures["restored_exactly"] = all(h == "max" for h in highs)
                events = [e.get("event") for e in daemon.events()]
                figures["memory_high_writes"] = events.count("memory_throttle")
                figures["memory_high_restores"] = events.count("memory_restore")
        finally:
            for proc, _ in growers:
                with contextlib.suppress(ProcessLookupError):
                    rc.stop(proc)
            stop(probe)
            if daemon is not None:
                daemon.kill()
    return figures


# --- cache: page cache pollution on a real block device ------------------------------------------------


def prepare_disk() -> dict[str, list[Path]]:
    """Mount the VM's disk and write the files (the image comes empty), then drop the page cache."""
    MOUNT.mkdir(parents=True, exist_ok=True)
    subprocess.run(["mount", "-t", "ext4", str(DISK), str(MOUNT)], check=True)
    files: dict[str, list[Path]] = {"working_set": [], "streams": []}
    block = os.urandom(1 << 20)
    for name, count, mib in (("ws", 8, WORKING_SET_MIB // 8), ("stream", 2, STREAM_MIB)):
        for index in range(count):
            path = MOUNT / f"{name}-{index}"
            with path.open("wb") as handle:
                for _ in range(mib):
                    handle.write(block)
            files["working_set" if name == "ws" else "streams"].append(path)
    subprocess.run(["sync"], check=True)
    return files


def drop_caches() -> None:
    subprocess.run(["sync"], check=True)
    Path("/proc/sys/vm/drop_caches").write_text("3")


def pressure_usec(pod: rc.KubeletPod) -> int:
    some = (ROOT / pod.pod / "memory.pressure").read_text().splitlines()[0]
    return int(some.rsplit("total=", 1)[1])


def streamed(paths: list[Path]) -> int:
    return sum(int(lines[-1]) for p in paths if p.exists() and (lines := p.read_text().split()))


def read_p99(path: Path, since: float, until: float) -> float | None:
    return p99(probe_lateness(path.read_text(), round(since * 1e6), round(until * 1e6)))


def cache(strategy: str, files: dict[str, list[Path]], workdir: Path, seconds: float) -> dict[str, Any]:
    """One strategy on fresh pods: the reader alone, then beside the streams; the figures of both windows."""
    parent = rc.unique_name("ngcache")
    run = workdir / f"cache-{strategy}"
    run.mkdir()
    figures: dict[str, Any] = {}
    with pods(parent) as found:
        drop_caches()
        daemon = None
        if strategy != "none":
            objective = {"name": "reader", "metric": "protected_memory_stall", "action": "throttle",
                         "threshold": 2, "restoreBelow": 0.5, "triggerAfter": 1}  # fmt: skip
            config = daemon_config(parent, run, [objective])
            config["global"]["guard"]["memory"] = {"minHigh": "32Mi", "stepPercent": 25}
            daemon = DaemonProcess(config, run).start()
            started = daemon.wait_for(lambda: any(e.get("event") == "tick" for e in daemon.events()), 600,
                                      "the daemon's first tick")  # fmt: skip
            figures["daemon_start_s"] = round(started, 1)
        out = run / "reads"
        reader = subprocess.Popen([sys.executable, "-c", READER, str(out), *map(str, files["working_set"])])
        (ROOT / found["protected"].inner / "cgroup.procs").write_text(str(reader.pid))
        streamers: list[subprocess.Popen[bytes]] = []
        progress = [run / "stream-0.progress", run / "stream-1.progress"]
        try:
            deadline = time.monotonic() + 300
            while "# warm" not in (out.read_text() if out.exists() else "") and time.monotonic() < deadline:
                time.sleep(0.2)
            since = time.monotonic()
            time.sleep(min(8.0, seconds))
            alone_until = time.monotonic()
            for tier, path, mark in zip(("besteffort", "burstable"), files["streams"], progress, strict=True):
                proc = subprocess.Popen([sys.executable, "-c", STREAMER, str(path), str(mark)])
                (ROOT / found[tier].inner / "cgroup.procs").write_text(str(proc.pid))
                streamers.append(proc)
            time.sleep(2.0)  # the streams get going
            batch = [found["besteffort"], found["burstable"]]
            start, bytes0, stall0 = time.monotonic(), streamed(progress), pressure_usec(found["protected"])
            batch0 = sum(map(pressure_usec, batch))
            time.sleep(seconds)
            until, bytes1, stall1 = time.monotonic(), streamed(progress), pressure_usec(found["protected"])
            batch1 = sum(map(pressure_usec, batch))
            alone = read_p99(out, since, alone_until)
            loaded = read_p99(out, start, until)
            figures["alone_p99_ms"] = None if alone is None else round(alone, 2)
            figures["protected_read_p99_ms"] = None if loaded is None else round(loaded, 2)
            figures["protected_read_p99_ratio"] = None if not alone or loaded is None else round(loaded / alone, 2)
            figures["protected_memory_stall_pct"] = round(100.0 * (stall1 - stall0) / 1e6 / (until - start), 2)
            figures["batch_throughput_mb_s"] = round((bytes1 - bytes0) / 1e6 / (until - start), 1)
            figures["batch_memory_stall_pct"] = round(100.0 * (batch1 - batch0) / 1e6 / (until - start) / len(batch), 2)
            if daemon is not None:
                daemon.signal(signal.SIGTERM)
                daemon.wait(timeout=120)
                highs = [(ROOT / found[t].pod / "memory.high").read_text().strip() for t in ("besteffort", "burstable")]
                figures["restored_exactly"] = all(h == "max" for h in highs)
                events = [e.get("event") for e in daemon.events()]
                figures["memory_high_writes"] = events.count("memory_throttle")
                figures["memory_high_restores"] = events.count("memory_restore")  # while the streams ran: 0 wanted
        finally:
            for proc in [*streamers, reader]:
                stop(proc)
            if daemon is not None:
                daemon.kill()
    return figures


def run(args: argparse.Namespace) -> dict[str, Any]:
    workdir = Path(tempfile.mkdtemp(prefix="ngmem-"))
    result: dict[str, Any] = {"scenarios": {}}
    if "growth" in (args.scenario or SCENARIOS):
        result["scenarios"]["growth"] = growth_all(args, workdir)
    if "cache" in (args.scenario or SCENARIOS):
        try:
            files = prepare_disk()
        except (OSError, subprocess.CalledProcessError) as exc:  # reported in the figures, the growth kept
            result["scenarios"]["cache"] = {"error": f"cannot prepare the disk: {exc}"}
            return result
        cache_figures: dict[str, Any] = {}
        for strategy in args.cache_strategy or CACHE_STRATEGIES:
            print(f"cache: {strategy}", file=sys.stderr, flush=True)
            cache_figures[strategy] = cache(strategy, files, workdir, args.seconds)
            print(json.dumps({strategy: cache_figures[strategy]}), file=sys.stderr, flush=True)
        result["scenarios"]["cache"] = cache_figures
    return result


def growth_all(args: argparse.Namespace, workdir: Path) -> dict[str, Any]:
    alone = alone_p99(workdir, 8.0)
    growth_figures: dict[str, Any] = {}
    for strategy in args.strategy or STRATEGIES:
        print(f"growth: {strategy}", file=sys.stderr, flush=True)
        growth_figures[strategy] = growth(strategy, workdir, args.seconds, alone)
        print(json.dumps({strategy: growth_figures[strategy]}), file=sys.stderr, flush=True)
    wall = growth_figures.get("none", {}).get("batch_mib")
    for figures in growth_figures.values():
        figures["batch_progress"] = round(figures["batch_mib"] / wall, 2) if wall else None
    return {"alone_p99_ms": round(alone, 2), **growth_figures}


def run_vm(args: argparse.Namespace) -> int:
    """This script with --in-vm in a fresh VM; its progress on the console, its result JSON as the last line."""
    reason = vm_available()
    if reason:
        print(json.dumps({"error": reason}))
        return 1
    argv = [sys.executable, str(Path(__file__).resolve()), "--in-vm", "--seconds", str(args.seconds)]
    argv += [f"--strategy={s}" for s in args.strategy or []]
    argv += [f"--cache-strategy={s}" for s in args.cache_strategy or []]
    argv += [f"--scenario={s}" for s in args.scenario or []]
    with tempfile.TemporaryDirectory(prefix="ngmem-vm-") as out:
        disk = Path(out) / "disk.img"
        with disk.open("wb") as handle:
            handle.truncate(DISK_MIB * MiB)  # sparse: written by the guest
        subprocess.run(["mkfs.ext2", "-q", "-F", str(disk)], check=True)
        result = run_in_vm(argv, cwd=str(REPO), out_dir=Path(out), timeout=2400, echo=sys.stderr.buffer, disk=disk)
        found = Path(out) / "memory.json"
        if result.exit_code != 0 or not found.exists():
            print(json.dumps({"error": f"VM run failed with exit code {result.exit_code}"}))
            return 1
        print(found.read_text().strip())
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--seconds", type=float, default=20.0, help="each strategy's window")
    parser.add_argument("--strategy", action="append", choices=STRATEGIES, help="growth's strategies")
    parser.add_argument("--cache-strategy", action="append", choices=CACHE_STRATEGIES, help="cache's strategies")
    parser.add_argument("--scenario", action="append", choices=SCENARIOS)
    parser.add_argument("--in-vm", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if not args.in_vm:
        return run_vm(args)
    result = run(args)
    text = json.dumps(result)
    out = os.environ.get("NODEGUARD_VM_OUT")
    if out:
        Path(out, "memory.json").write_text(text)
    print(text)
    return 0


if __name__ == "__main__":
    stop_cleanly_on_sigterm()
    raise SystemExit(main())
