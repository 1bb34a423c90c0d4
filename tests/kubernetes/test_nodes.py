"""This node's labels from the API server select the config's perNode rules."""

from __future__ import annotations

from pathlib import Path

import pytest

from nodeguard.config import parse_document
from nodeguard.kubernetes.client import KubeClient, KubeError
from nodeguard.kubernetes.nodes import (
    fetch_node_labels,
    fetch_node_labels_sync,
    merge_labels,
    parse_node_labels,
)
from nodeguard.kubernetes.settings import KubernetesSettings
from nodeguard.node_identity import node_labels
from tests.kubernetes.conftest import Canned, FakeKube, Pki
from tests.kubernetes.objects import NODE, node

DOCUMENT = parse_document(
    {
        "global": {"guard": {"minQuotaCores": 0.05}},
        "perNode": [
            {"nodeSelector": {"matchLabels": {"node.kubernetes.io/pool": "batch"}}, "guard": {"dryRun": True}},
            {
                "nodeSelector": {
                    "matchExpressions": [
                        {"key": "topology.kubernetes.io/zone", "operator": "In", "values": ["eu-1a", "eu-1b"]},
                        {"key": "node-role.kubernetes.io/control-plane", "operator": "DoesNotExist"},
                    ]
                },
                "guard": {"minQuotaCores": 0.2},
            },
        ],
    }
)


def test_api_labels_select_the_per_node_rules(kube: FakeKube, settings: KubernetesSettings) -> None:
    """Labels read from the Node object (matchLabels and matchExpressions) pick exactly the matching rules."""
    kube.nodes[NODE] = node(NODE, {"node.kubernetes.io/pool": "batch", "topology.kubernetes.io/zone": "eu-1b"})
    kube.nodes["cp-1"] = node(
        "cp-1", {"topology.kubernetes.io/zone": "eu-1a", "node-role.kubernetes.io/control-plane": ""}
    )
    local = node_labels(NODE)
    labels = merge_labels(local, fetch_node_labels_sync(settings, NODE))
    assert DOCUMENT.matching_rules(labels) == [0, 1]
    chosen = DOCUMENT.settings_for(labels)
    assert chosen.guard.dry_run and chosen.guard.min_quota_cores == 0.2
    control_plane = merge_labels(node_labels("cp-1"), fetch_node_labels_sync(settings, "cp-1"))
    assert DOCUMENT.matching_rules(control_plane) == []
    # Without the API's labels, only the hostname is known and no rule matches.
    assert DOCUMENT.matching_rules(local) == []


async def test_async_fetch_for_reload(kube: FakeKube, pki: Pki, token_file: Path) -> None:
    """fetch_node_labels (for a reload inside the loop) GETs /api/v1/nodes/<name> and returns its labels."""
    kube.nodes[NODE] = node(NODE, {"node.kubernetes.io/pool": "web"})
    client = KubeClient(kube.url, token_path=str(token_file), ca_path=str(pki.ca_path), timeout_seconds=2)
    try:
        labels = await fetch_node_labels(client, NODE)
        with pytest.raises(KubeError) as caught:
            await fetch_node_labels(client, "no-such-node")
    finally:
        await client.aclose()
    assert labels["node.kubernetes.io/pool"] == "web"
    assert caught.value.status == 404


def test_api_down_gives_none_after_retries(kube: FakeKube, settings: KubernetesSettings) -> None:
    """An API server that fails is tried a few times, then None: start-up goes on with the local labels."""
    kube.overrides[("GET", r"/api/v1/nodes/.*")] = Canned(503, {"kind": "Status", "code": 503})
    assert fetch_node_labels_sync(settings, NODE, attempts=3, delay=0.01) is None
    assert len(kube.requests("GET")) == 3


def test_merge_prefers_api_labels_except_explicit_ones() -> None:
    """API labels override the local guesses, a --node-label given explicitly overrides the API."""
    local = {"kubernetes.io/hostname": "guess", "pool": "cli"}
    api = {"kubernetes.io/hostname": "ip-10-0-0-5.ec2.internal", "pool": "api", "zone": "a"}
    assert merge_labels(local, api) == {
        "kubernetes.io/hostname": "ip-10-0-0-5.ec2.internal",
        "pool": "api",
        "zone": "a",
    }
    assert merge_labels(local, api, explicit={"pool"})["pool"] == "cli"
    assert merge_labels(local, None) == local


def test_parse_node_labels_rejects_other_objects() -> None:
    """A Status or a malformed Node is a ValueError, a Node without labels has none."""
    with pytest.raises(ValueError, match="not a Node"):
        parse_node_labels({"kind": "Status", "code": 404})
    with pytest.raises(ValueError, match="labels"):
        parse_node_labels({"kind": "Node", "metadata": {"labels": ["a"]}})
    assert parse_node_labels({"kind": "Node", "metadata": {"name": "n"}}) == {}
