"""Kubernetes Events on the pods nodeguard acts on, so ``kubectl describe pod`` says what happened.

Every lever change is one: on the pod whose cgroup it changed, or on the Node
for a group that is not a pod (a kubelet QoS tier whose weight was lowered).

core/v1 Events in the legacy shape (``firstTimestamp``/``lastTimestamp``/
``count``, no ``eventTime``) that every API server accepts, named like
client-go's recorder names them (``<pod>.<hex nanoseconds>``). Best effort:
a failure is logged (rate-limited) and counted, and never delays the guard;
while too many are in flight, new ones are dropped and counted rather than
queued behind a slow server.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any

from nodeguard.actuators.changes import Done
from nodeguard.kubernetes.client import KubeClient, KubeError, raise_for
from nodeguard.kubernetes.metadata import PodCache, PodMeta
from nodeguard.log import RateLimiter, get_logger
from nodeguard.model.levers import LEVERS, TERMS, EventKind, EventType

log = get_logger("nodeguard.kubernetes.events")

COMPONENT = "nodeguard"
MAX_MESSAGE = 1024  # the API server's limit on an Event's note
MAX_NAME = 253
EVICTED = EventKind("NodeguardEvicted", "Warning", "Evict")
# Every Event reason nodeguard records: each lever's two, and evictions'.
REASONS: tuple[EventKind, ...] = (*(kind for t in LEVERS for kind in (t.holds, t.gives_back)), EVICTED)


def event_kind(done: Done) -> EventKind:
    """A lever change's Event: the lever's own, for holding back or for giving back."""
    terms = TERMS[done.change.lever]
    return terms.holds if done.holds_back else terms.gives_back


def describe_change(done: Done) -> str:
    """The Event message of a lever change: the metric and gap, the plan's reason, what changed and, for a group,
    the candidates it holds back."""
    change = done.change
    gap = "n/a" if change.gap_before is None else f"{change.gap_before:.4g}"
    before, after = done.shown
    what = f"{TERMS[change.lever].noun} {before} -> {after}"
    held = f"; holds back {', '.join(change.workloads)}" if change.workloads and done.holds_back else ""
    return f"{change.metric}: gap {gap}; {change.reason}; {what}{held}"


def pod_object(pod: PodMeta) -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "Pod", "namespace": pod.namespace, "name": pod.name, "uid": pod.uid}


def node_object(node: str) -> dict[str, Any]:
    # kubelet records a Node's Events with the node's name as its uid, in the default namespace.
    return {"apiVersion": "v1", "kind": "Node", "name": node, "uid": node, "namespace": ""}


def event_body(
    involved: dict[str, Any],
    *,
    reason: str,
    type_: EventType,
    action: str,
    message: str,
    node: str,
    now: float,
) -> dict[str, Any]:
    stamp = datetime.fromtimestamp(now, UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
    suffix = f".{int(now * 1e9):x}"
    namespace = involved.get("namespace") or "default"
    return {
        "apiVersion": "v1",
        "kind": "Event",
        "metadata": {"name": involved["name"][: MAX_NAME - len(suffix)] + suffix, "namespace": namespace},
        "involvedObject": involved,
        "reason": reason,
        "message": message[:MAX_MESSAGE],
        "type": type_,
        "source": {"component": COMPONENT, "host": node},
        "reportingComponent": COMPONENT,
        "reportingInstance": f"{COMPONENT}-{node}"[:128],
        "action": action,
        "firstTimestamp": stamp,
        "lastTimestamp": stamp,
        "count": 1,
    }


class EventRecorder:
    def __init__(
        self,
        client: KubeClient,
        cache: PodCache,
        node: str,
        *,
        max_in_flight: int = 32,
        wall_clock: Callable[[], float] = time.time,
    ) -> None:
        self.client = client
        self.cache = cache
        self.node = node
        self.max_in_flight = max_in_flight
        self.wall_clock = wall_clock
        self.in_flight = 0
        self.sent = 0
        self.failed = 0
        self.dropped = 0
        self._warnings = RateLimiter(60.0)

    async def emit(self, done: Done, pod_uid: str | None) -> bool:
        """Record an Event for a lever change: on its pod (``pod_uid``), or on the Node for a group that is not a
        pod; True when the server took it. A pod without metadata has no object to attach it to."""
        if pod_uid is None:
            involved = node_object(self.node)
        else:
            pod = self.cache.get(pod_uid)
            if pod is None:
                return False
            involved = pod_object(pod)
        kind = event_kind(done)
        return await self.record(involved, kind.reason, kind.type, kind.action, describe_change(done))

    async def eviction(self, pod: PodMeta, how: str, context: dict[str, object]) -> bool:
        """The Event of an eviction that went through (recorded by the evictor, which knows the outcome)."""
        gap = context.get("gap")
        gap_text = f"{gap:.4g}" if isinstance(gap, int | float) else "n/a"
        message = f"{context.get('metric', 'unknown metric')}: gap {gap_text}; {context.get('reason', '')}; {how}"
        return await self.record(pod_object(pod), EVICTED.reason, EVICTED.type, EVICTED.action, message)

    async def record(self, involved: dict[str, Any], reason: str, type_: EventType, action: str, message: str) -> bool:
        if self.in_flight >= self.max_in_flight:
            self.dropped += 1
            return False
        body = event_body(
            involved, reason=reason, type_=type_, action=action, message=message, node=self.node, now=self.wall_clock()
        )
        self.in_flight += 1
        try:
            namespace = body["metadata"]["namespace"]
            reply = await self.client.request("POST", f"/api/v1/namespaces/{namespace}/events", body=body)
            raise_for(reply, "create event")
        except Exception as exc:  # best effort, whatever went wrong: never the caller's failure
            self.failed += 1
            if self._warnings.allow("event"):
                log.warning(
                    "cannot record a Kubernetes event",
                    object=f"{involved['kind']}/{involved['name']}",
                    reason=reason,
                    error=f"{type(exc).__name__}: {exc}",
                    exc_info=not isinstance(exc, KubeError),
                )
            return False
        finally:
            self.in_flight -= 1
        self.sent += 1
        return True
