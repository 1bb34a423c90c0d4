"""Which workloads the guard may act on, and the rule that decided each: one precedence for every rule.

The first rule that applies decides a workload's role:

1. **protected** by what it is (``Workload.protected_by``): nodeguard itself;
   the ``nodeguard.io/protected: "true"`` annotation; a ``system-node-critical``
   or ``system-cluster-critical`` priority class (or a priority in their
   range); a pod whose eviction a PodDisruptionBudget just refused, for its
   back-off; a configured group marked ``protected``.
2. **protected** by an objective: an entry of a ``protected_cpu_stall``
   objective's ``protect`` list; for a ``protected_memory_stall`` objective its
   ``protect`` list, or without one the Guaranteed pods.
3. **exempt**: a pod whose metadata nodeguard does not have, unless
   ``guard.candidates.podsWithoutMetadata``.
4. **exempt**: ``guard.exempt``: its namespaces (``kube-system`` by default),
   nodeguard's own namespace, its pod selectors.
5. **unselected**: outside ``guard.candidates``: its namespaces, its
   ``labelSelector``, its classes, or a priority at or above ``belowPriority``
   (the priority is the pod's plus its ``nodeguard.io/priority-offset``
   annotation).
6. **candidate**: everything else.

Namespaces and labels select pods only: a configured group has neither, and
pod selectors neither select nor exempt it. Only candidates are ever acted
on; a candidate may still sit a tick out (its eviction pending, or held back
after a refused write: policy.context).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from enum import StrEnum
from fnmatch import fnmatchcase

from nodeguard.model.snapshot import WorkloadUsage
from nodeguard.model.workloads import OWN_WORKLOAD, QosClass, Workload
from nodeguard.policy.settings import GuardSettings, ProtectEntry


class Role(StrEnum):
    """What the guard may do with a workload, in the order the trace lists them."""

    CANDIDATE = "candidate"
    PROTECTED = "protected"
    EXEMPT = "exempt"
    UNSELECTED = "unselected"


ROLE_ORDER = {role: index for index, role in enumerate(Role)}


@dataclass(frozen=True, slots=True)
class Choice:
    role: Role
    rule: str  # the rule that decided it, as people read it


def selects(workload: Workload, entry: ProtectEntry) -> bool:
    """Whether a ``protect`` entry takes the workload: a glob on its name or cgroup path, or a pod selector."""
    if isinstance(entry, str):
        return fnmatchcase(workload.name, entry) or fnmatchcase(workload.id, entry)
    return workload.kind == "pod" and entry.matches(workload.namespace, workload.labels)


def protected_for(workload: Workload, entries: tuple[ProtectEntry, ...]) -> bool:
    """Protected for a stall objective: taken by one of its entries, or, with none, a Guaranteed pod or a
    workload protected by what it is."""
    if entries:
        return any(selects(workload, entry) for entry in entries)
    return workload.protected or workload.qos_class is QosClass.GUARANTEED


def shown(entry: ProtectEntry) -> str:
    return f'"{entry}"' if isinstance(entry, str) else entry.shown()


def own_namespace(workloads: Mapping[str, WorkloadUsage]) -> str | None:
    """The namespace of nodeguard's own pod, where it runs in one of this node's pods and its metadata is known."""
    return next(
        (u.workload.namespace for u in workloads.values() if u.workload.protected_by == OWN_WORKLOAD),
        None,
    )


class Selection:
    """The rules of one plan, resolved once: ``choose`` gives a workload's role and the rule behind it."""

    def __init__(
        self,
        guard: GuardSettings,
        stall_protect: tuple[ProtectEntry, ...],
        memory_protect: tuple[ProtectEntry, ...] | None,
        own: str | None,
    ) -> None:
        self.candidates = guard.candidates
        self.exempt = guard.exempt
        self.classes = frozenset(guard.candidates.classes)
        self.stall_protect = stall_protect  # () when the protected_cpu_stall objective protects by default
        self.memory_protect = memory_protect  # None without a protected_memory_stall objective
        self.own = own if guard.exempt.own_namespace else None
        # For ``role``, what every workload is checked against, resolved once.
        self._without_metadata = guard.candidates.pods_without_metadata
        self._exempt_namespaces = frozenset(guard.exempt.namespaces) | ({self.own} if self.own else frozenset())
        self._exempt_pods = tuple(guard.exempt.pods)
        self._namespaces = None if guard.candidates.namespaces is None else frozenset(guard.candidates.namespaces)
        self._labels = guard.candidates.label_selector

    def role(self, workload: Workload) -> Role:
        """``choose(workload).role``, without the words: what a plan asks of every workload each tick."""
        if workload.protected or (self.stall_protect and any(selects(workload, e) for e in self.stall_protect)):
            return Role.PROTECTED
        if self.memory_protect is not None and protected_for(workload, self.memory_protect):
            return Role.PROTECTED
        if not workload.metadata_known and not self._without_metadata:
            return Role.EXEMPT
        if workload.kind == "pod":
            namespace = workload.namespace
            if namespace in self._exempt_namespaces or (
                self._exempt_pods and any(s.matches(namespace, workload.labels) for s in self._exempt_pods)
            ):
                return Role.EXEMPT
            if (self._namespaces is not None and namespace not in self._namespaces) or (
                self._labels is not None and not self._labels.matches(workload.labels)
            ):
                return Role.UNSELECTED
        if workload.qos_class not in self.classes:
            return Role.UNSELECTED
        below = self.candidates.below_priority
        return Role.UNSELECTED if below is not None and workload.priority >= below else Role.CANDIDATE

    def roles(self, workloads: Mapping[str, WorkloadUsage]) -> dict[str, Role]:
        """``role`` of every workload, the rules' lookups bound once: a plan asks this of every workload."""
        role = self.role
        if self.stall_protect or self.memory_protect is not None or self._exempt_pods or self._labels is not None:
            return {wid: role(u.workload) for wid, u in workloads.items()}
        # The common shape, inlined: no protect list, pod selector or label selector to match.
        without_metadata, exempt, namespaces = self._without_metadata, self._exempt_namespaces, self._namespaces
        classes, below = self.classes, self.candidates.below_priority
        protected, exempted, unselected, candidate = Role.PROTECTED, Role.EXEMPT, Role.UNSELECTED, Role.CANDIDATE
        out: dict[str, Role] = {}
        for wid, usage in workloads.items():
            w = usage.workload
            if w.protected:
                out[wid] = protected
            elif (not w.metadata_known and not without_metadata) or (w.kind == "pod" and w.namespace in exempt):
                out[wid] = exempted
            elif (
                (w.kind == "pod" and namespaces is not None and w.namespace not in namespaces)
                or w.qos_class not in classes
                or (below is not None and w.priority >= below)
            ):
                out[wid] = unselected
            else:
                out[wid] = candidate
        return out

    def choose(self, workload: Workload) -> Choice:
        """The workload's role and the rule that decided it, in words (the trace's)."""
        if workload.protected:
            return Choice(Role.PROTECTED, workload.protected_by or "protected")
        for entry in self.stall_protect:
            if selects(workload, entry):
                return Choice(Role.PROTECTED, f"protected_cpu_stall protect {shown(entry)}")
        if self.memory_protect is not None and protected_for(workload, self.memory_protect):
            return Choice(Role.PROTECTED, self._memory_rule(workload))
        if not workload.metadata_known and not self.candidates.pods_without_metadata:
            return Choice(Role.EXEMPT, "no pod metadata (guard.candidates.podsWithoutMetadata is false)")
        exempt = self._exempt(workload)
        if exempt is not None:
            return Choice(Role.EXEMPT, exempt)
        return self._candidate(workload)

    def _memory_rule(self, workload: Workload) -> str:
        entry = next((e for e in self.memory_protect or () if selects(workload, e)), None)
        if entry is None:
            return "protected_memory_stall protects Guaranteed pods (no protect list)"
        return f"protected_memory_stall protect {shown(entry)}"

    def _exempt(self, workload: Workload) -> str | None:
        namespace = workload.namespace
        if workload.kind != "pod":
            return None
        if namespace is not None and namespace in self.exempt.namespaces:
            return f"guard.exempt.namespaces: {namespace}"
        if namespace is not None and namespace == self.own:
            return f"guard.exempt.ownNamespace: {namespace}"
        for index, selector in enumerate(self.exempt.pods):
            if selector.matches(namespace, workload.labels):
                return f"guard.exempt.pods[{index}]: {selector.shown()}"
        return None

    def _candidate(self, workload: Workload) -> Choice:
        spec = self.candidates
        because = []
        pod = workload.kind == "pod"
        if pod and spec.namespaces is not None:
            if workload.namespace not in spec.namespaces:
                return _unselected(f"guard.candidates.namespaces: not {workload.namespace or 'known'}")
            because.append(f"namespace {workload.namespace}")
        if pod and spec.label_selector is not None:
            labels = spec.label_selector.shown()
            if not spec.label_selector.matches(workload.labels):
                return _unselected(f"guard.candidates.labelSelector: no match for {labels}")
            because.append(f"labels {labels}")
        if workload.qos_class not in self.classes:
            return _unselected(f"guard.candidates.classes: not {workload.qos_class}")
        because.append(f"class {workload.qos_class}")
        below = spec.below_priority
        if below is not None:
            if workload.priority >= below:
                return _unselected(f"guard.candidates.belowPriority: priority {workload.priority} ≥ {below}")
            because.append(f"priority {workload.priority} < {below}")
        if not workload.metadata_known:
            because.append("no pod metadata (podsWithoutMetadata)")
        return Choice(Role.CANDIDATE, "guard.candidates: " + ", ".join(because))


def _unselected(rule: str) -> Choice:
    return Choice(Role.UNSELECTED, rule)


class Choices(Mapping[str, Choice]):
    """Every workload's choice for one plan, worked out when first read: a calm tick that neither acts nor
    reports does nothing per workload."""

    def __init__(
        self,
        workloads: Mapping[str, WorkloadUsage],
        guard: GuardSettings,
        stall_protect: tuple[ProtectEntry, ...],
        memory_protect: tuple[ProtectEntry, ...] | None,
    ) -> None:
        self._workloads = workloads
        self._rules = (guard, stall_protect, memory_protect)
        self._selection: Selection | None = None
        self._roles: dict[str, Role] | None = None
        self._found: dict[str, Choice] | None = None

    def _select(self) -> Selection:
        if self._selection is None:
            self._selection = Selection(*self._rules, own_namespace(self._workloads))
        return self._selection

    def roles(self) -> Mapping[str, Role]:
        """Every workload's role, without the rules' words (worked out once, when first asked)."""
        if self._roles is None:
            self._roles = self._select().roles(self._workloads)
        return self._roles

    def _all(self) -> dict[str, Choice]:
        if self._found is None:
            choose = self._select().choose
            self._found = {wid: choose(u.workload) for wid, u in self._workloads.items()}
        return self._found

    def __getitem__(self, workload_id: str) -> Choice:
        return self._all()[workload_id]

    def __iter__(self) -> Iterator[str]:
        return iter(self._all())

    def __len__(self) -> int:
        return len(self._workloads)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Mapping) and dict(self.items()) == dict(other.items())

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return f"Choices({self._all()!r})"
