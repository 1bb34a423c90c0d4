"""The metadata refresh task against a live (fake) server: listing, back-off, early refresh, never blocking the tick."""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from nodeguard.backoff import Backoff
from nodeguard.kubernetes.integration import Kubernetes
from nodeguard.kubernetes.settings import KubernetesSettings
from tests.kubernetes.conftest import Canned, FakeKube, Pki, settings_for
from tests.kubernetes.objects import NODE, pod, status
from tests.kubernetes.workloads import pod_usage
from tests.policy.builders import snapshot
from tests.support.poll import wait_until_async

UID_A = "0f6a2f6e-3b1c-4c5e-9d7e-1a2b3c4d5e6f"
UID_B = "11111111-2222-3333-4444-555555555555"


@contextlib.asynccontextmanager
async def running(k8s: Kubernetes) -> AsyncIterator[asyncio.Task[None]]:
    task = asyncio.create_task(k8s.run(), name="kubernetes")
    try:
        yield task
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
        await k8s.aclose()


async def test_lists_this_nodes_pods_from_the_api_server(kube: FakeKube, settings: KubernetesSettings) -> None:
    """The API server is asked for this node's pods only (fieldSelector), from its cache; others are not cached."""
    kube.pods = [pod("a", UID_A), pod("elsewhere", UID_B, node="worker-2")]
    k8s = Kubernetes(settings, NODE)
    async with running(k8s):
        await wait_until_async(lambda: k8s.cache.loaded, 5, "the pods listed")
    (seen,) = kube.requests("GET", "/api/v1/pods")
    assert seen.query == {"fieldSelector": [f"spec.nodeName={NODE}"], "resourceVersion": ["0"]}
    assert set(k8s.cache.pods) == {UID_A}


async def test_kubelet_source_reads_pods_endpoint(kube: FakeKube, pki: Pki, token_file: Path) -> None:
    """With source kubelet, metadata comes from the kubelet's authenticated /pods."""
    kube.pods = [pod("a", UID_A)]
    k8s = Kubernetes(settings_for(kube, pki, token_file, source="kubelet"), NODE)
    async with running(k8s):
        await wait_until_async(lambda: k8s.cache.loaded, 5, "the pods listed")
    assert [s.path for s in kube.requests("GET")] == ["/pods"]
    assert kube.requests("GET")[0].headers["Authorization"].startswith("Bearer ")
    assert UID_A in k8s.cache.pods


@pytest.mark.parametrize(
    "failure",
    [
        Canned(500, status(500, "InternalError", "etcdserver: request timed out")),
        Canned(hang=True),
        Canned(200, raw=b"\x00\xffnot json"),
        Canned(200, {"kind": "Status", "status": "Success"}),
    ],
    ids=["500", "timeout", "garbage", "not-a-podlist"],
)
async def test_errors_back_off_and_keep_what_is_known(
    kube: FakeKube, pki: Pki, token_file: Path, failure: Canned
) -> None:
    """A failing list keeps the last good metadata, retries after a growing back-off, and recovers."""
    kube.pods = [pod("a", UID_A)]
    k8s = Kubernetes(settings_for(kube, pki, token_file, timeoutSeconds=0.2), NODE)
    k8s.refresher.refresh_seconds = 0.05
    k8s.refresher.backoff = Backoff(0.3, 1.0, jitter=0.0)
    async with running(k8s):
        await wait_until_async(lambda: k8s.cache.loaded, 5, "the pods listed")
        kube.overrides[("GET", "/api/v1/pods")] = failure
        await wait_until_async(lambda: k8s.refresher.failures >= 2, 5, "two failed lists")
        failed_at = len(kube.requests("GET"))
        await asyncio.sleep(0.1)  # the scenario: two refresh periods in which backing off sends nothing
        assert len(kube.requests("GET")) == failed_at  # backing off: not polling every 50 ms
        assert set(k8s.cache.pods) == {UID_A}  # what it knew still holds
        kube.pods.append(pod("b", UID_B))
        del kube.overrides[("GET", "/api/v1/pods")]
        await wait_until_async(lambda: UID_B in k8s.cache.pods, 5, "pod b listed")
    assert k8s.refresher.backoff.failures == 0


async def test_missing_token_backs_off_until_it_appears(kube: FakeKube, pki: Pki, tmp_path: Path) -> None:
    """Without a readable token nothing is sent and the task backs off; once the token is mounted, pods are listed."""
    token = tmp_path / "token"
    kube.pods = [pod("a", UID_A)]
    k8s = Kubernetes(settings_for(kube, pki, token), NODE)
    k8s.refresher.backoff = Backoff(0.1, 0.2, jitter=0.0)
    async with running(k8s):
        await wait_until_async(lambda: k8s.refresher.failures >= 2, 5, "two failed lists")
        assert kube.requests() == []
        token.write_text(kube.token)
        await wait_until_async(lambda: k8s.cache.loaded, 5, "the pods listed")
    assert UID_A in k8s.cache.pods


async def test_tick_side_never_waits_for_a_hanging_server(kube: FakeKube, pki: Pki, token_file: Path) -> None:
    """While the list hangs, enrich returns at once, leaves unknown pods unknown, and the loop keeps ticking."""
    kube.overrides[("GET", "/api/v1/pods")] = Canned(hang=True)
    k8s = Kubernetes(settings_for(kube, pki, token_file, timeoutSeconds=3), NODE)
    snap = snapshot([pod_usage(f"{i:08d}-0000-4000-8000-000000000000") for i in range(200)])
    ticks: list[float] = []
    async with running(k8s):
        await wait_until_async(lambda: kube.requests("GET"), 5, "the list sent")
        for _ in range(20):  # 20 "ticks" of 10 ms while the request is in flight
            started = time.perf_counter()
            enriched = k8s.enrich(snap)
            ticks.append(time.perf_counter() - started)
            await asyncio.sleep(0.01)  # the scenario: the next tick 10 ms later
        assert not k8s.cache.loaded
    assert max(ticks) < 0.05
    assert not any(u.workload.metadata_known for u in enriched.workloads.values())


async def test_unknown_uid_triggers_an_early_refresh(kube: FakeKube, settings: KubernetesSettings) -> None:
    """A new pod cgroup whose UID is unknown makes the task list again soon, not after refreshSeconds (60 s)."""
    kube.pods = [pod("a", UID_A)]
    k8s = Kubernetes(settings, NODE)
    async with running(k8s):
        await wait_until_async(lambda: k8s.cache.loaded, 5, "the pods listed")
        kube.pods.append(pod("b", UID_B))  # scheduled and started after the list
        snap = snapshot([pod_usage(UID_A), pod_usage(UID_B)])
        assert not next(
            u for u in k8s.enrich(snap).workloads.values() if u.workload.pod_uid == UID_B
        ).workload.metadata_known
        await wait_until_async(lambda: UID_B in k8s.cache.pods, 3.0, "pod b listed")
        enriched = k8s.enrich(snap)
        assert all(u.workload.metadata_known for u in enriched.workloads.values())
        lists = len(kube.requests("GET"))
        for _ in range(3):
            k8s.enrich(snapshot([pod_usage("99999999-0000-4000-8000-000000000000")]))
            await asyncio.sleep(0.05)  # the scenario: three ticks 50 ms apart, each seeing the unknown UID
        await wait_until_async(lambda: len(kube.requests("GET")) > lists, 3.0, "another list")
        for _ in range(15):  # it stays unknown, tick after tick
            k8s.enrich(snapshot([pod_usage("99999999-0000-4000-8000-000000000000")]))
            await asyncio.sleep(0.1)  # the scenario: 1.5 s of ticks in which no further list may go out
    # A UID that stays unknown asks once, not every tick.
    assert len(kube.requests("GET")) == lists + 1
