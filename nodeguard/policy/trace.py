"""The decision trace: a whole plan as one JSON-able dict.

It holds what the plan saw (node readings, waterlines), what it computed
(gaps by direction, the candidate orders with their sort keys), what it
decided (actions with predicted releases) and what it did not do and why
(blocked). Sort keys are shown as the comparators compute them: lower sorts
first, usages negated so that the largest comes first.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from nodeguard.model.samples import CpuMax
from nodeguard.model.snapshot import WorkloadUsage
from nodeguard.model.workloads import Workload
from nodeguard.policy.actions import Action, Evict, MemoryRestore, MemoryThrottle, Restore, Throttle
from nodeguard.policy.metrics import Metric
from nodeguard.policy.planner import Plan
from nodeguard.policy.ranking import ordering
from nodeguard.policy.state import GuardState, HeldBack, QuotaTrial


def _cpu_max(limit: CpuMax) -> dict[str, Any]:
    return {"quota_us": limit.quota_us, "period_us": limit.period_us, "cores": limit.cores}


def _bytes(value: int | None) -> int | str:
    """A memory.high value as shown: bytes, or "max"."""
    return "max" if value is None else value


def lever(quota: CpuMax, original: CpuMax) -> str:
    """Which knob a throttle turns: the quota, on the workload's own period or another one."""
    if quota.period_us != original.period_us:
        return f"cpu.max quota on a {quota.period_us / 1000:g} ms period"
    return "cpu.max quota"


def _workload(workload: Workload) -> dict[str, Any]:
    return {
        "id": workload.id,
        "name": workload.name,
        "kind": workload.kind,
        "class": str(workload.qos_class),
        "priority": workload.priority,
    }


def _action(action: Action) -> dict[str, Any]:
    data: dict[str, Any] = {
        "kind": action.kind,
        "workload": _workload(action.workload),
        "metric": str(action.metric),
        "reason": action.reason,
        "gap_before": action.gap_before,
        "predicted_release": action.predicted_release,
        "dry_run": action.dry_run,
    }
    if isinstance(action, Throttle | Restore):
        data["quota"] = _cpu_max(action.quota)
        data["previous"] = _cpu_max(action.previous)
        data["original"] = _cpu_max(action.original)
        data["lever"] = lever(action.quota, action.original)
    if isinstance(action, MemoryThrottle | MemoryRestore):
        data["lever"] = "memory.high"
        data["memory_high"] = _bytes(action.high)
        data["previous"] = _bytes(action.previous)
        data["original"] = _bytes(action.original)
    if isinstance(action, MemoryThrottle):
        data["release_bytes"] = action.release_bytes
    elif isinstance(action, MemoryRestore):
        data["full"] = action.full
    if isinstance(action, Throttle):
        data["release_cores"] = action.release_cores
    elif isinstance(action, Restore):
        data["full"] = action.full
    elif isinstance(action, Evict):
        data["cores"] = action.cores
        data["memory_bytes"] = action.memory_bytes
    return data


def _key_part(part: object) -> object:
    return list(part) if isinstance(part, tuple) else part


def _candidates(names: tuple[str, ...], shown: Sequence[WorkloadUsage]) -> list[dict[str, Any]]:
    """The first candidates of an order, each with its sort key by comparator name."""
    order = ordering(names)
    return [
        {"workload": usage.workload.id, "key": dict(zip(names, map(_key_part, order.key(usage)), strict=False))}
        for usage in shown
    ]


def _state(state: GuardState) -> dict[str, Any]:
    def keyed(counts: Mapping[tuple[Any, Any], int]) -> dict[str, int]:
        return {f"{metric}/{direction}": count for (metric, direction), count in counts.items()}

    return {
        "streaks": keyed(state.streaks),
        "cooldowns": keyed(state.cooldowns),
        "throttles": {
            wid: {
                "original": _cpu_max(held.original),
                "quota": _cpu_max(held.quota),
                "reasons": sorted(str(m) for m in held.reasons),
                "since": held.since,
            }
            for wid, held in state.throttles.items()
        },
        "memory": {
            wid: {
                "original": _bytes(held.original),
                "memory_high": held.high,
                "reasons": sorted(str(m) for m in held.reasons),
                "since": held.since,
            }
            for wid, held in state.memory.items()
        },
        "evictions": {
            wid: {"metric": str(p.metric), "cores": p.cores, "memory_bytes": p.memory_bytes, "since": p.since}
            for wid, p in state.evictions.items()
        },
        "last_eviction": {("dry_run" if dry else "real"): at for dry, at in state.last_eviction.items()},
        "held_back": {wid: _held_back(h) for wid, h in state.held_back.items()},
        "lowered_weights": {group: {"since": w.since} for group, w in state.lowered.items()},
        "last_harm": state.last_harm,
        "quota_trial": _quota_trial(state.quota_trial),
        "quotas_futile_until": state.quotas_futile_until,
    }


def _quota_trial(trial: QuotaTrial | None) -> dict[str, Any] | None:
    return None if trial is None else {"since": trial.since, "before_pct": trial.before, "ticks": trial.ticks}


def _protected(plan: Plan) -> list[dict[str, Any]]:
    """Each protected workload's stall against the protected_cpu_stall objective's target (None without one)."""
    line = plan.waterlines.get((Metric.PROTECTED_CPU_STALL, "throttle"))
    # The levers held for it now (this tick's included).
    levers = [f"cpu weight lowered on {group}" for group in sorted(plan.state.lowered)] + sorted(
        {
            lever(held.quota, held.original)
            for held in plan.state.throttles.values()
            if Metric.PROTECTED_CPU_STALL in held.reasons
        }
    )
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
        if action.predicted_release is not None:
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
            ",".join(names): _candidates(names, ranked[:candidate_limit]) for names, ranked in plan.rankings.items()
        },
        "actions": [_action(action) for action in plan.actions],
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
                "lower": r.lower,
                "workloads": list(r.workloads),
                "reason": r.reason,
                "dry_run": r.dry_run,
            }
            for r in plan.reweighs
        ],
        "state": _state(plan.state),
    }
