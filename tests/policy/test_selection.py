"""Who the guard may act on, and the rule that decided it: one precedence for annotations, selectors, classes
and priority (policy.selection), shown by the plan, the trace and ``nodeguard plan``."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest

from nodeguard.kubernetes.metadata import apply, parse_pod
from nodeguard.model.snapshot import WorkloadUsage
from nodeguard.model.workloads import OWN_WORKLOAD, QosClass
from nodeguard.policy.planner import plan
from nodeguard.policy.selection import Choice, Role, Selection
from nodeguard.policy.state import GuardState
from nodeguard.policy.trace import plan_to_data
from nodeguard.surfaces.render import render_plan
from tests.kubernetes.objects import pod as api_pod
from tests.kubernetes.workloads import pod_usage
from tests.policy.builders import cpu_throttle, guard, snapshot, usage

STALL = {"metric": "protected_cpu_stall", "threshold": 5, "restoreBelow": 1, "action": "throttle"}
UIDS = iter(f"{n:08x}-0000-4000-8000-000000000000" for n in range(1, 1000))


def pod(
    name: str,
    namespace: str = "batch",
    *,
    qos: QosClass = QosClass.BURSTABLE,
    labels: dict[str, str] | None = None,
    **spec: Any,
) -> WorkloadUsage:
    """A pod cgroup as discovery finds it, with its pod's metadata laid over it as the integration does."""
    uid = next(UIDS)
    found = pod_usage(uid, qos=qos)
    meta = parse_pod(api_pod(name, uid, namespace=namespace, qos=str(qos), labels=labels or {}, **spec))
    return found._replace(workload=apply(found.workload, meta, held=False))


def choose(workload: WorkloadUsage, settings: dict[str, Any] | None = None, *objectives: dict[str, Any],
           own: str | None = None) -> Choice:  # fmt: skip
    rules = guard(*objectives, **(settings or {}))
    stall = next((tuple(o.get("protect", ())) for o in objectives if o["metric"] == "protected_cpu_stall"), ())
    protect = tuple(rules.objectives[0].protect or ()) if stall else ()
    return Selection(rules, protect, None, own).choose(workload.workload)


def test_kube_system_and_nodeguards_own_namespace_are_exempt_by_default_and_that_can_change() -> None:
    """Pods in kube-system and in nodeguard's own namespace are exempt; an emptied guard.exempt makes the same
    pods candidates by their class."""
    dns, broker = pod("coredns-7db6d8ff4d-x2v9q", "kube-system"), pod("mqtt-0", "nodeguard")
    assert choose(dns) == Choice(Role.EXEMPT, "guard.exempt.namespaces: kube-system")
    assert choose(broker, own="nodeguard") == Choice(Role.EXEMPT, "guard.exempt.ownNamespace: nodeguard")
    opened = {"exempt": {"namespaces": [], "ownNamespace": False}}
    assert choose(dns, opened) == Choice(Role.CANDIDATE, "guard.candidates: class Burstable")
    assert choose(broker, opened, own="nodeguard").role is Role.CANDIDATE


def test_the_precedence_from_protection_down_to_priority() -> None:
    """Each rule of the documented order wins over every rule after it, for the same pod."""
    everything = {
        "exempt": {"namespaces": ["batch"]},
        "candidates": {"namespaces": ["batch"], "labelSelector": {"matchLabels": {"team": "ml"}}, "belowPriority": 10},
    }
    objective = {**STALL, "protect": [{"labelSelector": {"matchLabels": {"tier": "serving"}}}]}
    annotated = pod("a", labels={"team": "ml", "tier": "serving"}, annotations={"nodeguard.io/protected": "true"})
    assert choose(annotated, everything, objective) == Choice(
        Role.PROTECTED, 'annotation nodeguard.io/protected: "true"'
    )
    critical = pod("b", labels={"team": "ml", "tier": "serving"}, priority_class="system-node-critical",
                   priority=2_000_001_000)  # fmt: skip
    assert choose(critical, everything, objective) == Choice(Role.PROTECTED, "priority class system-node-critical")
    serving = pod("c", labels={"team": "ml", "tier": "serving"})
    assert choose(serving, everything, objective) == Choice(
        Role.PROTECTED, "protected_cpu_stall protect labels tier=serving"
    )
    batch = pod("d", labels={"team": "ml"})
    assert choose(batch, everything, objective) == Choice(Role.EXEMPT, "guard.exempt.namespaces: batch")
    candidates_only = {"candidates": everything["candidates"]}
    assert choose(pod("e", labels={"team": "web"}), candidates_only).rule == (
        "guard.candidates.labelSelector: no match for team=ml"
    )
    assert choose(pod("f", "prod", labels={"team": "ml"}), candidates_only).rule == (
        "guard.candidates.namespaces: not prod"
    )
    guaranteed = pod("g", labels={"team": "ml"}, qos=QosClass.GUARANTEED)
    assert choose(guaranteed, candidates_only).rule == "guard.candidates.classes: not Guaranteed"
    important = pod("h", labels={"team": "ml"}, priority=100)
    assert choose(important, candidates_only).rule == "guard.candidates.belowPriority: priority 100 ≥ 10"
    offset = pod("i", labels={"team": "ml"}, priority=100, annotations={"nodeguard.io/priority-offset": "-95"})
    assert choose(offset, candidates_only) == Choice(
        Role.CANDIDATE, "guard.candidates: namespace batch, labels team=ml, class Burstable, priority 5 < 10"
    )


def test_exempt_pod_selectors_and_protect_globs_on_namespace_and_name() -> None:
    """guard.exempt.pods takes pods by label; an objective's glob takes a pod by "namespace/name"."""
    gpu = pod("trainer-0", labels={"accelerator": "a100"})
    exempt = {"exempt": {"pods": [{"namespaces": ["batch"], "labelSelector": {"matchExpressions": [
        {"key": "accelerator", "operator": "Exists"}]}}]}}  # fmt: skip
    assert choose(gpu, exempt) == Choice(Role.EXEMPT, "guard.exempt.pods[0]: namespaces batch; labels accelerator")
    web = pod("web-5d9c-abcde", "prod")
    assert choose(web, {}, {**STALL, "protect": ["prod/web-*"]}) == Choice(
        Role.PROTECTED, 'protected_cpu_stall protect "prod/web-*"'
    )


def test_pods_without_metadata_are_left_alone_unless_the_config_allows_them() -> None:
    """A pod cgroup with no pod metadata is exempt; guard.candidates.podsWithoutMetadata makes it a candidate by
    its cgroup's class, and then no namespace rule can exempt it (it has none)."""
    bare = pod_usage(next(UIDS), qos=QosClass.BURSTABLE)
    bare = bare._replace(workload=dataclasses.replace(bare.workload, metadata_known=False))
    assert choose(bare) == Choice(Role.EXEMPT, "no pod metadata (guard.candidates.podsWithoutMetadata is false)")
    allowed = {"candidates": {"podsWithoutMetadata": True}, "exempt": {"namespaces": ["kube-system"]}}
    assert choose(bare, allowed) == Choice(
        Role.CANDIDATE, "guard.candidates: class Burstable, no pod metadata (podsWithoutMetadata)"
    )


def test_pod_selectors_neither_select_nor_exempt_configured_groups() -> None:
    """A plain host's group has no namespace or labels: the candidates' pod selectors and guard.exempt.pods leave
    it to its class, even a NotIn that an unlabelled pod would match."""
    group = usage("system.slice/batch.service", qos=QosClass.BEST_EFFORT)
    group = group._replace(workload=dataclasses.replace(group.workload, kind="group"))
    settings = {
        "candidates": {"namespaces": ["batch"], "labelSelector": {"matchLabels": {"team": "ml"}}},
        "exempt": {"pods": [{"labelSelector": {"matchExpressions": [
            {"key": "team", "operator": "NotIn", "values": ["ml"]}]}}]},
    }  # fmt: skip
    assert choose(group, settings) == Choice(Role.CANDIDATE, "guard.candidates: class BestEffort")
    protected = dataclasses.replace(group.workload, protected=True, protected_by="workloads.groups[1].protected")
    assert choose(group._replace(workload=protected)) == Choice(Role.PROTECTED, "workloads.groups[1].protected")


@pytest.fixture
def node() -> list[WorkloadUsage]:
    """nodeguard's own pod, kube-system's CNI agent and CoreDNS, a broker in nodeguard's namespace, batch pods."""
    own = pod("nodeguard-x7k2p", "nodeguard")
    own = own._replace(workload=dataclasses.replace(own.workload, protected=True, protected_by=OWN_WORKLOAD))
    return [
        own,
        pod("calico-node-4xkq2", "kube-system", priority_class="system-node-critical", priority=2_000_001_000),
        pod(
            "coredns-7db6d8ff4d-x2v9q", "kube-system", priority_class="system-cluster-critical", priority=2_000_000_000
        ),
        pod("kube-proxy-9z8rt", "kube-system"),
        pod("mqtt-0", "nodeguard"),
        pod("train-1", labels={"team": "ml"}),
        pod("train-2", labels={"team": "ml"}, qos=QosClass.BEST_EFFORT),
        pod("etl-1", labels={"team": "data"}),
    ]


def test_the_plan_acts_on_candidates_only_and_its_trace_says_which_rule_chose_each(node: list[WorkloadUsage]) -> None:
    """Over the waterline the throttles fall on candidates only; the trace's candidates carry their rule, and its
    selection counts every workload once under the rule that decided it, candidates first."""
    settings = guard(cpu_throttle(1.0, 0.5), candidates={"labelSelector": {"matchLabels": {"team": "ml"}}})
    busy = snapshot([u._replace(cores=1.0) for u in node], cpus=8, cores_used=8.0)
    p = plan(busy, GuardState(), settings)
    names = {u.workload.id: u.workload.name for u in node}
    assert {names[c.group] for c in p.changes} <= {"batch/train-1", "batch/train-2"} and p.changes
    data = plan_to_data(p)
    [order] = data["candidates"].values()
    assert [(names[c["workload"]], c["rule"]) for c in order] == [
        ("batch/train-2", "guard.candidates: labels team=ml, class BestEffort"),
        ("batch/train-1", "guard.candidates: labels team=ml, class Burstable"),
    ]
    by_rule = {(g["role"], g["rule"]): sorted(names[w] for w in g["workloads"]) for g in data["selection"]}
    assert by_rule == {
        ("candidate", "guard.candidates: labels team=ml, class BestEffort"): ["batch/train-2"],
        ("candidate", "guard.candidates: labels team=ml, class Burstable"): ["batch/train-1"],
        ("protected", OWN_WORKLOAD): ["nodeguard/nodeguard-x7k2p"],
        ("protected", "priority class system-node-critical"): ["kube-system/calico-node-4xkq2"],
        ("protected", "priority class system-cluster-critical"): ["kube-system/coredns-7db6d8ff4d-x2v9q"],
        ("exempt", "guard.exempt.namespaces: kube-system"): ["kube-system/kube-proxy-9z8rt"],
        ("exempt", "guard.exempt.ownNamespace: nodeguard"): ["nodeguard/mqtt-0"],
        ("unselected", "guard.candidates.labelSelector: no match for team=ml"): ["batch/etl-1"],
    }
    assert [g["role"] for g in data["selection"]][:2] == ["candidate", "candidate"]
    text = render_plan(p)
    assert "what the guard may act on, and by which rule" in text
    assert "exempt      guard.exempt.namespaces: kube-system" in text


def test_a_calm_plan_still_says_who_is_chosen_when_it_is_read(node: list[WorkloadUsage]) -> None:
    """A tick with nothing to do computes no candidates, yet its trace (nodeguard plan, /status) names every
    workload's rule once read."""
    p = plan(snapshot(node, cores_used=0.5), GuardState(), guard(cpu_throttle(6.0, 5.0)))
    assert p.candidates is None
    selection = plan_to_data(p, candidate_limit=1)["selection"]
    assert sum(g["count"] for g in selection) == len(node)
    assert all(len(g["workloads"]) <= 1 for g in selection)
    [candidates] = [g for g in selection if g["rule"] == "guard.candidates: class Burstable"]
    assert candidates["count"] == 2  # train-1, etl-1 (train-2 is BestEffort)


def test_a_stall_objective_protects_pods_by_selector_and_measures_their_stall(node: list[WorkloadUsage]) -> None:
    """A protect entry selecting pods by label makes them protected workloads (their stall is read) and no
    candidates."""
    objective = {**STALL, "protect": [{"namespaces": ["batch"], "labelSelector": {"matchLabels": {"team": "data"}}}]}
    p = plan(snapshot(node, cores_used=0.5), GuardState(), guard(objective))
    assert [s.name for s in p.protected] == ["batch/etl-1"]
    assert p.choices is not None
    [etl] = [wid for wid, u in zip(p.choices, node, strict=True) if u.workload.name == "batch/etl-1"]
    assert p.choices[etl] == Choice(Role.PROTECTED, "protected_cpu_stall protect namespaces batch; labels team=data")


def test_a_tier_holding_an_exempt_pod_keeps_its_weight() -> None:
    """The weight lever never lowers a QoS tier that holds an exempt pod (a kube-system pod in the Burstable tier):
    the tier's weight would hold it back too. The BestEffort tier beside it, only batch work, comes down."""
    guaranteed = pod("important", qos=QosClass.GUARANTEED)
    guaranteed = guaranteed._replace(cores=0.4, waiting_cores=0.3, starved_cores=0.0)
    coredns = pod("coredns", "kube-system")._replace(cores=0.2, waiting_cores=0.1, starved_cores=0.1)
    burners = [
        pod(f"b{i}", qos=qos)._replace(cores=0.8, waiting_cores=0.7, starved_cores=0.7)
        for i, qos in enumerate([QosClass.BURSTABLE, QosClass.BEST_EFFORT])
    ]
    p = plan(
        snapshot([guaranteed, coredns, *burners], cpus=2, cores_used=2.0),
        GuardState(),
        guard({**STALL, "triggerAfter": 1}),
    )
    lowered = {c.group for c in p.changes if c.kind == "reweigh" and c.holds_back}
    tiers = {w.workload.id.rsplit("/", 1)[0] for w in burners}
    burstable = coredns.workload.id.rsplit("/", 1)[0]
    assert lowered == tiers - {burstable}, lowered


def test_the_fast_role_is_the_role_of_the_worded_choice() -> None:
    """``Selection.role`` and ``roles`` (what each tick asks of every workload) agree with ``choose`` (the trace's
    words) over every mix of kind, metadata, namespace, labels, class, priority and protection, under several
    configs."""
    import itertools

    from nodeguard.model.workloads import Workload

    configs: list[dict[str, Any]] = [
        {},
        {"candidates": {"podsWithoutMetadata": True, "belowPriority": 100}},
        {"candidates": {"namespaces": ["batch"], "labelSelector": {"matchLabels": {"tier": "batch"}}}},
        {"exempt": {"namespaces": [], "ownNamespace": False,
                    "pods": [{"labelSelector": {"matchExpressions": [{"key": "tier", "operator": "In", "values": ["web"]}]}}]}},
        {"candidates": {"classes": ["BestEffort"]}, "exempt": {"namespaces": ["batch"]}},
    ]  # fmt: skip
    web = {"namespaces": ["batch"], "labelSelector": {"matchLabels": {"tier": "web"}}}
    objectives = [(), ({**STALL, "protect": ["web*", web]},)]
    mixes = itertools.product(
        ["pod", "group"], [True, False], [None, "kube-system", "batch", "nodeguard"],
        [{}, {"tier": "batch"}, {"tier": "web"}], list(QosClass), [0, 500], [False, True], ["webapp", "batch-1"],
    )  # fmt: skip
    workloads = [
        Workload(
            id=f"kp/{name}",
            name=name,
            kind=kind,
            qos_class=qos,
            priority=priority,
            protected=protected,
            metadata_known=known,
            namespace=namespace,
            labels=labels,
        )
        for kind, known, namespace, labels, qos, priority, protected, name in mixes
    ]
    checked = 0
    for config, objective in itertools.product(configs, objectives):
        rules = guard(*objective, **config)
        protect = tuple(rules.objectives[0].protect or ()) if objective else ()
        selection = Selection(rules, protect, None, "nodeguard")
        empty = [None] * (len(WorkloadUsage._fields) - 1)
        roles = selection.roles({str(i): WorkloadUsage(w, *empty) for i, w in enumerate(workloads)})
        for i, workload in enumerate(workloads):
            assert selection.role(workload) is selection.choose(workload).role, (config, objective, workload)
            assert roles[str(i)] is selection.choose(workload).role, (config, objective, workload)
            checked += 1
    assert checked == len(configs) * len(objectives) * len(workloads) > 3000
