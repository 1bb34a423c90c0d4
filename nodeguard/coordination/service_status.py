"""The service's status report: this node's phase, lease, broker link and semaphores, and the members as the
bank's census shows them."""

from __future__ import annotations

import time
from typing import Any

from nodeguard.coordination.semaphore import Phase
from nodeguard.coordination.service_io import ServiceIO


class ServiceStatus(ServiceIO):
    """What ``status()`` reports."""

    def status(self) -> dict[str, Any]:
        if not self.enabled:
            return {"enabled": False}
        node, now = self.node, time.monotonic()
        stats = self.link.stats
        state = node.state
        census = node.census
        applied = (
            dict(state.mint)
            if state is not None and state.mint is not None
            else (dict(census.caps) if census is not None else {})
        )
        return {
            "enabled": True,
            "failed": self.failed,
            "node": self.name,
            "cluster": self.settings.cluster,
            "phase": node.phase.value,
            "connected": self.link.connected,
            "admitting": node.admitting,
            "fenced": node.fenced,
            "fencedReason": node.fenced_reason,
            "leaving": node.leaving,
            "epoch": node.epoch,
            "heir": node.heir,
            "succession": [name for name, _ in node.state.succession] if node.state is not None else [],
            "bank": node.bank,
            "seeds": list(self.cluster.seeds),
            "leaseRemainingSeconds": round(max(0.0, node.lease_until - now), 3),
            "outageSeconds": round(now - stats.disconnected_since, 3) if stats.disconnected_since else 0.0,
            "broker": {
                "address": f"{self.settings.broker.host}:{self.settings.broker.port}",
                "connects": stats.connects,
                "disconnects": stats.disconnects,
                "failedAttempts": stats.failed_attempts,
                "refused": stats.refused,
                "published": stats.published,
                "received": stats.received,
                "lastError": stats.last_error,
            },
            "semaphores": {
                sem: {
                    "cap": cap,
                    "appliedCap": applied.get(sem),
                    "allotment": state.allot.get(sem, 0) if state is not None else 0,
                    "held": len(node.held[sem]),
                    "waiting": len(node.waiting[sem]),
                    "admitted": node.admitted[sem],
                    "grantsOut": sum(g.n for g in state.grants.values() if g.sem == sem) if state else 0,
                }
                for sem, cap in self.cluster.caps.items()
            },
            "members": self._members(),
            "counters": dict(self.counters + node.counters),
        }

    def _members(self) -> dict[str, dict[str, Any]]:
        """The members as the bank's census shows them (this node's own entry from its own state); the census is
        read again when it is older than a heartbeat, so a status or a scrape shows it a moment later."""
        now = time.monotonic()
        if (
            not self.node.is_bank
            and self.link.connected
            and self._group is not None
            and not self._census_reading
            and now - self._census_read_at >= self.settings.heartbeat
        ):
            self._census_read_at, self._census_reading = now, True
            self._group.create_task(self._read_census())
        census = self.node.full_census or self.node.census
        members: dict[str, dict[str, Any]] = {}
        if census is not None:
            for name in census.joined:
                members[name] = {"state": "joined", "allotment": {}, "heir": ""}
            for name, view in sorted(census.members.items()):
                members[name] = {"state": view.state.value, "allotment": dict(view.allot), "heir": view.heir}
            if census.bank in members:
                members[census.bank]["bank"] = True
        state = self.node.state
        if state is not None:
            me = "leaving" if self.node.leaving else ("joined" if self.node.phase is Phase.ONLINE else "offline")
            members[self.name] = {"state": me, "allotment": dict(state.allot), "heir": self.node.heir}
            if state.mint is not None:
                members[self.name]["bank"] = True
        return members
