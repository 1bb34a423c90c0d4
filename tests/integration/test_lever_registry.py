"""No registered lever can be left out: start, stop, ``restore --all``, /status and /metrics each cover every lever
in ``levers.REGISTERED``, checked on this host's real cgroup v1 kernel with one held group per lever it has
(memory.high has no v1 file: tests/kernel/test_memory_high_kernel.py holds it in the VM).

A new lever fails ``test_every_registered_lever_has_a_held_value_here`` until
it gets a held value below; from then on every check here runs on it too.
"""

from __future__ import annotations

import contextlib
import json
import signal
import subprocess
import sys
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from nodeguard.actuators import levers
from nodeguard.actuators.cgroup_writer import CgroupWriter
from nodeguard.actuators.ledger import Ledger, LeverRecord
from nodeguard.actuators.levers.base import Lever
from nodeguard.daemon import held_counts
from nodeguard.kubernetes.events import REASONS
from nodeguard.model.levers import TERMS
from nodeguard.policy.holds import KIND_OF
from tests.support import cgroups as rc
from tests.support.daemon import DaemonProcess
from tests.support.endpoints import metric_value
from tests.support.node import SLOW
from tests.support.ports import free_port

REPO = Path(__file__).parents[2]

# Per lever: a value that holds a group back, from the lever on this hierarchy, and the group of a kubelet-shaped
# pod it is held on ("pod": the pod's cgroup, a workload; "tier": its QoS tier).
HELD: dict[str, tuple[Callable[[Any], str], str]] = {
    "cpu.max": (lambda lever: "50000 100000", "pod"),
    "cpu.weight": (lambda lever: str(lever.least), "tier"),
    "memory.high": (lambda lever: str(64 << 20), "pod"),
}


@contextlib.contextmanager
def one_group_per_lever(hierarchy: rc.Hierarchy) -> Iterator[tuple[str, dict[str, str]]]:
    """A Burstable pod laid out as kubelet does; (the kubepods path, each lever's group by lever name)."""
    parent = rc.unique_name()
    with rc.kubelet_pod(hierarchy, parent, "burstable", None) as pod:
        where = {"pod": pod.pod, "tier": f"{parent}/kubepods/burstable"}
        yield f"{parent}/kubepods", {name: where[HELD[name][1]] for name in levers.available(hierarchy.version)}


def hold_every_lever(hierarchy: rc.Hierarchy, groups: dict[str, str], ledger_path: Path) -> dict[str, str]:
    """Each lever holds its group back, recorded in the ledger first as the executor does; returns the originals."""
    built: dict[str, Lever] = levers.build(CgroupWriter(str(hierarchy.writable)), hierarchy.version)
    ledger = Ledger.load(str(ledger_path))
    originals = {}
    for name, lever in built.items():
        target = HELD[name][0](lever)
        current, writes = lever.plan(groups[name], target, {})
        assert lever.restricts(target, current), (name, target, current)
        ledger.record(LeverRecord(lever=name, group=groups[name], cgroup_version=hierarchy.version,  # type: ignore[arg-type]
                                  original=current, applied=target, reason="test"))  # fmt: skip
        ledger.save()
        lever.perform(writes)
        originals[name] = current
    return originals


def values(hierarchy: rc.Hierarchy, groups: dict[str, str]) -> dict[str, str]:
    built = levers.build(CgroupWriter(str(hierarchy.writable)), hierarchy.version)
    return {name: built[name].read(group) for name, group in groups.items()}


def config(
    hierarchy: rc.Hierarchy, kubepods: str, ledger: Path, port: int | None = None, on_start: str = "restore"
) -> dict[str, Any]:
    """A daemon whose guard only plans: the held values are all the ledger's, and only start and stop change them."""
    return {
        "global": {
            "sensing": {"cgroupRoot": str(rc.CGROUP_ROOT), "cgroupVersion": hierarchy.version,
                        "tickSeconds": 0.3, "kubepodsPaths": [kubepods]},
            # The guard plans in dry-run: what it would put back stays held, so status and metrics see it.
            "guard": {"objectives": [{"metric": "cpu_total_utilization", "action": "throttle", "threshold": "90%",
                                      "restoreBelow": "50%"}], "dryRun": True,
                      "candidates": {"podsWithoutMetadata": True}},  # no API server: no pod has metadata
            "actuation": {"ledgerPath": str(ledger), "onStart": on_start},
            "http": {"enabled": port is not None, "listen": f"127.0.0.1:{port or 0}"},
            "gate": {"enabled": False},
        }
    }  # fmt: skip


def test_every_registered_lever_has_a_held_value_here() -> None:
    """The tests below hold every registered lever, and every lever is named, held by the policy and has its
    Events."""
    assert set(HELD) == set(levers.NAMES)
    assert set(TERMS) == set(KIND_OF) == set(levers.NAMES)
    assert {kind.reason for name in levers.NAMES for kind in (TERMS[name].holds, TERMS[name].gives_back)} <= {
        kind.reason for kind in REASONS
    }


def test_restore_all_puts_back_every_registered_lever(tmp_path: Path) -> None:
    """`restore --all` writes back every lever's original and empties the ledger (host v1; v2 below)."""
    hierarchy = rc.v1_cpu_hierarchy()
    ledger = tmp_path / "ledger.json"
    with one_group_per_lever(hierarchy) as (kubepods, groups):
        originals = hold_every_lever(hierarchy, groups, ledger)
        assert values(hierarchy, groups) != originals
        (tmp_path / "c.json").write_text(json.dumps(config(hierarchy, kubepods, ledger)))
        result = subprocess.run([sys.executable, "-m", "nodeguard", "restore", "--all", "--config",
                                 str(tmp_path / "c.json")], capture_output=True, text=True, cwd=REPO,
                                timeout=60 * SLOW)  # fmt: skip
        assert result.returncode == 0, result.stdout + result.stderr
        assert values(hierarchy, groups) == originals
        assert not Ledger.load(str(ledger))


def test_start_restores_every_registered_lever(tmp_path: Path) -> None:
    """onStart: restore puts every lever's original back before the first tick (host v1; v2 below), and the daemon
    says once that memory throttling needs cgroup v2."""
    hierarchy = rc.v1_cpu_hierarchy()
    ledger = tmp_path / "ledger.json"
    with one_group_per_lever(hierarchy) as (kubepods, groups):
        originals = hold_every_lever(hierarchy, groups, ledger)
        daemon = DaemonProcess(config(hierarchy, kubepods, ledger), tmp_path).start()
        try:
            daemon.wait_for(lambda: any(e.get("event") == "tick" for e in daemon.events()), 20 * SLOW, "a tick")
            assert values(hierarchy, groups) == originals
            restored = next(e for e in daemon.events() if e.get("event") == "restored the ledger's records")
            assert restored.get("restored") == len(groups), restored
            # v1 has no memory.high: said once at start, in one line.
            said = [e for e in daemon.events() if "memory throttling needs cgroup v2" in str(e.get("event"))]
            assert len(said) == 1 and said[0].get("blocked_objectives") == [], said
        finally:
            daemon.kill()


def test_adopt_status_metrics_and_stop_cover_every_registered_lever(tmp_path: Path) -> None:
    """onStart: adopt keeps every lever's value and counts it; /status and /metrics show each lever's group;
    SIGTERM writes every original back (host v1: the registry is the same on v2, whose adopt and stop the VM runs in
    test_lever_crash.py's both-levers crash)."""
    hierarchy = rc.v1_cpu_hierarchy()
    ledger = tmp_path / "ledger.json"
    port = free_port()
    with one_group_per_lever(hierarchy) as (kubepods, groups):
        originals = hold_every_lever(hierarchy, groups, ledger)
        held = values(hierarchy, groups)
        daemon = DaemonProcess(config(hierarchy, kubepods, ledger, port, on_start="adopt"), tmp_path).start()
        try:
            daemon.wait_for(lambda: any(e.get("event") == "tick" for e in daemon.events()), 20 * SLOW, "a tick")
            adopted = next(e for e in daemon.events() if e.get("event") == "re-adopted the ledger's records")
            assert {name: adopted.get(name) for name in levers.NAMES} == {
                name: int(name in groups) for name in levers.NAMES
            }
            assert values(hierarchy, groups) == held
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/status", timeout=10) as response:
                status = json.loads(response.read())
            assert {name: set(status["held"][name]) for name in groups} == {
                name: {group} for name, group in groups.items()
            }
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as response:
                metrics = response.read().decode()
            for name in groups:
                assert metric_value(metrics, "nodeguard_lever_held_groups", lever=name) == 1.0, name
            daemon.signal(signal.SIGTERM)
            assert daemon.wait(timeout=10 * SLOW) == 0
            assert values(hierarchy, groups) == originals
            assert not Ledger.load(str(ledger))
            assert held_counts(Ledger.load(str(ledger))) == dict.fromkeys(levers.NAMES, 0)
        finally:
            daemon.kill()
