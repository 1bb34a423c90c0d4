"""What arrives from the broker: ledgers and copies (acted on only when newest, I2), demands at the bank (§4), the
bank record, membership records, wills (I8, I9) and the answers to reads of retained ledgers."""

from __future__ import annotations

from collections import OrderedDict

from nodeguard.coordination.protocol.model import Effects, Phase
from nodeguard.coordination.protocol.outbox import Outbox
from nodeguard.coordination.records import Census, Copy, Gone, Member, MemberState, SlotLedger, Want


class Messages(Outbox):
    """The handlers of incoming messages."""

    def on_ledger(self, ledger: SlotLedger, now: float) -> Effects:
        """A retained ledger: this node's own (at sync), or any node's (the bank subscribes to all)."""
        return self._ledger_in(ledger, now, None)

    def on_copy(self, copy: Copy, sender: str, now: float) -> Effects:
        """A ledger copy in this node's inbox."""
        if copy.ledger.node != sender or sender == self.name:
            self.counters["ignored.bad_copy"] += 1
            return self._take()
        return self._ledger_in(copy.ledger, now, copy)

    def _ledger_in(self, ledger: SlotLedger, now: float, copy: Copy | None) -> Effects:
        peer = self._peer(ledger.node)
        if copy is None:
            peer.latest, peer.latest_conn = ledger, self.conn
        else:
            peer.copy_conn = self.conn
            if ledger.node == self.bank:
                for sem, n in copy.queue.items():
                    self.contended[sem] = n > 0
                self.forward = dict(copy.forward)  # the bank's latest word
        fresh = peer.ledger is None or ledger.seq > peer.ledger.seq
        if fresh:
            peer.ledger = ledger
        else:
            self.counters["stale"] += 1
        if self.phase is Phase.WAITING_HEIR and copy is not None and ledger.node in self._asked():
            self._check_heir(now)
        elif self.phase is Phase.ONLINE and ledger.node != self.name:
            if fresh or copy is not None:  # an answer: act on the newest ledger known (a grant may be newer)
                self._reconcile(ledger.node, now)
            if copy is not None and copy.ask:
                self._copies[ledger.node] = False  # answer: it needs this node's ledger
            if fresh and self.is_bank:
                self.census_stale = True
                self._track_holder(ledger)
                for sem, contended in self._contended.items():
                    if contended:
                        self._tell_holder(ledger.node, sem)
            if fresh and ledger.leaving:
                self._repick_heir()
                for queue in self.queue.values():
                    queue.pop(ledger.node, None)  # the bank: nothing more to it
                self._unpromise(ledger.node)
            if self.leaving:
                self._drain_spare()  # what arrived while leaving goes on
            self._settle_all(now)
        return self._take()

    def on_want(self, want: Want, now: float) -> Effects:
        """A node's demand, in the bank's inbox (§4)."""
        if not self.is_bank or want.node == self.name:
            self.counters["stale.want"] += 1
            return self._take()
        if self._peer(want.node).gone >= want.epoch:
            return self._take()
        for sem, n in want.sems.items():
            queue = self.queue.setdefault(sem, OrderedDict())
            if n > 0:
                if want.node not in queue:
                    queue[want.node] = (want.epoch, n)
                else:
                    queue[want.node] = (want.epoch, n)  # keeps its place
            else:
                queue.pop(want.node, None)
        if self.phase is Phase.ONLINE:
            self._settle_all(now)
        return self._take()

    def on_census(self, census: Census, now: float) -> Effects:
        old = self.census
        if old is not None and (census.epoch, census.seq) < (old.epoch, old.seq) and census.bank == old.bank:
            self.counters["stale"] += 1
            return self._take()
        self.census = census
        if self.phase is Phase.ONLINE and self.state is not None:
            if old is None or old.bank != census.bank or old.epoch != census.epoch:
                self._want_sent = None  # a new bank: tell it what waits here
            for node, view in census.members.items():
                if view.heir == self.name and node != self.name:
                    self._consider_gone(node, now)
            self._repick_heir()
            self._settle_all(now)
        return self._take()

    def on_full_census(self, census: Census) -> None:
        """The census, read on demand: for status only."""
        self.full_census = census

    def on_member(self, member: Member, now: float) -> Effects:
        """A membership record (the bank subscribes to them, for the census)."""
        peer = self._peer(member.node)
        if peer.member is None or member.epoch >= peer.member.epoch:
            peer.member = member
            if self.is_bank:
                self.wants_census = True
                if member.state is not MemberState.JOINED:
                    for queue in self.queue.values():
                        queue.pop(member.node, None)
                    self._unpromise(member.node)
            if member.state is not MemberState.JOINED and self.phase is Phase.ONLINE:
                self._repick_heir()
        return self._take()

    def on_gone(self, gone: Gone, now: float) -> Effects:
        peer = self._peer(gone.node)
        peer.gone_conn = self.conn
        if gone.epoch <= peer.gone:
            return self._take()
        peer.gone = gone.epoch
        if self.is_bank:
            self.wants_census = True
            for queue in self.queue.values():
                queue.pop(gone.node, None)
            self._unpromise(gone.node)
        if self.phase is not Phase.ONLINE:
            return self._take()
        if gone.node != self.name:
            self._consider_gone(gone.node, now)
            self._repick_heir()  # the heir, or another member of the succession (I16)
        elif gone.epoch >= self.epoch:
            self._will_of_this_connection(now)
        elif self.state is not None and gone.epoch > self.state.handled_will:
            # A will of an earlier connection: stop admitting now, and decide what the heir takes only from the
            # broker's retained ledger after a barrier (our own last ledger may still be on its way back to us).
            self.counters["own_will_while_online"] += 1
            self._fence(now, "will")
            self.phase = Phase.SYNCING
            self.wants_sync = True
        return self._take()

    def read_done(self, node: str, ledger: SlotLedger | None, conn: int, now: float) -> Effects:
        """The broker's retained ledger of ``node`` (``None``: it has none), read on ``conn``."""
        if conn != self.conn or self.phase is not Phase.ONLINE:
            return self._take()  # read again after the next sync
        peer = self._peer(node)
        if ledger is not None:
            peer.latest, peer.latest_conn = ledger, self.conn
        if peer.gone > peer.gone_done:
            if ledger is not None and ledger.epoch <= peer.gone:
                self._estate(node, ledger, peer.gone, now)
            peer.gone_done = peer.gone
        # A successor's ledger after its will: whether the claims of estates waiting on it pass on (I16).
        self._settle_estates(now)
        if ledger is not None and (peer.ledger is None or ledger.seq > peer.ledger.seq):
            peer.ledger = ledger
            self._reconcile(node, now)
        self._settle_all(now)
        return self._take()
