"""A node with kubelet's pods and the Kubernetes integration off: the daemon says what it cannot honour, at start
and in /status, and acts on no pod unless the config says it may."""

from __future__ import annotations

import json
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from structlog.testing import capture_logs

from nodeguard.config import parse_document
from nodeguard.daemon import Daemon
from nodeguard.policy.selection import Role
from nodeguard.surfaces.status import status_of
from tests.support import cgroups as rc


@pytest.fixture
def kubelet_tree(hybrid_v2_mount: Path) -> Iterator[tuple[Path, str, str]]:
    """A kubepods tree with one Burstable pod cgroup (no processes: only discovery matters here)."""
    parent = rc.unique_name()
    pod = f"{parent}/kubepods/burstable/pod{uuid.uuid4()}"
    made = [hybrid_v2_mount / p for p in (parent, f"{parent}/kubepods", f"{parent}/kubepods/burstable", pod)]
    with rc.cgroups(*made):
        yield hybrid_v2_mount, parent, pod


def daemon(tmp_path: Path, root: Path, sensing: dict[str, Any], **guard: Any) -> Daemon:
    document = {"global": {
        "sensing": {"cgroupRoot": str(root), "cgroupVersion": "v2", **sensing},
        # A waterline every tick is past (a dry run): the plan asks for candidates.
        "guard": {"objectives": [{"metric": "memory_total_utilization", "action": "evict", "threshold": "1%",
                                  "triggerAfter": 1}], "dryRun": True, **guard},
        "actuation": {"ledgerPath": str(tmp_path / "ledger.json"), "dryRun": True},
        "http": {"enabled": False},
        "gate": {"enabled": False},
    }}  # fmt: skip
    (tmp_path / "nodeguard.json").write_text(json.dumps(document))
    return Daemon(parse_document(document).settings_for({}), config_path=tmp_path / "nodeguard.json")


def test_pods_without_metadata_are_named_at_start_and_in_status_and_left_alone(
    tmp_path: Path, kubelet_tree: tuple[Path, str, str]
) -> None:
    """The first tick finds kubelet's pods with kubernetes.enabled false: one warning naming the setting, the
    same in /status; the pod is exempt for want of metadata, every tick."""
    root, parent, pod = kubelet_tree
    guarded = daemon(tmp_path, root, {"kubepodsPaths": [f"{parent}/kubepods"]})
    try:
        guarded.start()
        with capture_logs() as logs:
            plan = guarded.tick()
            guarded.tick()
        warnings = [e for e in logs if e.get("setting") == "kubernetes.enabled"]
        assert len(warnings) == 1 and warnings[0]["log_level"] == "warning", logs
        assert "kubernetes.enabled is false" in warnings[0]["event"]
        assert "guard.candidates.podsWithoutMetadata is false" in warnings[0]["event"]
        [shown] = status_of(guarded)["warnings"]
        assert shown == {"setting": "kubernetes.enabled", "message": warnings[0]["event"]}
        assert plan.choices is not None and plan.choices[pod].role is Role.EXEMPT
        assert plan.candidates == 0 and not plan.actions
    finally:
        guarded.stop()


def test_a_config_that_allows_pods_without_metadata_acts_on_them_and_says_what_it_risks(
    tmp_path: Path, kubelet_tree: tuple[Path, str, str]
) -> None:
    """With guard.candidates.podsWithoutMetadata the pod is a candidate by its cgroup's class, and the warning
    says what that gives up."""
    root, parent, pod = kubelet_tree
    guarded = daemon(tmp_path, root, {"kubepodsPaths": [f"{parent}/kubepods"]},
                     candidates={"podsWithoutMetadata": True})  # fmt: skip
    try:
        guarded.start()
        plan = guarded.tick()
        assert plan.choices is not None and plan.choices[pod].role is Role.CANDIDATE
        assert plan.candidates == 1
        [shown] = status_of(guarded)["warnings"]
        assert "podsWithoutMetadata is true" in shown["message"] and "CoreDNS" in shown["message"]
    finally:
        guarded.stop()


def test_a_plain_host_has_nothing_to_warn_of(tmp_path: Path, kubelet_tree: tuple[Path, str, str]) -> None:
    """Without kubelet's cgroups (pod discovery off, or none found) there is no warning."""
    root, _, _ = kubelet_tree
    plain = daemon(tmp_path, root, {"kubepods": False})
    try:
        plain.start()
        plain.tick()
        assert status_of(plain)["warnings"] == []
    finally:
        plain.stop()
