"""The memory.high lever on a real cgroup v2 kernel (the QEMU VM): kubelet-shaped pods, real processes allocating.

Only inside the VM (tests/kernel/vm.py); elsewhere the ``kernel`` marker makes them skip. Together they stay
within about a minute of the VM's time: one lever test without processes, one in-process daemon run with one
allocating pod, and one run of real ``nodeguard`` processes (two daemons and ``restore --all``) on another.
"""

from __future__ import annotations

import contextlib
import json
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from nodeguard.actuators.cgroup_writer import CgroupWriter
from nodeguard.actuators.changes import Changer
from nodeguard.actuators.ledger import Ledger
from nodeguard.actuators.levers.memory_high import MemoryHighLever
from nodeguard.actuators.restore import Outcome, restore_all
from nodeguard.config import parse_document
from nodeguard.daemon import Daemon
from nodeguard.model.levers import LeverChange
from nodeguard.policy.holds import HeldMemory
from nodeguard.sources.cgroupfs import parse_flat_keyed
from tests.history.files import why_json
from tests.support import cgroups as rc
from tests.support.daemon import DaemonProcess
from tests.support.node import SLOW

pytestmark = pytest.mark.kernel

MiB = 1 << 20
ROOT = rc.CGROUP_ROOT
# kubelet's Memory QoS on a container: request + 0.8 × (limit − request), whole pages.
CONTAINER_HIGH = 200 * MiB


@contextlib.contextmanager
def memory_pod(tier: str) -> Iterator[rc.KubeletPod]:
    """A kubelet-shaped pod with the memory controller enabled down to its container's processes."""
    hierarchy = rc.v2_cpu_hierarchy()
    parent = rc.unique_name()
    with rc.kubelet_pod(hierarchy, parent, tier, None) as pod:
        path = Path(pod.inner)
        for above in sorted((str(p) for p in path.parents if str(p) != "."), key=lambda p: p.count("/")):
            (ROOT / above / "cgroup.subtree_control").write_text("+memory")
        yield pod


def high(group: str) -> str:
    return (ROOT / group / "memory.high").read_text().strip()


def node_used() -> int:
    fields = dict(line.split(":", 1) for line in Path("/proc/meminfo").read_text().splitlines())
    return (int(fields["MemTotal"].split()[0]) - int(fields["MemAvailable"].split()[0])) * 1024


def test_lever_lowers_a_pod_under_its_containers_memory_qos_and_restores_both_exactly(tmp_path: Path) -> None:
    """Kernel facts the lever relies on, then the lever: a pod's memory.high comes down below its container's
    (Memory QoS) value, which the kernel accepts and leaves alone, and ``restore_all`` puts back "max" exactly."""
    with memory_pod("burstable") as pod:
        (ROOT / pod.container / "memory.high").write_text(str(CONTAINER_HIGH))
        # The kernel keeps whole pages: a value that is not reads back as another one.
        (ROOT / pod.sandbox / "memory.high").write_text(str(100 * MiB + 1000))
        assert high(pod.sandbox) == str(100 * MiB)
        lever = MemoryHighLever(CgroupWriter(str(ROOT)), "v2")
        with pytest.raises(ValueError, match="whole number"):
            lever.plan(pod.pod, str(64 * MiB + 1000), {})

        ledger = Ledger(str(tmp_path / "ledger.json"))
        change = LeverChange(lever.name, pod.pod, str(64 * MiB), None, release=False, holds_back=True,
                             kind="memory_throttle", metric="test", reason="test")  # fmt: skip
        done = Changer(ledger, {lever.name: lever}).apply([change])
        assert [(d.before, d.after) for d in done.done] == [("max", str(64 * MiB))]
        assert high(pod.pod) == str(64 * MiB)
        # A child above its parent is no conflict on v2: untouched, and writable higher still.
        assert high(pod.container) == str(CONTAINER_HIGH)
        (ROOT / pod.container / "memory.high").write_text(str(CONTAINER_HIGH + 64 * MiB))
        (ROOT / pod.container / "memory.high").write_text(str(CONTAINER_HIGH))

        ledger.save()
        again = Ledger.load(str(tmp_path / "ledger.json"))
        assert again.get(lever.name, pod.pod) is not None
        outcomes = restore_all(again, {lever.name: lever})
        assert outcomes == {Outcome.RESTORED: [pod.pod]}
        assert (high(pod.pod), high(pod.container)) == ("max", str(CONTAINER_HIGH))
        assert not Ledger.load(str(tmp_path / "ledger.json"))


GROWER = """
import sys, time
chunks = []
for _ in range(int(sys.argv[1])):
    chunks.append(b"\\1" * (8 << 20))  # touched: anonymous memory the kernel cannot reclaim without swap
    time.sleep(0.15)
time.sleep(600)
"""


def daemon_config(pod: rc.KubeletPod, ledger: Path, threshold: int | None, on_start: str) -> dict[str, Any]:
    """Memory throttling past ``threshold`` bytes in use (None: no memory objective, restores of 1 % a tick)."""
    parent = pod.pod.split("/kubepods/")[0]
    guard: dict[str, Any] = {"objectives": [], "memory": {"restoreStepPercent": 1}}
    if threshold is not None:
        guard = {"objectives": [{"metric": "memory_total_usage", "action": "throttle", "threshold": threshold,
                                 "restoreBelow": threshold - 64 * MiB, "triggerAfter": 1}],
                 "memory": {"minHigh": "16Mi", "stepPercent": 50}}  # fmt: skip
    config: dict[str, Any] = {
        "global": {
            "sensing": {"cgroupRoot": str(ROOT), "cgroupVersion": "v2", "tickSeconds": 0.3,
                        "kubepodsPaths": [f"{parent}/kubepods"]},
            "guard": {**guard, "candidates": {"podsWithoutMetadata": True}},  # no API server: no pod has metadata
            "actuation": {"ledgerPath": str(ledger), "onStart": on_start},
            "history": {"path": str(ledger.parent / "history")},
            "http": {"enabled": False},
            "gate": {"enabled": False},
        }
    }  # fmt: skip
    return config


def daemon_for(pod: rc.KubeletPod, ledger: Path, threshold: int, on_start: str) -> Daemon:
    return Daemon(parse_document(daemon_config(pod, ledger, threshold, on_start)).settings_for({}))


def test_a_growing_pod_is_held_near_the_waterline_without_oom_and_put_back_after_crash_and_stop(
    tmp_path: Path,
) -> None:
    """A BestEffort pod's anonymous memory grows past a node waterline: the daemon lowers its memory.high, the
    growth stops well short of what it asked for, nothing is OOM-killed or evicted; a crashed daemon's
    successor adopts the hold from the ledger and its stop puts "max" back exactly."""
    ledger = tmp_path / "ledger.json"
    with memory_pod("besteffort") as pod:
        baseline = node_used()
        threshold = baseline + 96 * MiB
        proc = subprocess.Popen([sys.executable, "-c", GROWER, "40"], stdin=subprocess.DEVNULL)  # asks 320 MiB
        try:
            (ROOT / pod.inner / "cgroup.procs").write_text(str(proc.pid))
            first = daemon_for(pod, ledger, threshold, "restore")
            first.start()
            peak, deadline = 0, time.monotonic() + 40
            while time.monotonic() < deadline and high(pod.pod) == "max":
                first.tick()
                time.sleep(0.3)
            assert high(pod.pod) != "max", "the pod's memory.high was never lowered"
            for _ in range(15):  # held: keep ticking while it would grow
                first.tick()
                peak = max(peak, node_used())
                time.sleep(0.3)
            first.close()  # a crash: no restore, the ledger keeps the hold
            held = high(pod.pod)
            grown = int((ROOT / pod.pod / "memory.current").read_text())
            assert proc.poll() is None, "the growing process died"
            events = parse_flat_keyed((ROOT / pod.pod / "memory.events").read_text(), "memory.events")
            assert events.get("oom_kill", 0) == 0 and events.get("high", 0) > 0
            assert grown < 250 * MiB, f"it grew to {grown >> 20} MiB of 320 MiB: not held back"
            assert peak < threshold + 96 * MiB, f"node peaked {(peak - threshold) >> 20} MiB past the waterline"

            second = daemon_for(pod, ledger, threshold, "adopt")
            second.start()
            assert pod.pod in second.state.held(HeldMemory), "the successor did not adopt the hold"
            assert high(pod.pod) == held
            second.tick()
            second.stop()  # what SIGTERM runs
            assert high(pod.pod) == "max"
            assert not Ledger.load(str(ledger))
            # After the crash and the restart: `nodeguard why` names the hold, why it was set, and its end.
            answer = why_json(pod.pod, "--history", str(tmp_path / "history"))
            lowered = next(e for e in answer["entries"] if e["kind"] == "memory_throttle")
            assert (
                lowered["relation"] == "workload" and lowered["lever"] == "memory.high" and lowered["before"] == "max"
            )
            assert lowered["objective"]["metric"] == "memory_total_usage"
            assert lowered["readings"]["memory_total_usage"] > threshold
            assert answer["entries"][-1]["kind"] == "stop" and pod.pod in answer["entries"][-1]["groups"]
            assert answer["held"] == []
        finally:
            rc.stop(proc)


def test_a_hold_left_by_sigkill_is_stepped_back_by_a_successor_without_the_objective_and_restore_all_ends_it(
    tmp_path: Path,
) -> None:
    """Real processes: a daemon SIGKILLed holding a growing pod's memory.high; its successor, whose config has no
    memory objective, adopts the hold and raises it a step a tick (it keeps running); SIGKILLed too, the hold it
    left is put back to "max" exactly by ``nodeguard restore --all``, and the ledger empties."""
    ledger = tmp_path / "run/ledger.json"
    with memory_pod("besteffort") as pod:
        threshold = node_used() + 96 * MiB
        proc = subprocess.Popen([sys.executable, "-c", GROWER, "40"], stdin=subprocess.DEVNULL)
        try:
            (ROOT / pod.inner / "cgroup.procs").write_text(str(proc.pid))
            (tmp_path / "first").mkdir()
            first = DaemonProcess(daemon_config(pod, ledger, threshold, "restore"), tmp_path / "first").start()
            try:
                first.wait_for(lambda: high(pod.pod) != "max", 60 * SLOW, "the pod's memory.high lowered")
            finally:
                first.kill()
            held = high(pod.pod)
            assert Ledger.load(str(ledger)).get(MemoryHighLever.name, pod.pod) is not None

            (tmp_path / "second").mkdir()
            config = daemon_config(pod, ledger, None, "adopt")
            second = DaemonProcess(config, tmp_path / "second").start()
            try:
                second.wait_for(lambda: high(pod.pod) not in (held, "max"), 30 * SLOW, "the hold raised a step")
                stepped = len(second.ticks())
                second.wait_for(lambda: len(second.ticks()) > stepped, 10 * SLOW, "a tick after the step")
                reasons = [e.get("reason", "") for e in second.events() if e.get("event") == "memory_restore"]
                assert reasons and all("no memory objective holds it" in r for r in reasons), reasons
                assert not [e for e in second.events() if e.get("level") in ("error", "critical")]
            finally:
                second.kill()
            assert high(pod.pod) != "max", "a 1 % step a tick should not have released it yet"
            assert proc.poll() is None, "the growing process died"

            (tmp_path / "second/config.json").write_text(json.dumps(config))
            restored = subprocess.run(
                [sys.executable, "-m", "nodeguard", "restore", "--all", "--config", str(tmp_path / "second/config.json")],
                capture_output=True, text=True, timeout=120 * SLOW, check=False,
            )  # fmt: skip
            assert restored.returncode == 0, restored.stdout + restored.stderr
            assert restored.stdout.split() == ["restored", MemoryHighLever.name, pod.pod], restored.stdout
            assert high(pod.pod) == "max"
            assert not Ledger.load(str(ledger))
        finally:
            rc.stop(proc)
