"""Reconciling with peers: grants applied once per recipient epoch and acknowledged (I1, I2), grants taken back
only when the recipient provably cannot apply them, and dead nodes' estates adopted once, by the heir their final
ledger names (I8, I9)."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable

from nodeguard.coordination.protocol.admission import Admission
from nodeguard.coordination.protocol.model import GRANT_RETRY, WANT_RETRY, Claim, Estate, PeerState
from nodeguard.coordination.records import Grant, Lost, SlotLedger, Succession


class Estates(Admission):
    """Acting on other nodes' ledgers and wills: grants, acknowledgements, retractions and adoptions."""

    @property
    def drained(self) -> bool:
        """Every grant of the drain has been acknowledged (or there was nothing to hand on), and the estates of
        wards whose will is out have been adopted (and passed on): an heir that left could not adopt them later."""
        if self.state is None:
            return True
        if self.state.grants or self._due_reads or self._reads:
            return False
        return not any(
            peer.gone > peer.gone_done and self._heir_of(node) == self.name for node, peer in self.peers.items()
        )

    def _known(self, sem: str) -> bool:
        census = self.census
        return sem in self.cluster.caps or sem in self._st.allot or (census is not None and sem in census.caps)

    def _consider_gone(self, node: str, now: float) -> None:
        peer = self._peer(node)
        if peer.gone <= peer.gone_done or self.state is None:
            return
        census = self.census
        stake = (
            self.is_bank
            or self._heir_of(node) == self.name
            or self.name in self._successors(node)
            or any(g.to == node for g in self.state.grants.values())
            # A dead bank's heir may not know it is one (it was away, I15): every node reads the bank's ledger.
            or (census is not None and census.bank == node)
            # A successor of an estate not yet settled: whether this one adopted it before its will (I16).
            or any(node in self._successors(dead) for dead in self._estates)
        )
        if stake:
            # Read after the will grace, on a connection that lasted through it: a broker shutting down publishes
            # the wills of live nodes and then drops every connection, so such wills are never acted on (I9).
            self._due_reads.setdefault(node, now + self.will_grace)

    def _own_will(self) -> int:
        """The newest epoch of this node's own will known: a claim named before it has passed on (I16)."""
        return max(self._st.handled_will, self._peer(self.name).gone, self._st.passed_before)

    def _claim(self, node: str, heir: str, succession: Succession | None, seq: int, now: float) -> Claim:
        """Whether this node adopts ``node``'s estate of ledger ``seq`` (I8, I16). The first of the succession adopts
        it; a member passes its claim on only once a will of it for an epoch at or after the one it was named in is
        out and its retained ledger, read after that will, does not show the estate adopted. The retained will and
        ledger are the same for every reader, and the member itself, on any later connection, knows that will
        (it reads its own before it admits, I9) and so never adopts what it passed on: one adopter at most."""
        chain: list[tuple[str, int | None]] = [(heir, None)] if succession is None else list(succession)
        chain = [(member, named) for member, named in chain if member not in ("", node)]
        for member, named in chain:
            if member == self.name:
                if named is not None and self._own_will() >= named:
                    continue  # this node died since it was named: its claim went on with its will
                return Claim.MINE
            peer = self._peer(member)
            if named is None or peer.gone < named:
                if peer.ledger is not None and peer.ledger.adopted.get(node, 0) >= seq:
                    return Claim.DONE
                return Claim.WAIT  # it may still adopt (a ledger without a succession: its heir alone adopts)
            if peer.gone_done < peer.gone or peer.ledger is None:
                self._due_reads.setdefault(member, now + self.will_grace)  # its ledger as its will left it
                return Claim.WAIT
            if peer.ledger.succession is None:
                return Claim.WAIT  # a version without successions adopts whatever names it heir
            if peer.ledger.adopted.get(node, 0) >= seq:
                return Claim.DONE
        # Every member has died since it was named, and none adopted it (the whole cluster went down at once): the
        # first takes it on the connection it is on now. The others, having passed, never adopt it, so it is still
        # one adopter.
        return Claim.MINE if chain and chain[0][0] == self.name else Claim.DONE

    def _estate(self, node: str, final: SlotLedger, gone_epoch: int, now: float) -> None:
        """``node``'s will for ``gone_epoch`` is out and ``final`` is its last ledger (I8)."""
        st = self._st
        peer = self._peer(node)
        peer.final_heir = final.heir
        peer.final_succession = tuple(n for n, _ in final.succession or ())
        self._estates[node] = final
        self._settle_estate(node, now)
        if self.is_bank:
            self.wants_census = True
        # A grant the dead connection never committed can come back, but only once its heir has adopted
        # the estate: that is what the node, when it returns, is sure to learn (by its will or its heir)
        # and roll back to; a will whose adoption a broker restart erased must change nothing.
        applied = final.applied.get(self.name, frozenset())
        for grant in list(st.grants.values()):
            if grant.to == node and grant.epoch <= gone_epoch and grant.id not in applied:
                self._retract_after[grant.id] = final.seq
        self._retract_adopted(node)

    def _settle_estate(self, node: str, now: float) -> None:
        """Adopt what of ``node``'s final ledger (and the estates it had lost) falls to this node (I8, I16); keep
        it while a claim before this node's is unsettled."""
        final = self._estates[node]
        done = self._st.adopted.get(node, 0)
        claims = [(final.seq, final.heir, final.succession, final.allot, final.mint)]
        claims += [(lost.seq, lost.heir, lost.succession, lost.allot, lost.mint) for lost in final.lost]
        mine, unsettled = [], False
        for seq, heir, succession, allot, mint in claims:
            if seq <= done:
                continue
            claim = self._claim(node, heir, succession, seq, now)
            if claim is Claim.MINE:
                mine.append((seq, allot, mint))
            unsettled |= claim is Claim.WAIT
        if mine:
            self._adopt(node, max(seq for seq, _, _ in mine), [(allot, mint) for _, allot, mint in mine])
        if not unsettled or self._st.adopted.get(node, 0) >= final.seq:
            del self._estates[node]

    def _settle_estates(self, now: float) -> None:
        for node in list(self._estates):
            if node in self._estates:
                self._settle_estate(node, now)

    def _adopted_of(self, node: str) -> int:
        """The newest ledger of ``node`` adopted by any of its successors (one at most adopts each, I2, I16)."""
        seqs = [0]
        for member in self._successors(node):
            if member == self.name:
                seqs.append(self._st.adopted.get(node, 0))
            else:
                ledger = self._peer(member).ledger
                seqs.append(ledger.adopted.get(node, 0) if ledger is not None else 0)
        return max(seqs)

    def _retract_adopted(self, node: str) -> None:
        """Take back the grants to ``node`` waiting for its estate's adoption, if its heir (or successor) adopted."""
        if not self._retract_after:
            return
        adopted = self._adopted_of(node)
        for grant_id, seq in list(self._retract_after.items()):
            grant = self._st.grants.get(grant_id)
            if grant is None:
                del self._retract_after[grant_id]
            elif grant.to == node and seq <= adopted:
                del self._retract_after[grant_id]
                self._retract(grant, "recipient gone, estate adopted")

    def _adopt(self, node: str, seq: int, estates: Iterable[Estate]) -> None:
        st = self._st
        gained: Counter[str] = Counter()
        for allot, mint in estates:
            for sem, n in allot.items():
                if n > 0:
                    gained[sem] += n
            if mint is not None:
                if st.mint is None:
                    st.mint = dict(mint)
                    self.wants_census = True
                    self._note("adopted the mint", of=node)
                else:
                    self.counters["ignored.second_mint"] += 1
        for sem, n in gained.items():
            st.allot[sem] = st.allot.get(sem, 0) + n
        st.adopted[node] = seq
        st.seq += 1
        self.wants_persist = self.wants_ledger = self.wants_status = True
        self.counters["adoptions"] += 1
        self._note("adopted estate", of=node, seq=seq, slots=dict(gained))

    def _retract(self, grant: Grant, why: str) -> None:
        st = self._st
        del st.grants[grant.id]
        self._sent_at.pop(grant.id, None)
        if grant.mint is not None:
            st.mint = dict(grant.mint)
            self.wants_census = True
        elif grant.n:
            st.allot[grant.sem] = st.allot.get(grant.sem, 0) + grant.n
        st.seq += 1
        self.wants_persist = self.wants_ledger = True
        self.counters["grants.retracted"] += 1
        self._note("took grant back", to=grant.to, id=grant.id, n=grant.n, why=why)
        if self.leaving:
            self._drain_spare()

    def _reconcile(self, node: str, now: float) -> None:
        """Act on ``node``'s newest ledger: grants to this node, acks, estates (I1, I2)."""
        ledger = self._peer(node).ledger
        st = self.state
        if ledger is None or st is None or node == self.name:
            return
        # Grants to this node.
        listed: set[int] = set()
        for grant in ledger.grants:
            if grant.to != self.name:
                continue
            listed.add(grant.id)
            if grant.epoch != self.epoch or grant.id in st.applied.get(node, ()):
                continue  # applied already, or to an earlier connection: its donor takes it back
            if grant.mint is not None:
                if st.mint is not None:
                    self.counters["ignored.second_mint"] += 1
                    continue
                st.mint = dict(grant.mint)
                self.wants_census = True
                self._note("received the mint", of=node)
            elif not self._known(grant.sem) or grant.n <= 0:
                self.counters["ignored.bad_grant"] += 1
                continue
            else:
                st.allot[grant.sem] = st.allot.get(grant.sem, 0) + grant.n
                self._via.setdefault(grant.sem, []).append((node, grant.id))
                sent = self._want_sent
                if sent is not None and sent[1].get(grant.sem):
                    sent[1][grant.sem] = max(0, sent[1][grant.sem] - grant.n)  # as the bank counts it down
            st.applied.setdefault(node, set()).add(grant.id)
            st.seq += 1
            self.wants_persist = True
            if node == self.bank and grant.mint is None:
                # The acknowledgement only lets the bank forget the grant, and it reads every ledger: it can wait
                # for this node's next ledger (the slot's return, usually) or the clean-up.
                self.ledger_stale = True
            else:
                self.wants_ledger = True
                self._copies.setdefault(node, False)  # the acknowledgement
            self.counters["grants.applied"] += 1
        # Acks for grants the donor no longer lists can go.
        ids = st.applied.get(node)
        if ids and not ids <= listed:
            ids &= listed
            if not ids:
                del st.applied[node]
            st.seq += 1
            self.wants_persist = self.ledger_stale = True
        # This node's grants to ``node``.
        acked = ledger.applied.get(self.name, frozenset())
        for grant in list(st.grants.values()):
            if grant.to != node:
                continue
            if grant.id in acked:
                del st.grants[grant.id]
                self._sent_at.pop(grant.id, None)
                st.seq += 1
                self.wants_persist = self.ledger_stale = True
                if self.leaving:
                    self.wants_ledger = self.wants_member = True
                self.counters["grants.acknowledged"] += 1
            elif ledger.epoch > grant.epoch:
                self._retract(grant, "recipient moved on")
        # Estates ``node`` lost to this node.
        done = st.adopted.get(node, 0)
        fresh = [
            lost
            for lost in ledger.lost
            if lost.seq > done and self._claim(node, lost.heir, lost.succession, lost.seq, now) is Claim.MINE
        ]
        if fresh:
            self._adopt(node, max(lost.seq for lost in fresh), [(lost.allot, lost.mint) for lost in fresh])
            self._copies[node] = False  # it drops them once it sees the adoption
        # Grants to nodes that ``node`` is the heir of, waiting for its adoption.
        for dead in {g.to for i, g in st.grants.items() if i in self._retract_after}:
            if node in self._successors(dead):
                self._retract_adopted(dead)
        # This node's lost estates that ``node`` (their heir) has adopted.
        upto = ledger.adopted.get(self.name, 0)
        if any(node in _names(lost) and lost.seq <= upto for lost in st.lost):
            st.lost = [lost for lost in st.lost if not (node in _names(lost) and lost.seq <= upto)]
            st.seq += 1
            self.wants_persist = self.ledger_stale = True
        if any(node in _names(lost) for lost in st.lost) and self._lost_told.get(node, -1) < ledger.seq:
            # Once per ledger of it: two nodes owing each other estates would otherwise copy back and forth while a
            # claim waits for a read (the retries ask again every second).
            self._lost_told[node] = ledger.seq
            self._copies.setdefault(node, False)

    def _retry(self, now: float) -> None:
        """Copies of unacknowledged grants go again, asking for an answer; an heir that has to adopt is read."""
        st = self._st
        for grant in st.grants.values():
            sent = self._sent_at.setdefault(grant.id, now)
            if now - sent >= GRANT_RETRY * self.retry:  # past the recipient's clean-up publication
                self._sent_at[grant.id] = now
                self._copies[grant.to] = True
                self.counters["grants.resent"] += 1
        if st.lost and now - self._polled_at >= self.retry:
            for lost in st.lost:  # ask its successors, and read their retained ledgers (they may have left since)
                for member in _names(lost):
                    if member != self.name:
                        self._copies.setdefault(member, True)
                        self._reads.add(member)
        if self._retract_after and now - self._polled_at >= self.retry:
            for dead in {g.to for i, g in st.grants.items() if i in self._retract_after}:
                self._reads.update(m for m in self._successors(dead) if m != self.name)
        if now - self._polled_at >= self.retry:
            self._polled_at = now
            if self.leaving:
                self.wants_member = True  # until it is gone: whoever missed it must not name it heir
        if any(self._demand.values()) and now - self._want_at >= WANT_RETRY * self.retry and self._want_sent:
            self._want_sent = None  # unanswered: say it again

    def _adopted_by_heir(self, node: str, peer: PeerState) -> bool:
        ledger = peer.ledger
        if ledger is None:
            return True
        return self._adopted_of(node) >= ledger.seq


def _names(lost: Lost) -> list[str]:
    """Who may adopt a lost estate: its heir, then its succession (I16)."""
    names = [lost.heir, *(n for n, _ in lost.succession or ())]
    return [n for n in dict.fromkeys(names) if n]
