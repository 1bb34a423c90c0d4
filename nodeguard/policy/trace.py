"""The decision trace: a whole plan as one JSON-able dict.

It holds what the plan saw (node readings, waterlines), what it computed
(gaps by direction, the candidate orders with their sort keys, and which rule
made each workload a candidate, protected, exempt or unselected), what it
decided (actions with predicted releases) and what it did not do and why
(blocked), and where protection stands (its phase, and since when). Sort
keys are shown as the comparators compute them: lower sorts first, usages
negated so that the largest comes first. A lever change on a workload is an
action; one on a group that is not a workload (a QoS tier's weight) is listed
under ``reweighs`` with the candidates it holds back.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from nodeguard.model.levers import LeverChange
from nodeguard.model.snapshot import WorkloadUsage
from nodeguard.model.workloads import Workload
from nodeguard.policy.actions import Action, Evict
from nodeguard.policy.holds import HOLD_KINDS
from nodeguard.policy.metrics import Metric
from nodeguard.policy.planner import Plan
from nodeguard.policy.protect_state import ProtectState, QuotaTrial
from nodeguard.policy.ranking import ordering
from nodeguard.policy.selection import ROLE_ORDER, Choice, Role
from nodeguard.policy.state import GuardState, HeldBack


def _workload(workload: Workload) -> dict[str, Any]:
    return {
        "id": workload.id,
        "name": workload.name,
        "kind": workload.kind,
        "class": str(workload.qos_class),
        "priority": workload.priority,
    }


def _action(action: Action) -> dict[str, Any]:
    assert action.workload is not None
    data: dict[str, Any] = {
        "kind": action.kind,
        "workload": _workload(action.workload),
        "metric": str(action.metric),
        "reason": action.reason,
        "gap_before": action.gap_before,
        "predicted_release": action.predicted_release,
        "dry_run": action.dry_run,
    }
    if isinstance(action, Evict):
        data["cores"] = action.cores
        data["memory_bytes"] = action.memory_bytes
    else:
        data.update(action.details.fields())
    return data


def _on_group(action: Action) -> bool:
    return isinstance(action, LeverChange) and action.workload is None


def _key_part(part: object) -> object:
    return list(part) if isinstance(part, tuple) else part


def _candidates(
    names: tuple[str, ...], shown: Sequence[WorkloadUsage], choices: Mapping[str, Choice] | None
) -> list[dict[str, Any]]:
    """The first candidates of an order, each with its sort key by comparator name and the rule that made it one."""
    order = ordering(names)
    return [
        {
            "workload": usage.workload.id,
            "key": dict(zip(names, map(_key_part, order.key(usage)), strict=False)),
            **({} if choices is None else {"rule": choices[usage.workload.id].rule}),
        }
        for usage in shown
    ]


def _selection(choices: Mapping[str, Choice] | None, limit: int | None) -> list[dict[str, Any]]:
    """The workloads by role and the rule that decided it (policy.selection), candidates first, each rule with how
    many it decided and the first of them."""
    if choices is None:
        return []
    groups: dict[tuple[Role, str], list[str]] = {}
    for wid, choice in choices.items():
        groups.setdefault((choice.role, choice.rule), []).append(wid)
    ordered = sorted(groups.items(), key=lambda item: (ROLE_ORDER[item[0][0]], -len(item[1]), item[0][1]))
    return [
        {"role": str(role), "rule": rule, "count": len(ids), "workloads": sorted(ids)[:limit]}
        for (role, rule), ids in ordered
    ]


def _state(state: GuardState) -> dict[str, Any]:
    def keyed(counts: Mapping[tuple[Any, Any], int]) -> dict[str, int]:
        return {f"{metric}/{direction}": count for (metric, direction), count in counts.items()}

    protect = state.protect
    return {
        "streaks": keyed(state.streaks),
        "cooldowns": keyed(state.cooldowns),
        **{
            kind.trace_key: {group: hold.trace() for group, hold in state.holds.get(kind.lever, {}).items()}
            for kind in HOLD_KINDS
        },
        "evictions": {
            wid: {"metric": str(p.metric), "cores": p.cores, "memory_bytes": p.memory_bytes, "since": p.since}
            for wid, p in state.evictions.items()
        },
        "last_eviction": {("dry_run" if dry else "real"): at for dry, at in state.last_eviction.items()},
        "held_back": {wid: _held_back(h) for wid, h in state.held_back.items()},
        "last_harm": protect.last_harm,
        "quota_trial": _quota_trial(protect.trial),
        "quotas_futile_until": protect.futile_until,
        "protect_phase": {"phase": str(protect.phase), "since": protect.since},
    }


def _quota_trial(trial: QuotaTrial | None) -> dict[str, Any] | None:
    return None if trial is None else {"since": trial.since, "before_pct": trial.before, "ticks": trial.ticks}


def phase_seconds(protect: ProtectState, now: float) -> float | None:
    """How long protection has been in its phase (None: since before the daemon's first tick)."""
    return None if protect.since is None else now - protect.since


def _protected(plan: Plan) -> list[dict[str, Any]]:
    """Each protected workload's stall against the protected_cpu_stall objective's target (None without one),
    the levers held for it now (this tick's included) and protection's phase."""
    line = plan.waterlines.get((Metric.PROTECTED_CPU_STALL, "throttle"))
    state = plan.state
    levers = sorted({hold.lever_shown() for hold in state.every_hold() if Metric.PROTECTED_CPU_STALL in hold.reasons})
    phase = str(state.protect.phase)
    seconds = phase_seconds(state.protect, plan.monotonic)
    return [
        {
            "workload": p.workload_id,
            "name": p.name,
            "stall_pct": p.stall_pct,
            "target_pct": None if line is None else line.threshold,
            "restore_below_pct": None if line is None else line.restore_below,
            "harmed": None if line is None or p.stall_pct is None else p.stall_pct > line.threshold,
            "waiting_cores": p.waiting_cores,
            "levers": levers,
            "phase": phase,
            "phase_seconds": seconds,
        }
        for p in plan.protected
    ]


def _held_back(hold: HeldBack) -> dict[str, Any]:
    return {
        "error": hold.error,
        "file": hold.file,
        "detail": hold.detail,
        "since": hold.since,
        "until": hold.until,
        "failures": hold.failures,
    }


def plan_to_data(plan: Plan, candidate_limit: int | None = None) -> dict[str, Any]:
    """The plan as plain JSON values; ``candidate_limit`` keeps only the first candidates of each order."""
    released: dict[str, float] = {}
    for action in plan.actions:
        if action.predicted_release is not None and not _on_group(action):
            metric = str(action.metric)
            released[metric] = released.get(metric, 0.0) + action.predicted_release
    return {
        "monotonic": plan.monotonic,
        "inputs": {
            "workloads": plan.workloads,
            "candidates": plan.candidates,
            "readings": {str(m): value for m, value in plan.readings.items()},
        },
        "waterlines": [
            {
                "metric": str(line.metric),
                "action": line.action,
                "threshold": line.threshold,
                "restore_below": line.restore_below,
                "trigger_after": line.trigger_after,
                "restore_after": line.restore_after,
                "dry_run": line.dry_run,
                "sort_by": list(line.sort_by),
                "objective": line.objective,
            }
            for line in plan.waterlines.values()
        ],
        "gaps": {
            "throttle_down": {str(m): gap for m, gap in plan.gaps.throttle_down.items()},
            "throttle_up": {str(m): gap for m, gap in plan.gaps.throttle_up.items()},
            "evict": {str(m): gap for m, gap in plan.gaps.evict.items()},
        },
        "candidates": {
            ",".join(names): _candidates(names, ranked[:candidate_limit], plan.choices)
            for names, ranked in plan.rankings.items()
        },
        "selection": _selection(plan.choices, candidate_limit),
        "actions": [_action(action) for action in plan.actions if not _on_group(action)],
        "predicted_release": released,
        "blocked": [
            {"metric": str(b.metric), "direction": str(b.direction), "cause": b.cause, "detail": b.detail}
            for b in plan.blocked
        ],
        "departed": list(plan.departed),
        "expired": [{"workload": p.workload_id, "metric": str(p.metric), "since": p.since} for p in plan.expired],
        "held_back": [{"workload": h.workload_id, **_held_back(h)} for h in plan.held_back],
        "protected": _protected(plan),
        "reweighs": [
            {
                "group": r.group,
                "lower": r.holds_back,
                "workloads": list(r.workloads),
                "reason": r.reason,
                "dry_run": r.dry_run,
            }
            for r in plan.changes
            if r.workload is None
        ],
        "state": _state(plan.state),
    }
