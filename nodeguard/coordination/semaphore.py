"""Cluster semaphores: the coordination protocol as state transitions, without I/O.

The specification, its numbered invariants (I1 ...) and the proof that the cap
holds are in docs/coordination-protocol.md; comments here cite them. Every
node runs a :class:`ProtocolNode`; the service (service.py) feeds it messages,
connection events and the clock, and carries out what it asks for (persist,
publish, send copies, read retained ledgers). Nothing here touches the network,
the disk or the clock, so tests drive it through any interleaving
(tests/coordination/sim.py). The node is built from parts (protocol/), one per
concern; this module adds its entry points: loads, configuration, connection
and drain.
"""

from __future__ import annotations

from nodeguard.coordination.protocol.messages import Messages
from nodeguard.coordination.protocol.model import (
    GRANT_RETRY,
    RETRY,
    WANT_RETRY,
    WILL_GRACE,
    Admitted,
    Cluster,
    Donated,
    Effects,
    Estate,
    PeerState,
    Phase,
    Revoked,
)
from nodeguard.coordination.records import Saved

__all__ = [
    "GRANT_RETRY",
    "RETRY",
    "WANT_RETRY",
    "WILL_GRACE",
    "Admitted",
    "Cluster",
    "Donated",
    "Effects",
    "Estate",
    "PeerState",
    "Phase",
    "ProtocolNode",
    "Revoked",
    "Saved",
]


class ProtocolNode(Messages):
    """One node's side of the protocol."""

    # --- loads ------------------------------------------------------------------------

    def request(self, sem: str, load: str, now: float) -> Effects:
        """A load wants a slot; it is admitted now or by a later call's effects."""
        waiting = self.waiting[sem]  # KeyError: not a configured semaphore
        if load not in waiting and load not in self.held[sem]:
            waiting[load] = None
            self.wants_status = True
            self._settle(sem, now)
        return self._take()

    def withdraw(self, sem: str, load: str, now: float) -> Effects:
        """A load stops waiting or gives its slot back (while leaving, a freed slot is handed on, I13)."""
        if load in self.waiting.get(sem, {}):
            del self.waiting[sem][load]
        elif load in self.held.get(sem, set()):
            self.held[sem].discard(load)
            self._freed[sem].append(now)
        else:
            return self._take()
        self.wants_status = True
        if self.leaving:
            self._drain_spare()
        self._settle(sem, now)
        return self._take()

    # --- configuration ----------------------------------------------------------------

    def reconfigure(self, cluster: Cluster, now: float) -> Effects:
        """Caps changed by a reload (I6, I7): the bank mints or retires; others follow the census."""
        self.cluster = cluster
        for sem in cluster.caps:
            self.waiting.setdefault(sem, {})
            self.held.setdefault(sem, set())
            self.admitted.setdefault(sem, 0)
            self._freed.setdefault(sem, [])
            self._via.setdefault(sem, [])
            if self.state is not None:
                self.state.allot.setdefault(sem, 0)
        self._note("caps reconfigured", caps=dict(cluster.caps))
        self._settle_all(now)
        return self._take()

    # --- connection -------------------------------------------------------------------

    def begin_connect(self, wall_ms: int) -> int:
        """The epoch of the next connection (persist before connecting: the will names it)."""
        # Wall time only makes epochs grow across a lost state dir; order comes from max().
        self.epoch = max(self.epoch + 1, wall_ms)
        if self.state is not None:
            self.state.epoch = self.epoch
            self.state.next_grant = max(self.state.next_grant, self.epoch << 20)
            # Pessimistic, and on disk before the connection exists: a crash between finding the broker
            # restarted and writing that down must not let the next start skip the question to the heir (I10).
            self._question_before = self.state.await_heir
            if self.fenced and self._has_estate() and self.heir != self.name:
                self.state.await_heir = True
            self.wants_persist = True
        return self.epoch

    def connected(self, now: float, session_present: bool) -> Effects:
        self.conn += 1
        self.phase = Phase.SYNCING
        self.session_present = session_present
        self.wants_status = True
        self._reads.clear()
        self._copies.clear()
        return self._take()

    def disconnected(self, now: float) -> Effects:
        self.phase = Phase.OFFLINE
        self.wants_sync = self.wants_reconnect = False
        self._reads.clear()
        self._due_reads.clear()  # considered again once back online
        self._copies.clear()
        self._want_sent = None
        self.wants_status = True
        self._note("disconnected", lease_left=round(max(0.0, self.lease_until - now), 3))
        return self._take()

    def lease_renewed(self, sent_at: float, conn: int, now: float) -> Effects:
        """A message sent at ``sent_at`` on connection ``conn`` was acknowledged by the broker (I4)."""
        if conn != self.conn:
            return self._take()
        self.lease_until = max(self.lease_until, sent_at + self.lease_seconds)
        # The broker still had this very connection, so no will was published for it.
        if self.fenced and self.phase is Phase.ONLINE and now < self.lease_until and not self.leaving:
            self._unfence(now)
        return self._take()

    def synced(self, now: float) -> Effects:
        """The broker's retained state has been read on this connection: rejoin."""
        if self.phase is not Phase.SYNCING:
            return self._take()
        me = self._peer(self.name)
        own = me.latest if me.latest_conn == self.conn else None
        if self.state is None:
            self.state = self._recover(own)
        st = self.state
        if me.gone_conn == self.conn and me.gone > st.handled_will:
            # A will of this node the broker still holds: its heir takes (or took) the retained ledger (I9).
            if own is not None and own.epoch <= me.gone and own.heir not in ("", self.name):
                self._fence(now, "will")
                self._rollback_exact(own)
            st.handled_will = me.gone
            self.wants_persist = True
        if not self.session_present:
            # Without a session a will of an earlier connection has fired, or the broker forgot it (I10): either
            # way claims named before this connection may have passed on, and this node cannot tell (I16).
            st.passed_before = max(st.passed_before, self.epoch - 1)
        # A broker without this node's session and without its will may have restarted since a will of
        # it was acted on; the question stays open across reconnects and restarts until the heir answers (I10).
        st.await_heir = self.heir != self.name and (
            self._question_before
            or (self.fenced and not self.session_present and me.gone_conn != self.conn and self._has_estate())
        )
        self.wants_persist = True
        if st.await_heir:
            self.phase = Phase.WAITING_HEIR
            self._note("waiting for heir", heir=self.heir)
            self._ask_heir(now)
            return self._take()
        self._go_online(now)
        return self._take()

    def tick(self, now: float) -> Effects:
        if now >= self.lease_until and (not self.fenced or any(self.held.values())):
            self._fence(now, "lease")  # also a draining node's slots kept for loads in flight (I4, I13)
        if self.phase is Phase.WAITING_HEIR and now >= self._asked_at + self.retry:
            self._ask_heir(now)
        if self.phase is Phase.ONLINE and self.state is not None:
            for node, due in list(self._due_reads.items()):
                if now >= due:
                    del self._due_reads[node]
                    self._reads.add(node)
            for node in {g.to for g in self.state.grants.values()}:
                self._reconcile(node, now)  # grants whose recipient has moved on come back
            self._retry(now)
            if self.admitting:
                self._settle_all(now)
            elif self.is_bank:
                self._mint_adjust_all()
        return self._take()

    # --- leaving ----------------------------------------------------------------------

    def drain(self, now: float) -> Effects:
        """Leaving (SIGTERM): admit nothing more and hand the free allotment, and the mint, on at once (I12). Slots
        held by loads still starting stay in this node's allotment (I13): a restarted gate claims them again; if the
        node does not come back, its heir adopts them after its will. The service waits for the acknowledgements."""
        st = self.state
        self.leaving = True
        self._stop_admitting("stopping")
        if st is not None:
            st.leaving = True
            st.seq += 1
            self.wants_persist = self.wants_ledger = True
        self.wants_member = self.wants_status = True
        for sem in self.waiting:
            self.waiting[sem].clear()
        self._drain_spare()
        return self._take()

    def stop(self, now: float) -> Effects:
        """The process is stopping: every slot it holds is revoked, nothing more is admitted."""
        self.leaving = True
        self._fence(now, "stopping")
        return self._take()
