"""``nodeguard plan`` with the Kubernetes integration on: the node's pods listed once, each pod's rule shown."""

from __future__ import annotations

import json
import subprocess
import sys
import uuid
from pathlib import Path

from tests.kubernetes.conftest import FakeKube, Pki
from tests.kubernetes.objects import NODE, pod
from tests.support import cgroups as rc


def test_plan_lists_the_pods_once_and_names_the_rule_that_chose_each(
    tmp_path: Path, kube: FakeKube, pki: Pki, token_file: Path, hybrid_v2_mount: Path
) -> None:
    """Two pod cgroups, one of kube-system and one of a batch namespace: the plan lists this node's pods from the
    API once and shows the first exempt by namespace, the second a candidate by its class."""
    parent = rc.unique_name()
    uids = {"coredns-x": str(uuid.uuid4()), "train-0": str(uuid.uuid4())}
    cgroups = {name: f"{parent}/kubepods/burstable/pod{uid}" for name, uid in uids.items()}
    kube.pods = [pod("coredns-x", uids["coredns-x"], namespace="kube-system"), pod("train-0", uids["train-0"],
                                                                                   namespace="batch")]  # fmt: skip
    config = tmp_path / "nodeguard.json"
    config.write_text(json.dumps({"global": {
        "sensing": {"cgroupRoot": str(hybrid_v2_mount), "cgroupVersion": "v2", "kubepodsPaths": [f"{parent}/kubepods"]},
        "kubernetes": {"enabled": True, "apiServerUrl": kube.url, "tokenPath": str(token_file),
                       "caPath": str(pki.ca_path), "nodeLabelsFromApi": False},
    }}))  # fmt: skip
    with rc.cgroups(*[hybrid_v2_mount / path for path in cgroups.values()]):
        run = subprocess.run(
            [sys.executable, "-m", "nodeguard", "plan", "--config", str(config), "--node-name", NODE, "--json",
             "--interval", "0.05"],
            capture_output=True, text=True, timeout=60,
        )  # fmt: skip
    assert run.returncode == 0, run.stderr
    trace = json.loads(run.stdout.splitlines()[-1])
    chosen = {wid: (group["role"], group["rule"]) for group in trace["selection"] for wid in group["workloads"]}
    assert chosen[cgroups["coredns-x"]] == ("exempt", "guard.exempt.namespaces: kube-system")
    assert chosen[cgroups["train-0"]] == ("candidate", "guard.candidates: class Burstable")
    assert [s.query.get("fieldSelector") for s in kube.requests("GET", "/api/v1/pods")] == [[f"spec.nodeName={NODE}"]]
