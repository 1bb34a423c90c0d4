"""This node's labels from the API server, to select the config's perNode rules.

Read at start (before the event loop runs: ``fetch_node_labels_sync``) and on
reload (``fetch_node_labels``). Connection settings come from the document's
``global.kubernetes`` section: perNode rules cannot say how to fetch the
labels that select them.
"""

from __future__ import annotations

import asyncio
from collections.abc import Collection, Mapping
from urllib.parse import quote

from nodeguard.kubernetes.client import KubeClient, KubeError
from nodeguard.kubernetes.settings import KubernetesSettings
from nodeguard.log import get_logger

log = get_logger("nodeguard.kubernetes.nodes")


def api_client(settings: KubernetesSettings) -> KubeClient:
    return KubeClient(
        settings.resolved_api_server_url(),
        token_path=settings.token_path,
        ca_path=settings.ca_path,
        timeout_seconds=settings.timeout_seconds,
    )


def parse_node_labels(body: object) -> dict[str, str]:
    """``metadata.labels`` of a Node object; ValueError when it is not one."""
    if not isinstance(body, Mapping) or body.get("kind") not in (None, "Node"):
        raise ValueError("the answer is not a Node")
    metadata = body.get("metadata")
    labels = metadata.get("labels") if isinstance(metadata, Mapping) else None
    if labels is None:
        return {}
    if not isinstance(labels, Mapping):
        raise ValueError("the Node's metadata.labels is not an object")
    return {k: v for k, v in labels.items() if isinstance(k, str) and isinstance(v, str)}


async def fetch_node_labels(client: KubeClient, node: str) -> dict[str, str]:
    """GET /api/v1/nodes/<node>: its labels. KubeError or ValueError on failure."""
    return parse_node_labels(await client.get_json(f"/api/v1/nodes/{quote(node, safe='')}"))


async def fetch_node_labels_retrying(
    settings: KubernetesSettings, node: str, attempts: int = 3, delay: float = 1.0
) -> dict[str, str] | None:
    """The labels, trying a few times; None (logged) when the API server does not give them."""
    client = api_client(settings)
    try:
        for attempt in range(1, attempts + 1):
            try:
                return await fetch_node_labels(client, node)
            except (KubeError, ValueError) as exc:
                log.warning("cannot read this node's labels", node=node, attempt=attempt, error=str(exc))
            if attempt < attempts:
                await asyncio.sleep(delay * 2 ** (attempt - 1))
    finally:
        await client.aclose()
    return None


def fetch_node_labels_sync(
    settings: KubernetesSettings, node: str, attempts: int = 3, delay: float = 1.0
) -> dict[str, str] | None:
    """For start-up, before the daemon's event loop exists; must not be called from a running loop."""
    return asyncio.run(fetch_node_labels_retrying(settings, node, attempts, delay))


def merge_labels(
    local: Mapping[str, str], api: Mapping[str, str] | None, explicit: Collection[str] = ()
) -> dict[str, str]:
    """The API's labels over the local guesses (the hostname label), except keys given explicitly (--node-label)."""
    if api is None:
        return dict(local)
    merged = {**local, **api}
    for key in explicit:
        if key in local:
            merged[key] = local[key]
    return merged
