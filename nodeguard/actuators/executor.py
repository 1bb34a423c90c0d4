"""Carrying out a plan: quota writes and evictions, with the ledger kept first.

Order matters for crash safety: a throttle is written to the ledger (and
fsynced) *before* the kernel file, so a daemon killed at any moment leaves no
throttle that the ledger does not know.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Coroutine
from dataclasses import dataclass, field, replace
from typing import Any

from nodeguard.actuators.cpu_quota import QuotaWriter
from nodeguard.actuators.evictors import Evictor
from nodeguard.actuators.ledger import Ledger, LedgerEntry
from nodeguard.actuators.restore import Outcome, restore_all
from nodeguard.errors import ActuationRefused, CgroupGone, ParseError
from nodeguard.log import get_logger
from nodeguard.model.snapshot import Snapshot
from nodeguard.policy.actions import Evict, Restore, Throttle
from nodeguard.policy.metrics import Metric
from nodeguard.policy.planner import Plan
from nodeguard.policy.state import GuardState, HeldThrottle

log = get_logger("nodeguard.executor")

Spawn = Callable[[Coroutine[Any, Any, None], str], None]


@dataclass
class ActionCounters:
    # (kind, metric, dry_run) -> count
    actions: dict[tuple[str, str, bool], int] = field(default_factory=dict)
    failed: int = 0

    def count(self, kind: str, metric: str, dry_run: bool) -> None:
        key = (kind, metric, dry_run)
        self.actions[key] = self.actions.get(key, 0) + 1


def _with_throttle(state: GuardState, workload_id: str, held: HeldThrottle | None) -> GuardState:
    throttles = dict(state.throttles)
    if held is None:
        throttles.pop(workload_id, None)
    else:
        throttles[workload_id] = held
    return replace(state, throttles=throttles)


class Executor:
    def __init__(self, quota: QuotaWriter, evictor: Evictor, ledger: Ledger, spawn: Spawn) -> None:
        self.quota = quota
        self.evictor = evictor
        self.ledger = ledger
        self.spawn = spawn
        self.counters = ActionCounters()
        self.evicting: set[str] = set()
        self._failed_evictions: set[str] = set()

    # --- the tick ---------------------------------------------------------------

    def carry_out(self, plan: Plan, before: GuardState, snapshot: Snapshot) -> GuardState:
        """Make the plan's changes; returns the state as the kernel now really is."""
        state = plan.state
        for workload_id in plan.departed:
            self.ledger.forget(workload_id)
        quota_actions = [a for a in plan.actions if isinstance(a, Throttle | Restore)]
        real = [a for a in quota_actions if not a.dry_run]
        for action in quota_actions:
            if action.dry_run:
                self._log(action, "dry run: would")
        if real:
            # Ledger first: mark every value about to be written as ours.
            for action in real:
                self.ledger.record(self._entry(action, pending=True))
            self.ledger.save()
            for action in real:
                state = self._write(action, before, state)
        for eviction in plan.actions:
            if isinstance(eviction, Evict):
                self._evict(eviction)
        state = self._reassert(snapshot, state)
        for workload_id in self._failed_evictions:
            state = state.without_eviction(workload_id)
        self._failed_evictions.clear()
        if real or plan.departed:
            self.ledger.save()
        return state

    def _entry(self, action: Throttle | Restore, pending: bool) -> LedgerEntry:
        held = self.ledger.entries.get(action.workload_id)
        target = action.quota.render_v2()
        return LedgerEntry(
            workload_id=action.workload_id,
            cgroup_version=self.quota.version,
            original=action.original.render_v2(),
            applied=held.applied if held is not None and pending else target,
            reason=str(action.metric),
            changed_at=time.time(),
            pending=target if pending else None,
        )

    def _write(self, action: Throttle | Restore, before: GuardState, state: GuardState) -> GuardState:
        workload_id = action.workload_id
        held = before.throttles.get(workload_id)
        try:
            self.quota.apply(
                workload_id,
                action.quota,
                last_applied=held.quota if held is not None else None,
                action=action.kind,
                metric=str(action.metric),
                reason=action.reason,
            )
        except CgroupGone:
            self.ledger.forget(workload_id)
            return _with_throttle(state, workload_id, None)
        except (OSError, ActuationRefused, ParseError) as exc:
            self.counters.failed += 1
            log.error("quota write failed", workload=workload_id, action=action.kind, error=str(exc))
            if held is None:
                self.ledger.forget(workload_id)
            else:
                self.ledger.record(replace(self.ledger.entries[workload_id], pending=None))
            return _with_throttle(state, workload_id, held)
        self.counters.count(action.kind, str(action.metric), False)
        self._log(action, "")
        if isinstance(action, Restore) and action.full:
            self.ledger.forget(workload_id)
        else:
            self.ledger.record(self._entry(action, pending=False))
        return state

    def _log(self, action: Throttle | Restore | Evict, prefix: str) -> None:
        if prefix:
            self.counters.count(action.kind, str(action.metric), True)
        fields: dict[str, object] = {
            "workload": action.workload_id,
            "metric": str(action.metric),
            "reason": action.reason,
            "gap": action.gap_before,
            "predicted_release": action.predicted_release,
        }
        if isinstance(action, Throttle | Restore):
            fields.update(quota=action.quota.render_v2(), previous=action.previous.render_v2())
        log.info(f"{prefix} {action.kind}".strip(), **fields)

    def _reassert(self, snapshot: Snapshot, state: GuardState) -> GuardState:
        """Put back any held quota that someone else changed (kubelet and runtimes reset quotas)."""
        for workload_id, held in state.throttles.items():
            usage = snapshot.workloads.get(workload_id)
            if usage is None or usage.cpu_max is None or usage.cpu_max == held.quota:
                continue
            try:
                self.quota.apply(workload_id, held.quota, last_applied=held.quota, action="reassert")  # logs the drift
            except CgroupGone:
                continue
            except (OSError, ActuationRefused, ParseError) as exc:
                self.counters.failed += 1
                log.error("cannot re-assert quota", workload=workload_id, error=str(exc))
        return state

    def _evict(self, action: Evict) -> None:
        if action.dry_run:
            self._log(action, "dry run: would")
            return
        if action.workload_id in self.evicting:
            return
        self.counters.count("evict", str(action.metric), False)
        self.evicting.add(action.workload_id)
        self.spawn(self._run_eviction(action), f"evict:{action.workload_id}")

    async def _run_eviction(self, action: Evict) -> None:
        try:
            gone = await self.evictor.evict(
                action.workload_id, metric=str(action.metric), gap=action.gap_before, reason=action.reason
            )
        except Exception as exc:  # an evictor bug must not end the daemon
            log.error("eviction failed", workload=action.workload_id, error=str(exc), exc_info=True)
            gone = False
        finally:
            self.evicting.discard(action.workload_id)
        if not gone:
            self.counters.failed += 1
            self._failed_evictions.add(action.workload_id)

    # --- start and stop ----------------------------------------------------------

    def adopt(self, now: float) -> GuardState:
        """Keep holding the ledger's throttles that are still in place; forget the rest."""
        throttles: dict[str, HeldThrottle] = {}
        for entry in list(self.ledger.entries.values()):
            try:
                current = self.quota.read(entry.workload_id)
            except CgroupGone:
                self.ledger.forget(entry.workload_id)
                continue
            except (OSError, ActuationRefused, ParseError) as exc:
                log.error("cannot read a ledger entry's quota; leaving it", workload=entry.workload_id, error=str(exc))
                continue
            if entry.cgroup_version != self.quota.version or not entry.is_ours(current):
                log.warning("ledger entry no longer ours; forgotten", workload=entry.workload_id)
                self.ledger.forget(entry.workload_id)
                continue
            reasons = frozenset({Metric(entry.reason)}) if entry.reason in Metric._value2member_map_ else frozenset()
            throttles[entry.workload_id] = HeldThrottle(entry.workload_id, entry.original_limit, current, reasons, now)
            self.ledger.record(replace(entry, applied=current.render_v2(), pending=None))
        self.ledger.save()
        return GuardState(throttles=throttles)

    def restore_everything(self) -> dict[Outcome, list[str]]:
        return restore_all(self.ledger, self.quota)
