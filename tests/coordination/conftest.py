"""The coordination tests' broker (a real mosquitto per test) and the cluster a test module declares."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.coordination.harness import NodeProcess
from tests.support.broker import Broker, skip_without_mosquitto
from tests.support.cluster import Cluster, ClusterNode, ClusterSpec, GatedDaemon


@pytest.fixture
def broker(tmp_path: Path) -> Iterator[Broker]:
    skip_without_mosquitto()
    broker = Broker(tmp_path).start()
    try:
        yield broker
    finally:
        broker.stop()


@pytest.fixture
def cluster(broker: Broker, tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[Cluster[Any]]:
    """The cluster the test module declares as ``CLUSTER`` (a ClusterSpec), every node admitting; stopped after."""
    spec: ClusterSpec = request.module.CLUSTER
    gate = spec.gate

    def make_node(name: str, coordination: dict[str, Any], workdir: Path) -> ClusterNode:
        if gate is None:
            return NodeProcess(name, coordination, workdir)
        return GatedDaemon(name, coordination, workdir, gate)

    made = Cluster(broker, tmp_path, spec, make_node)
    try:
        made.wait_admitting()
        yield made
    finally:
        made.close()
