"""Pod metadata: parsing Pod objects, and laying them over the snapshot's pod cgroups."""

from __future__ import annotations

from dataclasses import replace
from datetime import datetime

import pytest

from nodeguard.kubernetes.metadata import PodCache, enrich, parse_pod, parse_pod_list
from nodeguard.model.workloads import OWN_WORKLOAD, QosClass
from nodeguard.policy.actions import Evict
from nodeguard.policy.planner import plan
from nodeguard.policy.state import GuardState
from tests.kubernetes.objects import pod, pod_list
from tests.kubernetes.workloads import pod_usage
from tests.policy.builders import cpu_throttle, guard, snapshot

UID_A = "0f6a2f6e-3b1c-4c5e-9d7e-1a2b3c4d5e6f"
UID_B = "11111111-2222-3333-4444-555555555555"
UID_C = "66666666-7777-8888-9999-000000000000"
STATIC = "d41d8cd98f00b204e9800998ecf8427e"


def cache_of(*pods: dict[str, object]) -> PodCache:
    cache = PodCache()
    cache.replace(parse_pod_list(pod_list(list(pods))), now=0.0)
    return cache


def ts(text: str) -> float:
    return datetime.fromisoformat(text).timestamp()


def test_parse_pod_reads_identity_priority_time_and_requests() -> None:
    """Namespace/name, priority plus the offset annotation, startTime, summed CPU requests with sidecar and overhead."""
    obj = pod(
        "web-7d9f",
        UID_A.upper(),
        namespace="shop",
        priority=1000,
        priority_class="batch-low",
        cpu_requests=("250m", "1", None),
        cpu_limits=("500m", "2", None),
        annotations={"nodeguard.io/priority-offset": "-300"},
        init_containers=[
            {"name": "mesh", "image": "envoy", "restartPolicy": "Always", "resources": {"requests": {"cpu": "100m"}}},
            {"name": "migrate", "image": "tool", "resources": {"requests": {"cpu": "4"}}},
        ],
        overhead={"cpu": "50m"},
        grace=45,
    )
    meta = parse_pod(obj)
    assert (meta.uid, meta.key) == (UID_A, "shop/web-7d9f")
    assert meta.priority == 700
    assert meta.priority_class == "batch-low"
    assert meta.qos_class is QosClass.BURSTABLE
    assert meta.started_at == ts("2024-05-01T10:00:03+00:00")  # startTime, not creationTimestamp
    assert meta.cpu_request_cores == pytest.approx(0.25 + 1 + 0.1 + 0.05)  # the finished init container is not counted
    assert meta.cpu_limit_cores is None  # one container is unlimited
    assert meta.grace_seconds == 45
    assert not meta.protected and not meta.critical


def test_parse_pod_falls_back_to_creation_time_and_reads_flags() -> None:
    """Without startTime the creation time is used; the protected annotation and critical classes are flagged."""
    meta = parse_pod(pod("a", UID_A, started=None, annotations={"nodeguard.io/protected": "True"}))
    assert meta.started_at == ts("2024-05-01T10:00:00+00:00")
    assert meta.protected
    assert parse_pod(pod("dns", UID_B, priority=2000000000, priority_class="system-cluster-critical")).critical
    assert parse_pod(pod("proxy", UID_C, priority=2000001000, priority_class="system-node-critical")).critical
    assert not parse_pod(pod("x", UID_C, annotations={"nodeguard.io/protected": "yes please"})).protected


def test_pod_level_resources_win_and_best_effort_has_no_request() -> None:
    """Pod-level spec.resources.requests.cpu replaces the container sum; no request at all is None."""
    obj = pod("a", UID_A, cpu_requests=("1", "1"))
    obj["spec"]["resources"] = {"requests": {"cpu": "1500m"}}
    assert parse_pod(obj).cpu_request_cores == pytest.approx(1.5)
    assert (
        parse_pod(pod("b", UID_B, qos="BestEffort", cpu_requests=(None,), memory_request=None)).cpu_request_cores
        is None
    )


def test_pod_list_skips_unusable_items_and_rejects_non_lists() -> None:
    """Malformed items (no uid, a bad quantity) are skipped and counted; a body that is no PodList is an error."""
    bad_quantity = pod("b", UID_B, cpu_requests=("lots",))
    no_uid = pod("c", UID_C)
    del no_uid["metadata"]["uid"]
    index = parse_pod_list(pod_list([pod("a", UID_A), bad_quantity, no_uid, "garbage"]))  # type: ignore[list-item]
    assert set(index.pods) == {UID_A}
    assert index.skipped == 3
    for body in ({"kind": "Status", "items": []}, {"items": "x"}, [], None, "<html>"):
        with pytest.raises(ValueError, match="not a PodList"):
            parse_pod_list(body)


def test_enrich_applies_metadata_to_known_pods() -> None:
    """A known pod gets its name, priority, start time, CPU request and class; the input snapshot is unchanged."""
    snap = snapshot([pod_usage(UID_A), pod_usage(UID_B, qos=QosClass.BURSTABLE, driver="systemd")])
    cache = cache_of(
        pod("batch-1", UID_A, namespace="jobs", qos="BestEffort", priority=-5, cpu_requests=(None,)),
        pod("api-0", UID_B, namespace="shop", priority=100, cpu_requests=("500m", "250m")),
    )
    result = enrich(snap, cache)
    a = next(u.workload for u in result.snapshot.workloads.values() if u.workload.pod_uid == UID_A)
    assert (a.name, a.priority, a.cpu_request_cores, a.metadata_known) == ("jobs/batch-1", -5, None, True)
    b = next(u.workload for u in result.snapshot.workloads.values() if u.workload.pod_uid == UID_B)
    assert b.id.startswith("kubepods.slice/")  # systemd driver: the UID's dashes were underscores
    assert (b.name, b.priority, b.cpu_request_cores) == ("shop/api-0", 100, pytest.approx(0.75))
    assert b.started_at == ts("2024-05-01T10:00:03+00:00")
    assert result.unknown == frozenset()
    assert all(u.workload.name.startswith("pod/") for u in snap.workloads.values())


def test_enrich_carries_the_memory_request_as_the_memory_throttle_floor() -> None:
    """A pod's memory request (its containers' sum) reaches its workload, in bytes; none asked is None."""
    snap = snapshot([pod_usage(UID_A), pod_usage(UID_B)])
    cache = cache_of(pod("a", UID_A, memory_request="96Mi"), pod("b", UID_B, memory_request=None))
    found = {u.workload.pod_uid: u.workload for u in enrich(snap, cache).snapshot.workloads.values()}
    assert found[UID_A].memory_request_bytes == 96 << 20
    assert found[UID_B].memory_request_bytes is None


def test_unknown_uids_are_marked_and_reported() -> None:
    """A pod cgroup whose UID no pod has is metadata_known False, and its UID is reported for an early refresh."""
    snap = snapshot([pod_usage(UID_A), pod_usage(UID_B)])
    result = enrich(snap, cache_of(pod("a", UID_A)))
    known = {u.workload.pod_uid: u.workload.metadata_known for u in result.snapshot.workloads.values()}
    assert known == {UID_A: True, UID_B: False}
    assert result.unknown == frozenset({UID_B})


def test_static_pod_found_through_its_mirror_annotation() -> None:
    """A static pod's cgroup carries the config hash; the mirror pod (another UID) names it in an annotation."""
    mirror = pod(
        "kube-proxy-worker-1",
        UID_C,
        namespace="kube-system",
        annotations={"kubernetes.io/config.mirror": STATIC, "kubernetes.io/config.hash": STATIC},
    )
    result = enrich(snapshot([pod_usage(STATIC, qos=QosClass.BURSTABLE)]), cache_of(mirror))
    (usage,) = result.snapshot.workloads.values()
    assert usage.workload.name == "kube-system/kube-proxy-worker-1"
    assert usage.workload.metadata_known


def test_protected_critical_and_held_pods_are_protected() -> None:
    """The annotation, system-*-critical classes and a held-back eviction all make the workload protected."""
    cache = cache_of(
        pod("opt-out", UID_A, annotations={"nodeguard.io/protected": "true"}),
        pod("dns", UID_B, priority=2000000000, priority_class="system-cluster-critical"),
        pod("web", UID_C),
    )
    cache.hold(UID_C, 60.0, now=100.0)
    snap = snapshot([pod_usage(UID_A), pod_usage(UID_B), pod_usage(UID_C)], monotonic=120.0)
    found = {u.workload.pod_uid: u.workload for u in enrich(snap, cache).snapshot.workloads.values()}
    assert {uid: w.protected for uid, w in found.items()} == {UID_A: True, UID_B: True, UID_C: True}
    assert {uid: w.protected_by for uid, w in found.items()} == {
        UID_A: 'annotation nodeguard.io/protected: "true"',
        UID_B: "priority class system-cluster-critical",
        UID_C: "eviction refused (a PodDisruptionBudget, or the API): held back for a while",
    }
    later = snapshot([pod_usage(UID_C)], monotonic=161.0)
    assert not next(iter(enrich(later, cache).snapshot.workloads.values())).workload.protected


def test_enrich_carries_the_namespace_and_labels_and_keeps_what_protected_the_cgroup() -> None:
    """The pod's namespace and labels reach its workload, for the guard's pod selectors; a workload protected
    before (nodeguard's own pod) keeps that reason over the pod's annotation."""
    own = pod_usage(UID_B)
    own = own._replace(workload=replace(own.workload, protected=True, protected_by=OWN_WORKLOAD))
    cache = cache_of(
        pod("train-1", UID_A, namespace="batch", labels={"team": "ml", "app": "train"}),
        pod("nodeguard-x", UID_B, namespace="nodeguard", annotations={"nodeguard.io/protected": "true"}),
    )
    found = {
        u.workload.pod_uid: u.workload
        for u in enrich(snapshot([pod_usage(UID_A), own]), cache).snapshot.workloads.values()
    }
    assert (found[UID_A].namespace, dict(found[UID_A].labels), found[UID_A].protected_by) == (
        "batch", {"team": "ml", "app": "train"}, None,
    )  # fmt: skip
    assert (found[UID_B].namespace, found[UID_B].protected_by) == ("nodeguard", OWN_WORKLOAD)


def test_memo_reuses_workloads_until_something_changes() -> None:
    """With a memo, an unchanged pod keeps the same Workload object; a new pod list or a hold makes a new one."""
    usage = pod_usage(UID_A)
    cache = cache_of(pod("a", UID_A))
    memo: dict = {}
    first = next(iter(enrich(snapshot([usage]), cache, memo).snapshot.workloads.values())).workload
    second = next(iter(enrich(snapshot([usage]), cache, memo).snapshot.workloads.values())).workload
    assert second is first
    cache.hold(UID_A, 60.0, now=0.0)
    third = next(iter(enrich(snapshot([usage], monotonic=1.0), cache, memo).snapshot.workloads.values())).workload
    assert third is not first and third.protected
    cache.replace(parse_pod_list(pod_list([pod("a", UID_A, priority=7)])), now=2.0)
    fourth = next(iter(enrich(snapshot([usage], monotonic=100.0), cache, memo).snapshot.workloads.values())).workload
    assert fourth.priority == 7


# --- the planner never acts on a pod without metadata -----------------------------------


def test_planner_skips_workloads_without_metadata() -> None:
    """Under CPU pressure the planner throttles only pods whose metadata is known; unknown ones are no candidates."""
    settings = guard(cpu_throttle(threshold=2.0, restore=1.0))
    workloads = [pod_usage(UID_A, cores=2.0), pod_usage(UID_B, cores=2.0)]
    snap = snapshot(workloads, cores_used=4.5)
    enriched = enrich(snap, cache_of(pod("a", UID_A, qos="BestEffort", cpu_requests=(None,)))).snapshot
    result = plan(enriched, GuardState(), settings)
    assert result.candidates == 1
    assert {a.workload.pod_uid for a in result.changes if a.kind == "throttle" and a.workload} == {UID_A}


def test_planner_does_nothing_while_no_metadata_is_known() -> None:
    """Before the first pod list, every pod is unknown: memory pressure evicts nothing."""
    settings = guard({"metric": "memory_total_usage", "threshold": "1Gi", "action": "evict", "triggerAfter": 1})
    snap = snapshot([pod_usage(UID_A), pod_usage(UID_B)], memory_used=8 << 30)
    result = plan(enrich(snap, PodCache()).snapshot, GuardState(), settings)
    assert not [a for a in result.actions if isinstance(a, Evict)]
    assert result.candidates == 0
    # The same snapshot with metadata does evict: the test can fail.
    cache = cache_of(pod("a", UID_A, qos="BestEffort"), pod("b", UID_B, qos="BestEffort"))
    assert [a for a in plan(enrich(snap, cache).snapshot, GuardState(), settings).actions if isinstance(a, Evict)]


def test_system_critical_pods_are_never_eviction_candidates() -> None:
    """Under memory pressure a system-node-critical BestEffort pod is not evicted; an ordinary one in its place is."""
    settings = guard({"metric": "memory_total_usage", "threshold": "1Gi", "action": "evict", "triggerAfter": 1})
    snap = snapshot([pod_usage(UID_A)], memory_used=8 << 30)
    critical = cache_of(
        pod("proxy", UID_A, qos="BestEffort", priority=2000001000, priority_class="system-node-critical")
    )
    assert not plan(enrich(snap, critical).snapshot, GuardState(), settings).actions
    ordinary = cache_of(pod("proxy", UID_A, qos="BestEffort"))
    assert plan(enrich(snap, ordinary).snapshot, GuardState(), settings).actions
