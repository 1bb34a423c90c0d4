"""Pod metadata: who a pod cgroup belongs to, how important it is, what it asked for.

The cgroup tree gives a pod's UID and QoS class; the pod object gives the rest.
A refresh task lists this node's pods on a timer (and soon after a pod cgroup
with an unknown UID appears), with back-off on errors, into a ``PodCache``;
``enrich`` lays the cache over a snapshot's pod workloads between sense and
plan, in the tick, without I/O.

What a pod's metadata sets on its workload:

- ``name``: ``namespace/name``.
- ``priority``: ``spec.priority`` plus the ``nodeguard.io/priority-offset``
  annotation (an integer, e.g. ``"-1000"`` to be throttled before its peers,
  ``"500"`` after them; malformed values are ignored). Candidates'
  ``belowPriority`` compares this sum too.
- ``qos_class``: ``status.qosClass`` (the cgroup's tier where it is missing).
- ``started_at``: ``status.startTime``, when the kubelet started the pod on
  this node, else ``metadata.creationTimestamp``. The running-time comparator
  means "how long has it been running here": a pod that waited an hour for
  scheduling is not an old pod, and creation time would say it is.
- ``cpu_request_cores``, the throttle floor: the sum of the containers'
  ``resources.requests.cpu``, with restartable (sidecar) init containers,
  plus ``spec.overhead.cpu``; pod-level ``spec.resources.requests.cpu`` wins
  where set. Other init containers have finished by the time the pod runs.
- ``protected``: the ``nodeguard.io/protected: "true"`` annotation, the
  ``system-node-critical`` and ``system-cluster-critical`` priority classes
  (or a priority in their range), and a pod whose eviction was just refused
  (a PodDisruptionBudget) for its back-off: none of them is a candidate.
- ``namespace`` and ``labels``: the pod's, for the guard's pod selectors
  (``guard.candidates``, ``guard.exempt``, an objective's ``protect``).
- ``protected_by``: which of those protects it, for ``nodeguard plan`` and
  the trace.
- ``metadata_known``: False for a pod cgroup whose UID no pod has (yet):
  the planner never acts on it (unless
  ``guard.candidates.podsWithoutMetadata``).

Static pods: the cgroup carries the kubelet's UID (the config hash), while
the API server's mirror pod has its own UID and the hash in the
``kubernetes.io/config.mirror`` annotation; both are indexed.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable, Mapping, MutableMapping
from dataclasses import dataclass, replace
from datetime import datetime
from types import MappingProxyType
from typing import Any

from nodeguard.backoff import Backoff, doubling
from nodeguard.kubernetes.client import KubeError
from nodeguard.kubernetes.quantities import parse_kube_quantity
from nodeguard.log import RateLimiter, get_logger
from nodeguard.model.snapshot import Snapshot, WorkloadUsage
from nodeguard.model.workloads import QosClass, Workload

log = get_logger("nodeguard.kubernetes")

PROTECTED_ANNOTATION = "nodeguard.io/protected"
PRIORITY_OFFSET_ANNOTATION = "nodeguard.io/priority-offset"
MIRROR_ANNOTATION = "kubernetes.io/config.mirror"
HASH_ANNOTATION = "kubernetes.io/config.hash"
CRITICAL_CLASSES = frozenset({"system-node-critical", "system-cluster-critical"})
# scheduling.SystemCriticalPriority: user-defined classes are capped at 1e9.
SYSTEM_CRITICAL_PRIORITY = 2_000_000_000
_INT32 = (-(2**31), 2**31 - 1)
DEFAULT_GRACE_SECONDS = 30  # the API server's default for terminationGracePeriodSeconds
MIN_REFRESH_GAP = 1.0  # seconds between two lists, however many new pods appear


@dataclass(frozen=True, slots=True)
class PodMeta:
    uid: str
    namespace: str
    name: str
    priority: int  # spec.priority, plus the offset annotation
    priority_class: str
    qos_class: QosClass | None
    started_at: float | None  # wall-clock seconds
    cpu_request_cores: float | None  # None: no container asks for CPU
    cpu_limit_cores: float | None  # None: some container is unlimited
    memory_request_bytes: float | None
    memory_limit_bytes: float | None
    grace_seconds: int | None  # spec.terminationGracePeriodSeconds
    labels: Mapping[str, str]
    annotations: Mapping[str, str]
    protected: bool  # the annotation says so
    critical: bool  # system-node-critical / system-cluster-critical: never a candidate
    deleting: bool  # metadata.deletionTimestamp is set

    @property
    def key(self) -> str:
        return f"{self.namespace}/{self.name}"


# --- parsing -------------------------------------------------------------------------


def _time(raw: object) -> float | None:
    if not isinstance(raw, str) or not raw:
        return None
    try:
        return datetime.fromisoformat(raw).timestamp()
    except ValueError:
        return None


def _strings(raw: object) -> dict[str, str]:
    if not isinstance(raw, Mapping):
        return {}
    return {k: v for k, v in raw.items() if isinstance(k, str) and isinstance(v, str)}


def _mapping(raw: object) -> Mapping[str, Any]:
    return raw if isinstance(raw, Mapping) else {}


def _int(raw: object) -> int | None:
    return raw if isinstance(raw, int) and not isinstance(raw, bool) else None


def _sum(containers: list[Mapping[str, Any]], kind: str, resource: str, *, all_needed: bool) -> float | None:
    """Sum of one resource over containers; a malformed quantity raises ValueError.

    ``all_needed``: a limit is unlimited when one container has none; a request
    is the sum of those that are set (None when none is).
    """
    total, seen = 0.0, False
    for container in containers:
        raw = _mapping(_mapping(container.get("resources")).get(kind)).get(resource)
        if raw is None:
            if all_needed:
                return None
            continue
        total += parse_kube_quantity(raw)
        seen = True
    return total if seen else None


def _resource(spec: Mapping[str, Any], kind: str, resource: str, *, all_needed: bool) -> float | None:
    pod_level = _mapping(_mapping(spec.get("resources")).get(kind)).get(resource)
    if pod_level is not None:
        value: float | None = parse_kube_quantity(pod_level)
    else:
        containers = [c for c in spec.get("containers") or () if isinstance(c, Mapping)]
        # Restartable init containers (sidecars) run beside the app containers.
        containers += [
            c for c in spec.get("initContainers") or () if isinstance(c, Mapping) and c.get("restartPolicy") == "Always"
        ]
        value = _sum(containers, kind, resource, all_needed=all_needed)
    overhead = _mapping(spec.get("overhead")).get(resource)
    if value is not None and overhead is not None:
        value += parse_kube_quantity(overhead)
    return value


def _offset(annotations: Mapping[str, str]) -> int:
    try:
        return int(annotations.get(PRIORITY_OFFSET_ANNOTATION, "0").strip())
    except ValueError:
        return 0


def parse_pod(obj: object) -> PodMeta:
    """One Pod object (as in a PodList's items); ValueError when it cannot be used."""
    if not isinstance(obj, Mapping):
        raise ValueError("not an object")
    meta, spec, status = _mapping(obj.get("metadata")), _mapping(obj.get("spec")), _mapping(obj.get("status"))
    uid, namespace, name = meta.get("uid"), meta.get("namespace"), meta.get("name")
    if not (isinstance(uid, str) and uid and isinstance(name, str) and name):
        raise ValueError("metadata.uid or metadata.name missing")
    if not isinstance(namespace, str) or not namespace:
        namespace = "default"
    annotations = _strings(meta.get("annotations"))
    base = _int(spec.get("priority")) or 0
    priority_class = spec.get("priorityClassName")
    priority_class = priority_class if isinstance(priority_class, str) else ""
    qos_raw = status.get("qosClass")
    qos = QosClass(qos_raw) if isinstance(qos_raw, str) and qos_raw in QosClass._value2member_map_ else None
    return PodMeta(
        uid=uid.lower(),
        namespace=namespace,
        name=name,
        priority=min(_INT32[1], max(_INT32[0], base + _offset(annotations))),
        priority_class=priority_class,
        qos_class=qos,
        started_at=_time(status.get("startTime")) or _time(meta.get("creationTimestamp")),
        # A malformed request raises: a pod whose throttle floor is unknown is better left alone.
        cpu_request_cores=_resource(spec, "requests", "cpu", all_needed=False),
        cpu_limit_cores=_resource(spec, "limits", "cpu", all_needed=True),
        memory_request_bytes=_resource(spec, "requests", "memory", all_needed=False),
        memory_limit_bytes=_resource(spec, "limits", "memory", all_needed=True),
        grace_seconds=_int(spec.get("terminationGracePeriodSeconds")),
        labels=_strings(meta.get("labels")),
        annotations=annotations,
        protected=annotations.get(PROTECTED_ANNOTATION, "").strip().lower() == "true",
        critical=priority_class in CRITICAL_CLASSES or base >= SYSTEM_CRITICAL_PRIORITY,
        deleting=meta.get("deletionTimestamp") is not None,
    )


@dataclass(frozen=True, slots=True)
class PodIndex:
    pods: Mapping[str, PodMeta]  # by lower-case UID, static pods also by their config hash
    skipped: int  # items that could not be used


def parse_pod_list(body: object) -> PodIndex:
    """A PodList (from the API server or the kubelet); ValueError when it is not one."""
    items = body.get("items") if isinstance(body, Mapping) else None
    if not isinstance(items, list) or (isinstance(body, Mapping) and body.get("kind") not in (None, "PodList")):
        raise ValueError("the answer is not a PodList")
    pods: dict[str, PodMeta] = {}
    skipped = 0
    for item in items:
        try:
            pod = parse_pod(item)
        except (ValueError, TypeError, ArithmeticError):
            skipped += 1
            continue
        pods[pod.uid] = pod
        for annotation in (MIRROR_ANNOTATION, HASH_ANNOTATION):
            alias = pod.annotations.get(annotation)
            if alias:
                pods.setdefault(alias.lower(), pod)
    return PodIndex(MappingProxyType(pods), skipped)


# --- the cache -----------------------------------------------------------------------


class PodCache:
    """The last good pod list, and the pods whose eviction was refused (held back for a while)."""

    HOLD_CAP = 600.0

    def __init__(self) -> None:
        self.pods: Mapping[str, PodMeta] = MappingProxyType({})
        self.loaded = False  # a list has succeeded at least once
        self.refreshed_at: float | None = None  # monotonic
        self.generation = 0
        # uid -> (monotonic time until which it is not a candidate, refusals in a row)
        self.holds: dict[str, tuple[float, int]] = {}

    def replace(self, index: PodIndex, now: float) -> None:
        self.pods = index.pods
        self.loaded = True
        self.refreshed_at = now
        self.generation += 1
        for uid in [uid for uid in self.holds if uid not in index.pods]:
            del self.holds[uid]  # gone: nothing left to hold back

    def get(self, uid: str | None) -> PodMeta | None:
        return None if uid is None else self.pods.get(uid.lower())

    def hold(self, uid: str, base_seconds: float, now: float) -> float:
        """Hold a pod back after a refused eviction; doubles on each refusal in a row. Returns the seconds."""
        key = uid.lower()
        _, refusals = self.holds.get(key, (0.0, 0))
        seconds = doubling(base_seconds, max(base_seconds, self.HOLD_CAP), refusals + 1)
        self.holds[key] = (now + seconds, refusals + 1)
        return seconds

    def release(self, uid: str) -> None:
        self.holds.pop(uid.lower(), None)

    def held(self, uid: str, now: float) -> bool:
        hold = self.holds.get(uid.lower())
        return hold is not None and hold[0] > now


# --- enrich --------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Enriched:
    snapshot: Snapshot
    unknown: frozenset[str]  # pod UIDs with a cgroup and no pod (yet)


Memo = MutableMapping[str, tuple[Workload, PodMeta | None, bool, Workload]]


def protected_by(pod: PodMeta, held: bool) -> str | None:
    """What protects a pod, first of: the annotation, a system-critical priority, a refused eviction; None."""
    if pod.protected:
        return f'annotation {PROTECTED_ANNOTATION}: "true"'
    if pod.critical and pod.priority_class in CRITICAL_CLASSES:
        return f"priority class {pod.priority_class}"
    if pod.critical:
        return f"priority ≥ {SYSTEM_CRITICAL_PRIORITY} (system-critical)"
    if held:
        return "eviction refused (a PodDisruptionBudget, or the API): held back for a while"
    return None


def apply(workload: Workload, pod: PodMeta | None, held: bool) -> Workload:
    """The workload with its pod's metadata laid over it; unknown when there is no pod."""
    if pod is None:
        return replace(workload, metadata_known=False)
    by = workload.protected_by if workload.protected else protected_by(pod, held)
    return Workload(
        id=workload.id,
        name=pod.key,
        kind=workload.kind,
        qos_class=pod.qos_class or workload.qos_class,
        priority=pod.priority,
        protected=workload.protected or pod.protected or pod.critical or held,
        pod_uid=workload.pod_uid,
        containers=workload.containers,
        started_at=pod.started_at or workload.started_at,
        cpu_request_cores=pod.cpu_request_cores,
        memory_request_bytes=None if pod.memory_request_bytes is None else round(pod.memory_request_bytes),
        metadata_known=True,
        protected_by=by,
        namespace=pod.namespace,
        labels=pod.labels,
    )


def enrich(snapshot: Snapshot, cache: PodCache, memo: Memo | None = None) -> Enriched:
    """The snapshot with every pod workload's metadata applied; no I/O, the snapshot is not changed.

    ``memo`` (kept by the caller between ticks) reuses last tick's workload
    when neither the sensed workload nor its pod changed: the common case,
    and what keeps a thousand pods well under a millisecond.
    """
    now = snapshot.monotonic
    pods, holds = cache.pods, cache.holds
    seen: dict[str, tuple[Workload, PodMeta | None, bool, Workload]] = {}
    out: dict[str, WorkloadUsage] = {}
    unknown: list[str] = []
    for wid, usage in snapshot.workloads.items():
        workload = usage.workload
        uid = workload.pod_uid
        if uid is None:
            out[wid] = usage
            continue
        key = uid.lower()
        pod = pods.get(key)
        hold = holds.get(key) if holds else None
        held = hold is not None and hold[0] > now
        if pod is None:
            unknown.append(key)
        old = memo.get(wid) if memo is not None else None
        if old is not None and old[0] is workload and old[1] is pod and old[2] == held:
            new = old[3]
        else:
            new = apply(workload, pod, held)
        seen[wid] = (workload, pod, held, new)
        out[wid] = WorkloadUsage(new, *usage[1:])
    if memo is not None:
        memo.clear()
        memo.update(seen)
    return Enriched(replace(snapshot, workloads=MappingProxyType(out)), frozenset(unknown))


# --- the refresh task ----------------------------------------------------------------


class MetadataRefresher:
    """Lists this node's pods into the cache on a timer, early for unknown UIDs, with back-off on errors."""

    def __init__(
        self,
        fetch: Callable[[], Awaitable[Any]],
        cache: PodCache,
        refresh_seconds: float,
        *,
        backoff: Backoff | None = None,
        clock: Callable[[], float] = time.monotonic,
        source: str = "apiserver",
    ) -> None:
        self.fetch = fetch
        self.cache = cache
        self.refresh_seconds = refresh_seconds
        self.backoff = backoff or Backoff(1.0, max(refresh_seconds, 300.0), jitter=0.2, clock=clock)
        self.clock = clock
        self.source = source
        self.failures = 0  # all time, for metrics
        self.refreshes = 0
        self._wake = asyncio.Event()
        self._asked: frozenset[str] = frozenset()
        self._warnings = RateLimiter(60.0)
        self._last_attempt = float("-inf")

    def want(self, unknown: frozenset[str]) -> None:
        """Called each tick with the unknown UIDs: a UID not seen before asks for an early list."""
        if unknown - self._asked:
            self._wake.set()
        self._asked = unknown

    async def refresh_once(self) -> bool:
        self._last_attempt = self.clock()
        try:
            body = await self.fetch()
            # Building a thousand PodMeta takes milliseconds: not in the event loop's thread.
            index = await asyncio.to_thread(parse_pod_list, body)
        except Exception as exc:  # a bug here must not end the daemon's TaskGroup: back off like any failure
            self.failures += 1
            delay = self.backoff.failed()
            if self._warnings.allow("refresh"):
                log.warning(
                    "cannot list pods; pods without metadata are left alone",
                    source=self.source,
                    error=f"{type(exc).__name__}: {exc}",
                    retry_in=round(delay, 1),
                    failures=self.backoff.failures,
                    known=len(self.cache.pods),
                    exc_info=not isinstance(exc, KubeError | ValueError),
                )
            return False
        if self.backoff.failures:
            log.info("pod metadata available again", source=self.source, after_failures=self.backoff.failures)
        self.backoff.succeeded()
        self._warnings.forget({"refresh"})
        if index.skipped and self._warnings.allow("skipped"):
            log.warning("pods without usable metadata skipped", count=index.skipped, source=self.source)
        self.cache.replace(index, self.clock())
        self.refreshes += 1
        return True

    async def run(self) -> None:
        """Forever: a task of the daemon's TaskGroup, cancelled on stop."""
        while True:
            self._wake.clear()
            await self.refresh_once()
            if self.backoff.failures:
                await asyncio.sleep(self.backoff.remaining())  # new UIDs do not cut a back-off short
                continue
            try:
                async with asyncio.timeout(self.refresh_seconds):
                    await self._wake.wait()
            except TimeoutError:
                continue
            await asyncio.sleep(max(0.0, self._last_attempt + MIN_REFRESH_GAP - self.clock()))
