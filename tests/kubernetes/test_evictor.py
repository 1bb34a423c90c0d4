"""Evictions through the Eviction API: the exact request, budgets, failures, fallback, critical pods."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Coroutine
from pathlib import Path
from typing import Any

import pytest

from nodeguard.actuators.cgroup_writer import CgroupWriter
from nodeguard.actuators.executor import Executor
from nodeguard.actuators.ledger import Ledger
from nodeguard.actuators.levers.cpu_quota import QuotaLever
from nodeguard.guard_tick import settle
from nodeguard.kubernetes.evictor import ApiEvictor, pod_uid_of
from nodeguard.kubernetes.integration import Kubernetes
from nodeguard.kubernetes.metadata import parse_pod_list
from nodeguard.kubernetes.settings import KubernetesSettings
from nodeguard.model.workloads import QosClass
from nodeguard.policy.actions import Evict
from nodeguard.policy.state import GuardState
from tests.kubernetes.conftest import Canned, FakeCgroupEvictor, FakeKube, Pki, settings_for
from tests.kubernetes.objects import NODE, budget_refusal, pod, pod_list, status
from tests.kubernetes.workloads import pod_cgroup, pod_usage
from tests.policy.builders import guard, snapshot

UID_A = "0f6a2f6e-3b1c-4c5e-9d7e-1a2b3c4d5e6f"
UID_B = "11111111-2222-3333-4444-555555555555"
UID_C = "66666666-7777-8888-9999-000000000000"
EVICTION_A = "/api/v1/namespaces/jobs/pods/batch-a/eviction"


def evictor_for(
    kube: FakeKube, settings: KubernetesSettings, *pods: dict[str, Any], cgroup: FakeCgroupEvictor | None = None
) -> tuple[ApiEvictor, FakeCgroupEvictor]:
    k8s = Kubernetes(settings, NODE)
    k8s.cache.replace(parse_pod_list(pod_list(list(pods))), time.monotonic())
    fallback = cgroup or FakeCgroupEvictor()
    return k8s.evictor(fallback), fallback


def batch_a(**extra: Any) -> dict[str, Any]:
    return pod("batch-a", UID_A, namespace="jobs", qos="BestEffort", cpu_requests=(None,), **extra)


async def test_eviction_request_is_exactly_right(kube: FakeKube, settings: KubernetesSettings) -> None:
    """POST to the pod's eviction subresource with the policy/v1 Eviction body and the pod's own grace period."""
    evictor, cgroup = evictor_for(kube, settings, batch_a(grace=45))
    assert await evictor.evict(pod_cgroup(UID_A), metric="memory_total_usage", gap=1.0, reason="r")
    (seen,) = kube.requests("POST", EVICTION_A)
    assert seen.headers["Content-Type"] == "application/json"
    assert seen.headers["Authorization"] == f"Bearer {kube.token}"
    assert seen.body == {
        "apiVersion": "policy/v1",
        "kind": "Eviction",
        "metadata": {"name": "batch-a", "namespace": "jobs"},
        "deleteOptions": {"gracePeriodSeconds": 45},
    }
    assert cgroup.calls == []
    await evictor.client.aclose()


async def test_configured_grace_period_overrides_the_pods(kube: FakeKube, pki: Pki, token_file: Path) -> None:
    """evictionGraceSeconds replaces the pod's terminationGracePeriodSeconds."""
    evictor, _ = evictor_for(kube, settings_for(kube, pki, token_file, evictionGraceSeconds=5), batch_a(grace=45))
    assert await evictor.evict(pod_cgroup(UID_A))
    assert kube.requests("POST", EVICTION_A)[0].body["deleteOptions"] == {"gracePeriodSeconds": 5}
    await evictor.client.aclose()


async def test_already_gone_pod_counts_as_evicted(kube: FakeKube, settings: KubernetesSettings) -> None:
    """A 404 NotFound means the pod is gone already: True, nothing held back."""
    kube.evictions["jobs/batch-a"] = Canned(404, status(404, "NotFound", 'pods "batch-a" not found'))
    evictor, _ = evictor_for(kube, settings, batch_a())
    assert await evictor.evict(pod_cgroup(UID_A))
    assert evictor.cache.holds == {}
    await evictor.client.aclose()


@pytest.mark.parametrize("mode", ["api", "api-then-cgroup"])
async def test_budget_refusal_never_falls_back(kube: FakeKube, pki: Pki, token_file: Path, mode: str) -> None:
    """A 429 (or a 500 about disruption budgets) is False and holds the pod back; the cgroup is never killed."""
    settings = settings_for(kube, pki, token_file, evictVia=mode)
    kube.evictions["jobs/batch-a"] = Canned(429, budget_refusal("batch-a", "jobs"))
    kube.evictions["jobs/batch-b"] = Canned(
        500,
        status(
            500,
            "InternalError",
            "This pod has more than one PodDisruptionBudget, which the eviction subresource does not support.",
        ),
    )
    batch_b = pod("batch-b", UID_B, namespace="jobs", qos="BestEffort")
    evictor, cgroup = evictor_for(kube, settings, batch_a(), batch_b)
    assert not await evictor.evict(pod_cgroup(UID_A))
    assert not await evictor.evict(pod_cgroup(UID_B))
    assert cgroup.calls == []
    assert evictor.cache.held(UID_A, time.monotonic()) and evictor.cache.held(UID_B, time.monotonic())
    await evictor.client.aclose()


@pytest.mark.parametrize(
    "failure",
    [
        Canned(500, status(500, "InternalError", "etcdserver: leader changed")),
        Canned(hang=True),
        Canned(403, status(403, "Forbidden", "no")),
    ],
    ids=["500", "timeout", "403"],
)
async def test_api_failure_falls_back_only_when_configured(
    kube: FakeKube, pki: Pki, token_file: Path, failure: Canned
) -> None:
    """When the API cannot be asked, evictVia api gives up (held back); api-then-cgroup kills the cgroup instead."""
    kube.evictions["jobs/batch-a"] = failure
    only_api, cgroup = evictor_for(kube, settings_for(kube, pki, token_file, timeoutSeconds=0.3), batch_a())
    assert not await only_api.evict(pod_cgroup(UID_A))
    assert cgroup.calls == []
    assert only_api.cache.held(UID_A, time.monotonic())
    with_fallback, cgroup = evictor_for(
        kube, settings_for(kube, pki, token_file, timeoutSeconds=0.3, evictVia="api-then-cgroup"), batch_a()
    )
    assert await with_fallback.evict(pod_cgroup(UID_A))
    assert cgroup.calls == [pod_cgroup(UID_A)]
    assert not with_fallback.cache.held(UID_A, time.monotonic())
    await only_api.client.aclose()
    await with_fallback.client.aclose()


@pytest.mark.parametrize("mode", ["api", "cgroup", "api-then-cgroup"])
async def test_system_critical_and_unknown_pods_are_never_evicted(
    kube: FakeKube, pki: Pki, token_file: Path, mode: str
) -> None:
    """system-node-critical, system-cluster-critical and pods without metadata are refused in every mode, nothing sent."""
    kube.evictions["kube-system/dns"] = Canned(500, status(500, "InternalError", "down"))  # would invite a fallback
    evictor, cgroup = evictor_for(
        kube,
        settings_for(kube, pki, token_file, evictVia=mode),
        pod("proxy", UID_A, namespace="kube-system", priority=2000001000, priority_class="system-node-critical"),
        pod("dns", UID_B, namespace="kube-system", priority=2000000000, priority_class="system-cluster-critical"),
    )
    for uid in (UID_A, UID_B, UID_C):
        assert not await evictor.evict(pod_cgroup(uid))
    assert kube.requests("POST") == []
    assert cgroup.calls == []
    await evictor.client.aclose()


async def test_cgroup_mode_and_non_pod_workloads_use_the_cgroup_evictor(
    kube: FakeKube, pki: Pki, token_file: Path
) -> None:
    """evictVia cgroup kills a known pod's cgroup; a configured group (no API object) always goes to the cgroup."""
    evictor, cgroup = evictor_for(kube, settings_for(kube, pki, token_file, evictVia="cgroup", events=False), batch_a())
    assert await evictor.evict(pod_cgroup(UID_A))
    assert await evictor.evict("system.slice/batch-1.service")
    assert cgroup.calls == [pod_cgroup(UID_A), "system.slice/batch-1.service"]
    assert kube.requests("POST") == []
    await evictor.client.aclose()


async def test_dry_run_sends_nothing(kube: FakeKube, settings: KubernetesSettings) -> None:
    """In a dry run the eviction is logged, not sent."""
    k8s = Kubernetes(settings, NODE, dry_run=True)
    k8s.cache.replace(parse_pod_list(pod_list([batch_a()])), time.monotonic())
    assert await k8s.evictor(FakeCgroupEvictor()).evict(pod_cgroup(UID_A))
    assert kube.requests("POST") == []
    await k8s.aclose()


def test_pod_uid_from_cgroup_paths() -> None:
    """Both drivers' pod cgroups give the UID; other cgroups give None."""
    assert pod_uid_of(pod_cgroup(UID_A, QosClass.BURSTABLE, "systemd")) == UID_A
    assert pod_uid_of(pod_cgroup(UID_A, QosClass.GUARANTEED)) == UID_A
    assert pod_uid_of("system.slice/cron.service") is None


async def test_budget_refusal_moves_on_to_the_next_candidate(
    kube: FakeKube, pki: Pki, token_file: Path, tmp_path: Path
) -> None:
    """Through the real executor: a 429 on the first pick leaves it alone for its back-off, and the next pod is evicted."""
    settings = settings_for(kube, pki, token_file, events=False)
    kube.pods = [batch_a(priority=-10), pod("batch-b", UID_B, namespace="jobs", qos="BestEffort", cpu_requests=(None,))]
    kube.evictions["jobs/batch-a"] = Canned(429, budget_refusal("batch-a", "jobs"))
    k8s = Kubernetes(settings, NODE)
    assert await k8s.refresher.refresh_once()
    tasks: list[asyncio.Task[None]] = []

    def spawn(coro: Coroutine[Any, Any, None], name: str) -> None:
        tasks.append(asyncio.create_task(coro, name=name))

    executor = Executor(
        QuotaLever(CgroupWriter(str(tmp_path)), "v2"),
        k8s.evictor(FakeCgroupEvictor()),
        Ledger.load(str(tmp_path / "ledger.json")),
        spawn,
    )
    rules = guard(
        {"metric": "memory_total_usage", "threshold": "1Gi", "action": "evict", "triggerAfter": 1},
        evictions={"maxPerTick": 1, "minIntervalSeconds": 0},
    )
    state = GuardState()
    evicted: list[str] = []
    for _ in range(4):
        snap = snapshot([pod_usage(UID_A), pod_usage(UID_B)], monotonic=time.monotonic(), memory_used=8 << 30)
        settled = settle(k8s.enrich(snap), state, rules, executor)
        evicted += [a.workload.name for a in settled.plan.actions if isinstance(a, Evict)]
        state = settled.state
        await asyncio.gather(*tasks)
        tasks.clear()
    assert evicted[:2] == ["jobs/batch-a", "jobs/batch-b"]
    assert [s.path for s in kube.requests("POST")].count(EVICTION_A) == 1  # not picked again while held back
    assert "jobs/batch-b" in {
        s.body["metadata"]["namespace"] + "/" + s.body["metadata"]["name"] for s in kube.requests("POST")
    }
    assert set(state.evictions) == {pod_cgroup(UID_B)}  # counted as releasing until its cgroup is gone
    await k8s.aclose()


@pytest.mark.parametrize(("mode", "cgroup_called"), [("api", False), ("api-then-cgroup", True)])
async def test_static_pod_is_not_evicted_through_its_mirror(
    kube: FakeKube, pki: Pki, token_file: Path, mode: str, cgroup_called: bool
) -> None:
    """Deleting a mirror pod would not stop a static pod: nothing is sent; only api-then-cgroup kills the cgroup."""
    static = "d41d8cd98f00b204e9800998ecf8427e"
    mirror = pod(
        "etcd-exporter-worker-1", UID_C, namespace="monitoring", annotations={"kubernetes.io/config.mirror": static}
    )
    evictor, cgroup = evictor_for(kube, settings_for(kube, pki, token_file, evictVia=mode, events=False), mirror)
    assert await evictor.evict(pod_cgroup(static)) is cgroup_called
    assert kube.requests("POST") == []
    assert cgroup.calls == ([pod_cgroup(static)] if cgroup_called else [])
    await evictor.client.aclose()


async def test_failed_cgroup_fallback_holds_the_static_pod_by_its_cgroup_uid(
    kube: FakeKube, pki: Pki, token_file: Path
) -> None:
    """A failed cgroup eviction of a static pod holds back the UID its cgroup carries, which enrich looks up."""
    static = "d41d8cd98f00b204e9800998ecf8427e"
    mirror = pod("agent-worker-1", UID_C, namespace="monitoring", annotations={"kubernetes.io/config.mirror": static})
    settings = settings_for(kube, pki, token_file, evictVia="api-then-cgroup", events=False)
    evictor, _ = evictor_for(kube, settings, mirror, cgroup=FakeCgroupEvictor(gone=False))
    assert not await evictor.evict(pod_cgroup(static))
    assert evictor.cache.held(static, time.monotonic())
    await evictor.client.aclose()
