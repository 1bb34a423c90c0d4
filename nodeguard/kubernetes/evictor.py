"""Evicting pods through the API server's Eviction subresource (policy/v1).

The API server checks PodDisruptionBudgets and the kubelet honours the grace
period, as for ``kubectl drain``. Outcomes:

- 200/201 (accepted) or 404 (already gone): True. The pod terminates on its
  own; the planner counts it as releasing until its cgroup is gone.
- 429, or a 500 about disruption budgets: a budget says no. False, never the
  cgroup fallback (that would break the budget); the pod is held back for
  ``evictionBackoffSeconds`` (doubling) so that the planner moves on to the
  next candidate and tries this one again later.
- no answer (connection, TLS, token, timeout), 401/403 or another 5xx: the
  API cannot be asked. With ``evictVia: api-then-cgroup`` the cgroup evictor
  takes over; otherwise False and held back.
- anything else (400, 409, 422): False and held back.
- a static pod (its mirror pod in the API): deleting the mirror would not
  stop it, so nothing is sent; the cgroup fallback applies as when the API
  cannot be asked.

``system-node-critical`` and ``system-cluster-critical`` pods, and pod
cgroups without metadata, are refused whatever the mode. A workload that is
not a pod (a configured group) has no API object: the cgroup evictor handles
it in every mode.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from enum import Enum

from nodeguard.actuators.evictors import Evictor
from nodeguard.kubernetes.client import KubeClient, KubeError, status_message
from nodeguard.kubernetes.events import EventRecorder
from nodeguard.kubernetes.metadata import DEFAULT_GRACE_SECONDS, MIRROR_ANNOTATION, PodCache, PodMeta
from nodeguard.kubernetes.settings import KubernetesSettings
from nodeguard.log import get_logger
from nodeguard.sources.discovery import parse_pod_dir

log = get_logger("nodeguard.kubernetes.evictor")


class EvictionOutcome(Enum):
    ACCEPTED = "accepted"
    GONE = "gone"
    BUDGET = "refused by a disruption budget"
    UNREACHABLE = "API not usable"
    STATIC = "a static pod: the API cannot evict it"
    REJECTED = "rejected"


def pod_uid_of(workload_id: str) -> str | None:
    """The pod UID in a pod cgroup's path (either driver), or None for another workload."""
    parsed = parse_pod_dir(workload_id.rstrip("/").rsplit("/", 1)[-1])
    return None if parsed is None else parsed[0].lower()


def eviction_body(pod: PodMeta, grace_seconds: int) -> dict[str, object]:
    return {
        "apiVersion": "policy/v1",
        "kind": "Eviction",
        "metadata": {"name": pod.name, "namespace": pod.namespace},
        "deleteOptions": {"gracePeriodSeconds": grace_seconds},
    }


def _about_budget(body: object) -> bool:
    # "…violate the pod's disruption budget", "…more than one PodDisruptionBudget…"
    _, message = status_message(body)
    return message is not None and "disruptionbudget" in message.lower().replace(" ", "")


class ApiEvictor:
    """An Evictor (``actuators.evictors.Evictor``) for Kubernetes pods."""

    def __init__(
        self,
        client: KubeClient,
        cache: PodCache,
        settings: KubernetesSettings,
        cgroup: Evictor,
        *,
        recorder: EventRecorder | None = None,
        dry_run: bool = False,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.client = client
        self.cache = cache
        self.settings = settings
        self.cgroup = cgroup
        self.recorder = recorder
        self.dry_run = dry_run
        self.clock = clock
        self.outcomes: dict[str, int] = {}

    def grace_seconds(self, pod: PodMeta) -> int:
        if self.settings.eviction_grace_seconds is not None:
            return self.settings.eviction_grace_seconds
        return pod.grace_seconds if pod.grace_seconds is not None else DEFAULT_GRACE_SECONDS

    async def evict(self, workload_id: str, **context: object) -> bool:
        uid = pod_uid_of(workload_id)
        if uid is None:
            return await self.cgroup.evict(workload_id, **context)
        pod = self.cache.get(uid)
        if pod is None:
            log.warning("not evicting a pod without metadata", workload=workload_id, uid=uid)
            return self._refused(uid, "unknown")
        if pod.critical:
            log.error("never evicting a system-critical pod", pod=pod.key, priority_class=pod.priority_class)
            return self._refused(uid, "critical")
        mode = self.settings.evict_via
        if mode == "cgroup":
            return await self._by_cgroup(workload_id, uid, pod, context)
        outcome = await self._by_api(pod, context)
        self.outcomes[outcome.value] = self.outcomes.get(outcome.value, 0) + 1
        if outcome in (EvictionOutcome.ACCEPTED, EvictionOutcome.GONE):
            self.cache.release(uid)
            if outcome is EvictionOutcome.ACCEPTED and self.recorder is not None and not self.dry_run:
                await self.recorder.eviction(pod, "evicted through the Eviction API", dict(context))
            return True
        if outcome in (EvictionOutcome.UNREACHABLE, EvictionOutcome.STATIC) and mode == "api-then-cgroup":
            log.warning("Eviction API not usable; evicting by the cgroup", pod=pod.key)
            return await self._by_cgroup(workload_id, uid, pod, context)
        return self._refused(uid, outcome.value)

    def _refused(self, uid: str, why: str) -> bool:
        seconds = self.cache.hold(uid, self.settings.eviction_backoff_seconds, self.clock())
        log.info("eviction not done; the pod is no candidate for a while", uid=uid, why=why, seconds=round(seconds))
        return False

    async def _by_cgroup(self, workload_id: str, uid: str, pod: PodMeta, context: dict[str, object]) -> bool:
        # ``uid`` is the cgroup's: a static pod's differs from its mirror pod's, and holds are looked up by it.
        gone = await self.cgroup.evict(workload_id, **{**context, "pod": pod.key})
        if not gone:
            return self._refused(uid, "cgroup eviction failed")
        self.cache.release(uid)
        if self.recorder is not None and not self.dry_run:
            await self.recorder.eviction(pod, "killed through its cgroup", context)
        return True

    async def _by_api(self, pod: PodMeta, context: dict[str, object]) -> EvictionOutcome:
        if MIRROR_ANNOTATION in pod.annotations:
            # Deleting a mirror pod leaves the static pod running; the kubelet recreates the mirror.
            log.warning("not evicting a static pod through the API", pod=pod.key)
            return EvictionOutcome.STATIC
        grace = self.grace_seconds(pod)
        path = f"/api/v1/namespaces/{pod.namespace}/pods/{pod.name}/eviction"
        if self.dry_run:
            log.warning("dry run: would evict through the API", pod=pod.key, grace_seconds=grace, **context)
            return EvictionOutcome.ACCEPTED
        log.warning("evicting through the API", pod=pod.key, grace_seconds=grace, **context)
        try:
            reply = await self.client.request("POST", path, body=eviction_body(pod, grace))
        except KubeError as exc:
            log.error("Eviction API not reached", pod=pod.key, error=str(exc))
            return EvictionOutcome.UNREACHABLE
        status = reply.status
        reason, message = status_message(reply.body)
        if 200 <= status < 300:
            return EvictionOutcome.ACCEPTED
        if status == 404:
            return EvictionOutcome.GONE
        if status == 429 or (status == 500 and _about_budget(reply.body)):
            log.info("eviction refused by a disruption budget", pod=pod.key, status=status, message=message)
            return EvictionOutcome.BUDGET
        log.error("eviction failed", pod=pod.key, status=status, reason=reason, message=message)
        if status in (401, 403) or status >= 500:
            return EvictionOutcome.UNREACHABLE
        return EvictionOutcome.REJECTED
