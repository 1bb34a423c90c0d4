"""Slots moving: a load admitted, a grant sent (I1, I3), and the bank's side of §4: the mint applying the
configured caps (I5, I6, I7), the queue of waiting nodes served in turn, and promises of holders' next freed slots."""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Mapping

from nodeguard.coordination.protocol.membership import Membership
from nodeguard.coordination.protocol.model import Admitted, Donated
from nodeguard.coordination.records import Grant, SlotLedger


class Bank(Membership):
    """Admitting, granting, and what the node holding the mint does with free slots and demand."""

    def _retiring(self, sem: str) -> bool:
        """A lowered cap not yet applied everywhere: admit nothing new (I7)."""
        configured = self.cluster.caps.get(sem, 0)
        st = self.state
        if st is not None and st.mint is not None:
            return st.mint.get(sem, 0) > configured
        return sem not in self.cluster.caps or self.applied_caps().get(sem, 0) > configured

    def applied_caps(self) -> Mapping[str, int]:
        """The slots in existence as this node last heard: the bank's record or a copy of the bank's ledger (which
        comes with every grant from it), whichever is newer, so a grant is never used on older news than its own."""
        st = self.state
        if st is not None and st.mint is not None:
            return st.mint
        census = self.census
        if census is None:
            return {}
        ledger = self._peer(census.bank).ledger
        if ledger is not None and ledger.mint is not None and ledger.seq > census.ledger_seq:
            return ledger.mint
        return census.caps

    def _admit(self, sem: str) -> None:
        load = next(iter(self.waiting[sem]))
        del self.waiting[sem][load]
        self.held[sem].add(load)
        self.admitted[sem] += 1
        via = self._via[sem].pop(0) if self._via.get(sem) else None
        self._fx.admitted.append(Admitted(sem, load, via))
        self.counters["admitted"] += 1

    def _mint_adjust_all(self) -> None:
        st = self._st
        assert st.mint is not None
        for sem in sorted(set(st.mint) | set(self.cluster.caps)):
            self._mint_adjust(sem)

    def _mint_adjust(self, sem: str) -> None:
        """The bank applies the configured cap: new slots are minted, a lowering retires free slots (I6)."""
        st = self._st
        mint = st.mint
        assert mint is not None
        target = self.cluster.caps.get(sem, 0)
        current = mint.get(sem, 0)
        if target > current:
            st.allot[sem] = st.allot.get(sem, 0) + target - current
            mint[sem] = target
            self._note("cap raised", sem=sem, cap=target, was=current)
        elif target < current:
            retire = min(current - target, st.allot.get(sem, 0) - len(self.held.get(sem, ())))
            if retire <= 0:
                return
            st.allot[sem] -= retire
            mint[sem] = current - retire
            self._note("slots retired", sem=sem, retired=retire, cap=mint[sem], target=target)
        else:
            return
        if mint.get(sem) == 0 and sem not in self.cluster.caps:
            del mint[sem]
            st.allot.pop(sem, None)
        st.seq += 1
        self.wants_persist = self.wants_ledger = self.wants_census = True

    def _serve(self, sem: str, now: float) -> None:
        """The bank hands its free slots to the waiting nodes in turn, itself included (§4)."""
        st = self._st
        self._mint_adjust(sem)
        queue = self.queue.setdefault(sem, OrderedDict())
        waiting, held = self.waiting.get(sem, {}), self.held.get(sem, set())
        if waiting and not self._retiring(sem):
            if self.name not in queue:
                queue[self.name] = (self.epoch, len(waiting))
            else:
                queue[self.name] = (self.epoch, len(waiting))
        else:
            queue.pop(self.name, None)
        spare = st.allot.get(sem, 0) - len(held)
        if self._retiring(sem):
            spare = 0
        while spare > 0 and queue:
            node, (epoch, n) = next(iter(queue.items()))
            del queue[node]
            if node == self.name:
                self._admit(sem)
            elif self._peer(node).gone >= epoch:
                continue
            else:
                self._grant(sem, node, 1, epoch)
            spare -= 1
            if n > 1:
                queue[node] = (epoch, n - 1)  # its turn again after the others
        self._promise(sem)
        others = any(node != self.name for node in queue)
        self._tell_holders(sem, others)

    def _track_holder(self, ledger: SlotLedger) -> None:
        """The bank, on a node's newer ledger: who holds slots, and whether a promised slot went where promised."""
        node = ledger.node
        newest = max([self._newest_grant.get(node, 0), *(g.id for g in ledger.grants)])
        for sem in set(ledger.allot) | set(self._holders):
            holders = self._holders.setdefault(sem, set())
            if ledger.allot.get(sem, 0) > 0 and not ledger.leaving:
                holders.add(node)
            else:
                holders.discard(node)
            promise = self._promised.get(sem, {}).get(node)
            if promise is None:
                continue
            target, epoch, since = promise
            new = [g for g in ledger.grants if g.id > since and g.sem == sem]
            if target != self.name and any(g.to == target for g in new):
                del self._promised[sem][node]  # kept
            elif new or node not in holders:
                # It gave its slot back to the bank (it had not heard yet, or the bank's own loads were next) or holds
                # nothing: the promised node is served first from what the bank has.
                del self._promised[sem][node]
                queue = self.queue.setdefault(sem, OrderedDict())
                left = queue.pop(target, (epoch, 0))[1]
                queue[target] = (epoch, left + 1)
                queue.move_to_end(target, last=False)
        self._newest_grant[node] = newest

    def _promise(self, sem: str) -> None:
        """The bank: each holder without a promise is told which waiting node its next freed slot goes to, in the
        queue's order, so that a slot passes in one hop instead of two (through the bank)."""
        queue = self.queue.get(sem)
        if not queue:
            return
        promised = self._promised.setdefault(sem, {})
        for holder in sorted(self._holders.get(sem, ())):
            if holder in promised or holder == self.name or self._peer(holder).gone >= self._epoch_of(holder):
                continue
            target = next((n for n in queue if n != holder), None)  # the bank itself: the slot comes back
            if target is None:
                return
            epoch, n = queue.pop(target)
            if n > 1:
                queue[target] = (epoch, n - 1)
            promised[holder] = (target, epoch, self._newest_grant.get(holder, 0))
            self._copies.setdefault(holder, False)
            self.counters["promises"] += 1

    def _unpromise(self, node: str) -> None:
        """A holder leaving or gone: its promised nodes are served first from what the bank has."""
        for sem, promised in self._promised.items():
            promise = promised.pop(node, None)
            if promise is not None:
                target, epoch, _ = promise
                queue = self.queue.setdefault(sem, OrderedDict())
                left = queue.pop(target, (epoch, 0))[1]
                queue[target] = (epoch, left + 1)
                queue.move_to_end(target, last=False)
            for holder, promise_of in list(promised.items()):
                if promise_of[0] == node:
                    del promised[holder]

    def forward_hint(self, peer: str) -> dict[str, tuple[str, int]]:
        """What the bank tells ``peer`` in a copy: where its next freed slot goes, per semaphore."""
        hints = {}
        for sem, promised in self._promised.items():
            promise = promised.get(peer)
            if promise is not None:
                hints[sem] = (promise[0], promise[1])
        return hints

    def _tell_holders(self, sem: str, contended: bool) -> None:
        """When a queue forms, the nodes holding slots learn that others wait (O(cap) messages, not O(nodes)) and
        give freed slots back; a node that comes to hold slots while it lasts is told as its ledger arrives."""
        was = self._contended.get(sem, False)
        self._contended[sem] = contended
        if not contended:
            if was:
                for told in self._told.values():
                    told.pop(sem, None)
            return
        if not was:
            for node in self.peers:
                self._tell_holder(node, sem)

    def _tell_holder(self, node: str, sem: str) -> None:
        ledger = self._peer(node).ledger
        if node == self.name or ledger is None or ledger.allot.get(sem, 0) <= 0:
            return
        told = self._told.setdefault(node, {})
        if not told.get(sem):
            told[sem] = True
            self._copies.setdefault(node, False)

    def queue_hint(self) -> dict[str, int]:
        """What the bank tells the nodes it writes to: how many others wait, per semaphore."""
        return {sem: sum(1 for node in q if node != self.name) for sem, q in self.queue.items()}

    def _grant(self, sem: str, to: str, n: int, epoch: int, *, mint: Mapping[str, int] | None = None) -> None:
        st = self._st
        if mint is not None:
            st.mint = None
            self.queue.clear()
            self._promised.clear()
            self.wants_census = False
        else:
            st.allot[sem] -= n
        st.seq += 1
        grant = Grant(
            id=st.next_grant, sem=sem, to=to, epoch=epoch, n=n, seq=st.seq, mint=None if mint is None else dict(mint)
        )
        st.next_grant += 1
        st.grants[grant.id] = grant
        freed = self._freed[sem].pop(0) if self._freed.get(sem) else None
        via = self._via[sem].pop(0) if self._via.get(sem) and freed is None else None
        self._fx.donated.append(Donated(grant, freed, via))
        self.wants_persist = self.wants_ledger = True
        if to != self.bank:
            self._copies.setdefault(to, False)  # the bank reads every ledger itself
        self.counters["grants.sent"] += 1
