"""Rejoining and fencing: a node admits only within its lease (I4); one that comes back starts from its state,
its retained ledger or its genesis share (I11), and rolls back to what its heir took after its will (I9, I10)."""

from __future__ import annotations

from nodeguard.coordination.protocol.estates import Estates
from nodeguard.coordination.protocol.model import Phase, Revoked
from nodeguard.coordination.records import Lost, Saved, SlotLedger


class Recovery(Estates):
    """Coming back online, rolling back, asking the heir, and fencing."""

    def _has_estate(self) -> bool:
        st = self.state
        return st is not None and st.published and (any(st.allot.values()) or st.mint is not None)

    def _recover(self, own: SlotLedger | None) -> Saved:
        """No persisted state: continue from this node's retained ledger; else a seed starts from its genesis
        share and any other node from nothing (I11)."""
        self.wants_persist = True
        if own is None:
            if self.name in self.cluster.seeds:
                self._note("genesis")
                return self.cluster.genesis(self.name, self.epoch)
            self._note("joined with no slots")
            return self.cluster.empty(self.name, self.epoch)
        self._note("recovered from the broker", seq=own.seq)
        next_grant = max([self.epoch << 20, *(g.id + 1 for g in own.grants)])
        saved = Saved.from_ledger(own, epoch=self.epoch, next_grant=next_grant, published=True)
        return self._adapt(saved)

    def _rollback_exact(self, own: SlotLedger) -> None:
        """Declared gone: the heir takes ``own`` (the retained ledger); continue from it, empty (I9)."""
        st = self._st
        st.allot = dict.fromkeys(st.allot, 0)
        st.mint = None
        st.grants = {g.id: g for g in own.grants}
        st.applied = {d: set(ids) for d, ids in own.applied.items()}
        st.adopted = dict(own.adopted)
        st.lost = list(own.lost)
        if any(own.allot.values()) or own.mint is not None:
            mint = None if own.mint is None else dict(own.mint)
            st.lost.append(Lost(own.seq, dict(own.allot), own.heir, mint, own.succession))
        st.lost_up_to = max(st.lost_up_to, own.seq)
        st.seq = max(st.seq, own.seq) + 1
        self.wants_persist = self.wants_ledger = True
        self.counters["rollbacks"] += 1
        self._note(
            "rolled back after own will: estate goes to heir", seq=own.seq, heir=own.heir, estate=dict(own.allot)
        )

    def _rollback_approx(self, seq: int) -> None:
        """The heir adopted ledger ``seq`` on a broker that is gone: drop what came after it (I10)."""
        st = self._st
        st.allot = dict.fromkeys(st.allot, 0)
        st.mint = None
        st.grants = {i: g for i, g in st.grants.items() if g.seq <= seq}
        st.lost_up_to = seq
        st.seq += 1
        self.wants_persist = self.wants_ledger = True
        self.counters["rollbacks"] += 1
        self._note("rolled back: heir reports adoption", seq=seq)

    def _asked(self) -> list[str]:
        """Whom a fenced node back on a restarted broker asks: its heir and the rest of its succession, any of
        which may have adopted its estate (I10, I16)."""
        st = self._st
        names = [self.heir, *(n for n, _ in st.succession)]
        return [n for n in dict.fromkeys(names) if n != self.name]

    def _ask_heir(self, now: float) -> None:
        self._asked_at = now
        for member in self._asked():
            self._copies[member] = True

    def _check_heir(self, now: float) -> None:
        """Every one asked has answered on this connection: roll back to what the one that adopted took."""
        adopted = 0
        for member in self._asked():
            peer = self._peer(member)
            if peer.ledger is None or peer.copy_conn != self.conn:
                return
            adopted = max(adopted, peer.ledger.adopted.get(self.name, 0))
        if adopted > self._st.lost_up_to:
            self._rollback_approx(adopted)
        self._st.await_heir = False
        self.wants_persist = True
        self._go_online(now)

    def _will_of_this_connection(self, now: float) -> None:
        """The broker published the will of the connection we are on: it does so for live connections only as it
        shuts down (mosquitto sends every pending will then). Nothing more may go out on this connection, or an
        heir could take a ledger older than our last one: stop admitting and rejoin on a new connection, where
        the retained will (if the broker kept it) or the heir (if it did not) says what was taken (I9)."""
        self.counters["own_will_on_this_connection"] += 1
        self._fence(now, "will")
        self.phase = Phase.SYNCING
        self.wants_sync = False
        self.wants_reconnect = True
        self._note("own will on this connection: rejoining on a new one", epoch=self.epoch)

    def _go_online(self, now: float) -> None:
        if self._peer(self.name).gone >= self.epoch:
            self._will_of_this_connection(now)
            return
        self.phase = Phase.ONLINE
        st = self._st
        st.published = True
        st.seq += 1  # the first ledger of a new epoch must supersede every earlier one
        self.wants_persist = self.wants_ledger = self.wants_status = self.wants_member = True
        if st.mint is not None:
            self.wants_census = self.census_stale = True
        if self.fenced and now < self.lease_until and not self.leaving:
            self._unfence(now)
        self._want_sent = None
        self._repick_heir()
        for node in list(self.peers):
            if node != self.name:
                self._reconcile(node, now)
                self._consider_gone(node, now)
        for grant in st.grants.values():
            self._copies.setdefault(grant.to, False)  # the recipients may have missed them
        if st.heir and st.heir != self.name:
            self._copies.setdefault(st.heir, False)  # the heir learns of its ward
        if self.leaving:
            self._drain_spare()
        for sem in list(st.allot):
            self._settle(sem, now)

    def _unfence(self, now: float) -> None:
        self.fenced = False
        self.fenced_reason = ""
        self.wants_status = True
        self._note("admitting", lease_left=round(self.lease_until - now, 3))

    def _stop_admitting(self, reason: str) -> None:
        """Fenced without revoking: the slots held stay with their loads (a drain, I13)."""
        if not self.fenced:
            self.counters["fenced"] += 1
        self.fenced = True
        self.fenced_reason = reason
        self.wants_status = True
        self._note("fenced", reason=reason, revoked=0)

    def _fence(self, now: float, reason: str) -> None:
        revoked = 0
        for sem, held in self.held.items():
            for load in sorted(held):
                self._fx.revoked.append(Revoked(sem, load))
                revoked += 1
            held.clear()
        self.counters["revoked"] += revoked
        if not self.fenced:
            self.counters["fenced"] += 1
        self.fenced = True
        self.fenced_reason = reason
        self.wants_status = True
        self._note("fenced", reason=reason, revoked=revoked)
