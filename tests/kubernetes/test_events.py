"""Kubernetes Events for throttles, restores and evictions: their bodies, and that failures never block."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Coroutine
from dataclasses import replace
from datetime import datetime
from typing import Any

from nodeguard.kubernetes.integration import Kubernetes
from nodeguard.kubernetes.metadata import enrich, parse_pod_list
from nodeguard.kubernetes.settings import KubernetesSettings
from nodeguard.model.samples import CpuMax
from nodeguard.policy.actions import Restore, Throttle
from nodeguard.policy.metrics import Metric
from nodeguard.policy.planner import plan
from nodeguard.policy.state import GuardState
from tests.kubernetes.conftest import Canned, FakeCgroupEvictor, FakeKube
from tests.kubernetes.objects import NODE, pod, pod_list, status
from tests.kubernetes.workloads import pod_cgroup, pod_usage
from tests.policy.builders import cpu_throttle, guard, snapshot

UID_A = "0f6a2f6e-3b1c-4c5e-9d7e-1a2b3c4d5e6f"
EVENTS = "/api/v1/namespaces/jobs/events"


def loaded(settings: KubernetesSettings) -> Kubernetes:
    k8s = Kubernetes(settings, NODE)
    k8s.cache.replace(
        parse_pod_list(pod_list([pod("batch-a", UID_A, namespace="jobs", qos="BestEffort", cpu_requests=(None,))])),
        time.monotonic(),
    )
    return k8s


def throttle_action(k8s: Kubernetes) -> Throttle:
    snap = enrich(snapshot([pod_usage(UID_A, cores=3.0)], cores_used=7.0), k8s.cache).snapshot
    result = plan(snap, GuardState(), guard(cpu_throttle(threshold=6.0, restore=5.0)))
    (action,) = result.actions
    assert isinstance(action, Throttle)
    return action


class Spawner:
    def __init__(self) -> None:
        self.tasks: list[asyncio.Task[None]] = []

    def __call__(self, coro: Coroutine[Any, Any, None], name: str) -> None:
        self.tasks.append(asyncio.create_task(coro, name=name))


async def test_throttle_event_body(kube: FakeKube, settings: KubernetesSettings) -> None:
    """A throttle records a Warning NodeguardThrottled Event on the pod, with the metric, gap and new limit."""
    k8s = loaded(settings)
    action = throttle_action(k8s)
    spawn = Spawner()
    k8s.emit([action], spawn)
    await asyncio.gather(*spawn.tasks)
    (seen,) = kube.requests("POST", EVENTS)
    body = seen.body
    assert body["apiVersion"] == "v1" and body["kind"] == "Event"
    assert body["metadata"]["namespace"] == "jobs"
    assert body["metadata"]["name"].startswith("batch-a.")
    assert body["involvedObject"] == {
        "apiVersion": "v1",
        "kind": "Pod",
        "namespace": "jobs",
        "name": "batch-a",
        "uid": UID_A,
    }
    assert (body["reason"], body["type"], body["action"]) == ("NodeguardThrottled", "Warning", "Throttle")
    assert body["source"] == {"component": "nodeguard", "host": NODE}
    assert body["reportingComponent"] == "nodeguard"
    assert body["reportingInstance"] == f"nodeguard-{NODE}"
    assert body["count"] == 1 and body["firstTimestamp"] == body["lastTimestamp"]
    datetime.fromisoformat(body["firstTimestamp"])
    assert body["message"].startswith("cpu_total_usage: gap 1;")
    assert "unlimited ->" in body["message"]
    assert k8s.recorder.sent == 1
    await k8s.aclose()


async def test_restore_event_is_normal(kube: FakeKube, settings: KubernetesSettings) -> None:
    """A restore records a Normal NodeguardRestored Event."""
    k8s = loaded(settings)
    throttle = throttle_action(k8s)
    restore = Restore(
        workload=throttle.workload,
        metric=Metric.CPU_TOTAL_USAGE,
        reason="released: back to the original limit",
        gap_before=0.5,
        predicted_release=-1.0,
        quota=CpuMax(None),
        previous=throttle.quota,
        original=CpuMax(None),
        full=True,
        dry_run=False,
    )
    assert await k8s.recorder.emit(restore)
    body = kube.requests("POST", EVENTS)[0].body
    assert (body["reason"], body["type"], body["action"]) == ("NodeguardRestored", "Normal", "Restore")
    assert body["message"].endswith("-> unlimited")
    await k8s.aclose()


async def test_eviction_event_after_the_api_accepts(kube: FakeKube, settings: KubernetesSettings) -> None:
    """An accepted eviction records NodeguardEvicted with the metric and gap; a refused one records none."""
    k8s = loaded(settings)
    evictor = k8s.evictor(FakeCgroupEvictor())
    assert await evictor.evict(
        pod_cgroup(UID_A), metric="memory_total_usage", gap=2147483648.0, reason="memory past 8Gi"
    )
    (seen,) = kube.requests("POST", EVENTS)
    assert (seen.body["reason"], seen.body["type"]) == ("NodeguardEvicted", "Warning")
    assert seen.body["message"].startswith("memory_total_usage: gap 2.147e+09; memory past 8Gi")
    kube.evictions["jobs/batch-a"] = Canned(
        429, status(429, "TooManyRequests", "Cannot evict pod as it would violate the pod's disruption budget.")
    )
    assert not await evictor.evict(pod_cgroup(UID_A), metric="memory_total_usage", gap=1.0, reason="r")
    assert len(kube.requests("POST", EVENTS)) == 1
    await k8s.aclose()


async def test_event_failures_are_counted_and_never_block(kube: FakeKube, settings: KubernetesSettings) -> None:
    """A failing or hanging events endpoint: emit() returns at once, failures are counted, extra events dropped."""
    k8s = loaded(settings)
    action = throttle_action(k8s)
    kube.overrides[("POST", EVENTS)] = Canned(
        403, status(403, "Forbidden", 'events is forbidden: User "x" cannot create')
    )
    assert not await k8s.recorder.emit(action)
    assert k8s.recorder.failed == 1
    kube.overrides[("POST", EVENTS)] = Canned(hang=True)
    k8s.recorder.max_in_flight = 2
    spawn = Spawner()
    started = time.perf_counter()
    k8s.emit([action] * 5, spawn)
    assert time.perf_counter() - started < 0.5  # the tick only schedules tasks
    deadline = time.monotonic() + 10
    while (k8s.recorder.in_flight, k8s.recorder.dropped) != (2, 3) and time.monotonic() < deadline:
        await asyncio.sleep(0)  # let the scheduled tasks run: two posts start (and hang), three are dropped
    assert k8s.recorder.in_flight == 2 and k8s.recorder.dropped == 3
    for task in spawn.tasks:
        task.cancel()
    await asyncio.gather(*spawn.tasks, return_exceptions=True)
    await k8s.aclose()


async def test_no_event_for_dry_runs_unknown_pods_or_when_disabled(
    kube: FakeKube, settings: KubernetesSettings
) -> None:
    """Dry-run actions, pods without metadata and events: false send nothing."""
    k8s = loaded(settings)
    action = throttle_action(k8s)
    assert not await k8s.recorder.emit(replace(action, dry_run=True))
    k8s.cache.replace(parse_pod_list(pod_list([])), time.monotonic())
    assert not await k8s.recorder.emit(action)
    k8s.reconfigure(settings.model_copy(update={"events": False}))
    spawn = Spawner()
    k8s.emit([action], spawn)
    assert spawn.tasks == []
    assert kube.requests("POST") == []
    await k8s.aclose()


async def test_no_event_for_a_quota_write_that_failed(kube: FakeKube, settings: KubernetesSettings) -> None:
    """Given the throttles the executor really holds, a throttle whose write failed records no Event."""
    k8s = loaded(settings)
    action = throttle_action(k8s)
    spawn = Spawner()
    k8s.emit([action], spawn, held={})  # the executor dropped it: the write failed
    assert spawn.tasks == []
    snap = enrich(snapshot([pod_usage(UID_A, cores=3.0)], cores_used=7.0), k8s.cache).snapshot
    result = plan(snap, GuardState(), guard(cpu_throttle(threshold=6.0, restore=5.0)))
    k8s.emit(result.actions, spawn, held=result.state.throttles)
    await asyncio.gather(*spawn.tasks)
    assert len(kube.requests("POST", EVENTS)) == 1
    await k8s.aclose()
