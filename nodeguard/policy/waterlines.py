"""Waterlines: the configured objectives resolved against this node's capacity.

Several objectives on the same metric and action make one waterline: the
lowest threshold wins, and its objective supplies triggerAfter, dryRun and
the candidate order; their protect patterns are pooled. For throttling, the restore waterline is the lowest
restoreBelow and restoreAfter the longest, so a restore satisfies every
objective on the metric; both stay strictly below the waterline because each
objective's restoreBelow is below its own threshold.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType
from typing import Literal

from nodeguard.model.snapshot import NodeUsage
from nodeguard.policy.metrics import CAPABILITIES, Metric
from nodeguard.policy.settings import Objective, ProtectEntry

ActionKind = Literal["throttle", "evict"]


@dataclass(frozen=True, slots=True)
class Waterline:
    metric: Metric
    action: ActionKind
    threshold: float  # in the metric's unit
    restore_below: float | None  # throttle only
    trigger_after: int
    restore_after: int
    dry_run: bool
    sort_by: tuple[str, ...]
    objective: str  # the winning objective's name, or its place in the list
    protect: tuple[ProtectEntry, ...] = ()  # the stall objectives: who they protect (policy.selection); () the default

    @property
    def quantified(self) -> bool:
        return CAPABILITIES[self.metric].quantified(self.action)


def pooled(*lists: tuple[ProtectEntry, ...]) -> tuple[ProtectEntry, ...]:
    """The entries of every list once, in order (a pod selector is no dict key: compared, not hashed)."""
    found: list[ProtectEntry] = []
    for entry in (e for entries in lists for e in entries):
        if entry not in found:
            found.append(entry)
    return tuple(found)


def resolve_waterlines(objectives: Sequence[Objective], node: NodeUsage) -> dict[tuple[Metric, ActionKind], Waterline]:
    """One waterline per (metric, action), thresholds in the metric's unit for this node."""
    lines: dict[tuple[Metric, ActionKind], Waterline] = {}
    for index, objective in enumerate(objectives):
        cap = CAPABILITIES[objective.metric]
        capacity = cap.capacity(node)
        threshold = objective.threshold.resolve(capacity)
        restore = objective.restore_below.resolve(capacity) if objective.restore_below is not None else None
        line = Waterline(
            metric=objective.metric,
            action=objective.action,
            threshold=threshold,
            restore_below=restore,
            trigger_after=objective.trigger_after,
            restore_after=objective.restore_after,
            dry_run=objective.dry_run,
            sort_by=tuple(objective.sort_by) if objective.sort_by else cap.sort_by,
            objective=objective.name or f"objectives[{index}]",
            protect=tuple(objective.protect or ()),
        )
        key = (objective.metric, objective.action)
        held = lines.get(key)
        if held is None:
            lines[key] = line
            continue
        winner = line if line.threshold < held.threshold else held
        restores = [r for r in (held.restore_below, restore) if r is not None]
        lines[key] = Waterline(
            metric=winner.metric,
            action=winner.action,
            threshold=winner.threshold,
            restore_below=min(restores) if restores else None,
            trigger_after=winner.trigger_after,
            restore_after=max(held.restore_after, line.restore_after),
            dry_run=winner.dry_run,
            sort_by=winner.sort_by,
            objective=winner.objective,
            protect=pooled(held.protect, line.protect),
        )
    return lines


Lines = Mapping[tuple[Metric, ActionKind], Waterline]
_last: list[tuple[Sequence[Objective], tuple[float, ...], Lines]] = []  # the last one resolved


def waterlines_for(objectives: Sequence[Objective], node: NodeUsage) -> Lines:
    """``resolve_waterlines``, resolved again only when the objectives (a reload) or the node's capacities change:
    a calm tick then costs no waterline at all. The mapping is shared: read-only."""
    capacities = tuple(CAPABILITIES[o.metric].capacity(node) for o in objectives)
    if _last and _last[0][0] is objectives and _last[0][1] == capacities:
        return _last[0][2]
    lines = MappingProxyType(resolve_waterlines(objectives, node))
    _last[:] = [(objectives, capacities, lines)]
    return lines
