"""The Kubernetes integration as the daemon sees it: one object, built from the ``kubernetes`` section.

- ``enrich(snapshot)``: in the tick, between sense and plan; no I/O.
- ``run()``: the metadata refresh, a task of the daemon's TaskGroup.
- ``evictor(cgroup_evictor)``: the Evictor to give the executor.
- ``emit(changes, snapshot, spawn)``: an Event for every lever change just
  made, each in its own task (evictions are recorded by the evictor, which
  knows whether the API took them).
- ``node_labels()``: this node's labels, for a reload.

Connection settings (URLs, token, CA, source) apply from start; a reload
changes the refresh period, eviction settings and events.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Coroutine, Iterable
from typing import Any

from nodeguard.actuators.changes import Done
from nodeguard.actuators.evictors import Evictor
from nodeguard.kubernetes.client import KubeClient
from nodeguard.kubernetes.events import EventRecorder
from nodeguard.kubernetes.evictor import ApiEvictor
from nodeguard.kubernetes.metadata import Memo, MetadataRefresher, PodCache, enrich
from nodeguard.kubernetes.nodes import api_client, fetch_node_labels
from nodeguard.kubernetes.settings import KubernetesSettings
from nodeguard.log import get_logger
from nodeguard.model.snapshot import Snapshot

log = get_logger("nodeguard.kubernetes")

Spawn = Callable[[Coroutine[Any, Any, None], str], None]


class Kubernetes:
    def __init__(
        self,
        settings: KubernetesSettings,
        node: str,
        *,
        dry_run: bool = False,
        api: KubeClient | None = None,
        kubelet: KubeClient | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.settings = settings
        self.node = node
        self.dry_run = dry_run
        self.cache = PodCache()
        self.api = api or api_client(settings)
        if settings.source == "kubelet":
            self.metadata_client = kubelet or KubeClient(
                settings.resolved_kubelet_url(),
                token_path=settings.token_path,
                ca_path=settings.resolved_kubelet_ca_path(),
                timeout_seconds=settings.timeout_seconds,
            )
        else:
            self.metadata_client = self.api
        self.refresher = MetadataRefresher(
            self._list_pods, self.cache, settings.refresh_seconds, clock=clock, source=settings.source
        )
        self.recorder = EventRecorder(self.api, self.cache, node)
        self._evictors: list[ApiEvictor] = []
        self._memo: Memo = {}

    async def _list_pods(self) -> Any:
        if self.settings.source == "kubelet":
            return await self.metadata_client.get_json("/pods")
        # resourceVersion=0: served from the API server's watch cache, not etcd.
        params = {"fieldSelector": f"spec.nodeName={self.node}", "resourceVersion": "0"}
        return await self.metadata_client.get_json("/api/v1/pods", params)

    def enrich(self, snapshot: Snapshot) -> Snapshot:
        """Pod metadata over the snapshot's pods; unknown UIDs ask the refresh task for an early list."""
        enriched = enrich(snapshot, self.cache, self._memo)
        self.refresher.want(enriched.unknown)
        return enriched.snapshot

    def evictor(self, cgroup: Evictor) -> ApiEvictor:
        evictor = ApiEvictor(
            self.api,
            self.cache,
            self.settings,
            cgroup,
            recorder=self.recorder if self.settings.events else None,
            dry_run=self.dry_run,
        )
        self._evictors.append(evictor)
        return evictor

    def emit(self, changes: Iterable[Done], snapshot: Snapshot, spawn: Spawn) -> None:
        """An Event per lever change made (the executor reports only what the kernel took); fire and forget."""
        if not self.settings.events:
            return
        for done in changes:
            usage = snapshot.workloads.get(done.change.group)
            if usage is not None and not usage.workload.pod_uid:
                continue  # a plain host's group: no object to attach it to
            pod_uid = None if usage is None else usage.workload.pod_uid
            spawn(self._emit(done, pod_uid), f"event:{done.change.lever}:{done.change.group}")

    async def _emit(self, done: Done, pod_uid: str | None) -> None:
        try:
            await self.recorder.emit(done, pod_uid)
        except Exception as exc:  # best effort: a bug here must not end the daemon's TaskGroup
            self.recorder.failed += 1
            log.error("recording an event failed", group=done.change.group, error=str(exc), exc_info=True)

    async def node_labels(self) -> dict[str, str]:
        return await fetch_node_labels(self.api, self.node)

    async def run(self) -> None:
        await self.refresher.run()

    def reconfigure(self, settings: KubernetesSettings) -> None:
        keep = ("enabled", "source", "kubelet_url", "api_server_url", "token_path", "ca_path", "kubelet_ca_path")
        if any(getattr(settings, name) != getattr(self.settings, name) for name in keep):
            log.warning("kubernetes connection settings change only on restart; the rest is reloaded")
        self.settings = settings
        self.refresher.refresh_seconds = settings.refresh_seconds
        for evictor in self._evictors:
            evictor.settings = settings
            evictor.recorder = self.recorder if settings.events else None

    def status(self) -> dict[str, Any]:
        refreshed = self.cache.refreshed_at
        return {
            "source": self.settings.source,
            "pods": len({pod.uid for pod in self.cache.pods.values()}),
            "metadataAgeSeconds": None if refreshed is None else round(time.monotonic() - refreshed, 1),
            "refreshes": self.refresher.refreshes,
            "refreshFailures": self.refresher.failures,
            "heldBack": len(self.cache.holds),
            "events": {"sent": self.recorder.sent, "failed": self.recorder.failed, "dropped": self.recorder.dropped},
            "evictions": {k: v for e in self._evictors for k, v in e.outcomes.items()},
        }

    async def aclose(self) -> None:
        await self.api.aclose()
        if self.metadata_client is not self.api:
            await self.metadata_client.aclose()
