"""Kubernetes Events for every lever change and for evictions: their bodies, and that failures never block."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Coroutine
from datetime import datetime
from pathlib import Path
from typing import Any

from nodeguard.actuators import levers
from nodeguard.actuators.cgroup_writer import CgroupWriter
from nodeguard.actuators.changes import Done
from nodeguard.actuators.executor import Executor
from nodeguard.actuators.ledger import Ledger
from nodeguard.kubernetes.events import REASONS, event_kind
from nodeguard.kubernetes.integration import Kubernetes
from nodeguard.kubernetes.metadata import enrich, parse_pod_list
from nodeguard.kubernetes.settings import KubernetesSettings
from nodeguard.model.levers import CPU_QUOTA, CPU_WEIGHT, TERMS, LeverChange
from nodeguard.model.snapshot import Snapshot
from nodeguard.policy.metrics import Metric
from nodeguard.policy.planner import plan
from nodeguard.policy.state import GuardState
from tests.kubernetes.conftest import Canned, FakeCgroupEvictor, FakeKube
from tests.kubernetes.objects import NODE, pod, pod_list, status
from tests.kubernetes.workloads import pod_cgroup, pod_usage
from tests.policy.builders import cpu_throttle, guard, snapshot
from tests.support.poll import wait_until_async

UID_A = "0f6a2f6e-3b1c-4c5e-9d7e-1a2b3c4d5e6f"
EVENTS = "/api/v1/namespaces/jobs/events"


def loaded(settings: KubernetesSettings) -> Kubernetes:
    k8s = Kubernetes(settings, NODE)
    k8s.cache.replace(
        parse_pod_list(pod_list([pod("batch-a", UID_A, namespace="jobs", qos="BestEffort", cpu_requests=(None,))])),
        time.monotonic(),
    )
    return k8s


def seen(k8s: Kubernetes) -> Snapshot:
    return enrich(snapshot([pod_usage(UID_A, cores=3.0)], cores_used=7.0), k8s.cache).snapshot


LEVERS = levers.build(CgroupWriter("/nonexistent"), "v1")


def throttle_action(k8s: Kubernetes) -> LeverChange:
    result = plan(seen(k8s), GuardState(), guard(cpu_throttle(threshold=6.0, restore=5.0)))
    (action,) = result.actions
    assert isinstance(action, LeverChange) and action.kind == "throttle"
    return action


def done(change: LeverChange) -> Done:
    """The executor's report of a lever change carried out."""
    lever = LEVERS[change.lever]
    assert change.target is not None and change.previous is not None
    shown = (lever.shown(change.previous), lever.shown(change.target))
    return Done(change, change.previous, change.target, 0, change.holds_back, shown)


def weight_done(group: str, lower: bool, workloads: tuple[str, ...] = ()) -> Done:
    reason = "protected workload harmed" if lower else "weight back: nobody wants the CPU it held"
    before, after = ("307", "2") if lower else ("2", "307")
    change = LeverChange(CPU_WEIGHT.name, group, after, None, release=not lower, holds_back=lower, kind="reweigh",
                         metric=Metric.PROTECTED_CPU_STALL, reason=reason, workloads=workloads, previous=before)  # fmt: skip
    return done(change)


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
    k8s.emit([done(action)], seen(k8s), spawn)
    await asyncio.gather(*spawn.tasks)
    (posted,) = kube.requests("POST", EVENTS)
    body = posted.body
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
    restore = LeverChange(
        lever=CPU_QUOTA.name,
        group=throttle.group,
        target="max 100000",
        give_back="max 100000",
        release=True,
        holds_back=False,
        kind="restore",
        metric=Metric.CPU_TOTAL_USAGE,
        reason="released: back to the original limit",
        workload=throttle.workload,
        gap_before=0.5,
        predicted_release=-1.0,
        previous=throttle.target,
    )
    assert await k8s.recorder.emit(done(restore), UID_A)
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
    (posted,) = kube.requests("POST", EVENTS)
    assert (posted.body["reason"], posted.body["type"]) == ("NodeguardEvicted", "Warning")
    assert posted.body["message"].startswith("memory_total_usage: gap 2.147e+09; memory past 8Gi")
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
    assert not await k8s.recorder.emit(done(action), UID_A)
    assert k8s.recorder.failed == 1
    kube.overrides[("POST", EVENTS)] = Canned(hang=True)
    k8s.recorder.max_in_flight = 2
    spawn = Spawner()
    started = time.perf_counter()
    k8s.emit([done(action)] * 5, seen(k8s), spawn)
    assert time.perf_counter() - started < 0.5  # the tick only schedules tasks
    # The scheduled tasks run while it waits: two posts start (and hang), three are dropped.
    await wait_until_async(lambda: (k8s.recorder.in_flight, k8s.recorder.dropped) == (2, 3), 10,
                           "two posts in flight and three dropped", interval=0)  # fmt: skip
    for task in spawn.tasks:
        task.cancel()
    await asyncio.gather(*spawn.tasks, return_exceptions=True)
    await k8s.aclose()


async def test_no_event_for_unknown_pods_or_when_disabled(kube: FakeKube, settings: KubernetesSettings) -> None:
    """Pods without metadata and events: false send nothing."""
    k8s = loaded(settings)
    action = throttle_action(k8s)
    snap = seen(k8s)
    k8s.cache.replace(parse_pod_list(pod_list([])), time.monotonic())
    assert not await k8s.recorder.emit(done(action), UID_A)
    k8s.reconfigure(settings.model_copy(update={"events": False}))
    spawn = Spawner()
    k8s.emit([done(action)], snap, spawn)
    assert spawn.tasks == []
    assert kube.requests("POST") == []
    await k8s.aclose()


async def test_events_follow_what_the_executor_did(
    kube: FakeKube, settings: KubernetesSettings, tmp_path: Path
) -> None:
    """Only changes the kernel took are Events: a throttle whose write is refused records none, a dry run none,
    the same throttle written records one."""
    k8s = loaded(settings)
    snap = seen(k8s)
    result = plan(snap, GuardState(), guard(cpu_throttle(threshold=6.0, restore=5.0)))
    group = tmp_path / result.actions[0].workload_id
    (group / "cpu.max").mkdir(parents=True)  # a directory: reading and writing it fail (EISDIR)
    executor = Executor(levers.build(CgroupWriter(str(tmp_path)), "v2"), FakeCgroupEvictor(),
                        Ledger(str(tmp_path / "ledger.json")), Spawner())  # fmt: skip
    refused = executor.apply(result.changes)
    assert refused.done == [] and executor.counters.failed == 1
    dry = plan(snap, GuardState(), guard(cpu_throttle(threshold=6.0, restore=5.0), dryRun=True))
    assert executor.apply(dry.changes).done == []
    (group / "cpu.max").rmdir()
    (group / "cpu.max").write_text("max 100000")
    written = executor.apply(result.changes)
    spawn = Spawner()
    k8s.emit(written.done, snap, spawn)
    await asyncio.gather(*spawn.tasks)
    assert [r.body["reason"] for r in kube.requests("POST", EVENTS)] == ["NodeguardThrottled"]
    await k8s.aclose()


async def test_weight_events_on_the_pod_or_on_the_node(kube: FakeKube, settings: KubernetesSettings) -> None:
    """A lowered weight is a Warning on the pod whose cgroup it is, a tier's a Warning on the Node; putting one
    back is Normal; each message says what was held back and the values."""
    k8s = loaded(settings)
    snap = seen(k8s)
    spawn = Spawner()
    tier = "kubepods.slice/kubepods-besteffort.slice"
    k8s.emit([weight_done(tier, True, (pod_cgroup(UID_A),)), weight_done(pod_cgroup(UID_A), False)], snap, spawn)
    await asyncio.gather(*spawn.tasks)
    on_node = kube.requests("POST", "/api/v1/namespaces/default/events")
    on_pod = kube.requests("POST", EVENTS)
    assert len(on_node) == 1 and len(on_pod) == 1
    node_body, pod_body = on_node[0].body, on_pod[0].body
    assert node_body["involvedObject"] == {"apiVersion": "v1", "kind": "Node", "name": NODE, "uid": NODE,
                                           "namespace": ""}  # fmt: skip
    assert (node_body["reason"], node_body["type"]) == ("NodeguardWeightLowered", "Warning")
    assert "weight 307 -> 2" in node_body["message"] and pod_cgroup(UID_A) in node_body["message"]
    assert (pod_body["reason"], pod_body["type"]) == ("NodeguardWeightRestored", "Normal")
    assert pod_body["involvedObject"]["name"] == "batch-a"
    await k8s.aclose()


def test_every_registered_lever_has_both_events() -> None:
    """A lever added to the registry without its Events fails here: one for holding back, one for giving back,
    each a reason of its own among those recorded."""
    reasons = {kind.reason for kind in REASONS}
    for kind in levers.REGISTERED:
        held, back = TERMS[kind.name].holds, TERMS[kind.name].gives_back
        assert held.reason != back.reason and {held.reason, back.reason} <= reasons
        assert (held.type, back.type) == ("Warning", "Normal")
        change = LeverChange(kind.name, "g", "1", None, release=False, holds_back=True, kind="x", metric="m",
                             reason="r")  # fmt: skip
        assert event_kind(Done(change, "2", "1", 0, True)) == held
        assert event_kind(Done(change, "1", "2", 0, False)) == back
