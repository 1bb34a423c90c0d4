"""Admission and demand on every node (§4): loads admitted within the allotment and a valid lease (I4), admitting
nothing new under a lowered cap (I7), free slots returned to the bank or the promised node, the uncovered demand
sent to the bank, and a drained node's allotment and mint handed on (I12)."""

from __future__ import annotations

from nodeguard.coordination.protocol.bank import Bank
from nodeguard.coordination.protocol.model import Phase
from nodeguard.coordination.records import Want


class Admission(Bank):
    """What each semaphore's free slots and waiting loads come to after a step."""

    def _settle_all(self, now: float) -> None:
        if self.state is None:
            return
        if self.is_bank:
            self._mint_adjust_all()
        for sem in sorted(set(self.state.allot) | set(self.waiting)):
            self._settle(sem, now)

    def _settle(self, sem: str, now: float) -> None:
        st = self.state
        if st is None or self.fenced or self.leaving:
            return
        waiting = self.waiting.get(sem, {})
        held = self.held.get(sem, set())
        if self.is_bank and self.phase is Phase.ONLINE:
            self._serve(sem, now)
            return
        retiring = self._retiring(sem)
        bank = self.bank
        spare = st.allot.get(sem, 0) - len(held)
        if self.phase is Phase.ONLINE and bank not in (None, self.name) and spare > 0:
            # Free slots go back to the bank, so that they are where the demand is known (§4): all of them
            # when nothing waits here or the cap is being lowered; the freed ones when others wait at the bank.
            give = 0
            if retiring or not waiting:
                give = spare
            elif self.contended.get(sem) and self._freed.get(sem):
                give = min(spare, len(self._freed[sem]))
            target = self.forward.pop(sem, None) if give and not retiring else None
            if target is not None and target[0] not in (self.name, bank):
                self._grant(sem, target[0], 1, target[1])  # straight to the next waiting node: one hop
                give -= 1
                self.counters["grants.forwarded"] += 1
            if give and bank is not None:
                self._grant(sem, bank, give, self._epoch_of(bank))
        if not retiring:
            while waiting and len(held) < st.allot.get(sem, 0):
                self._admit(sem)
        uncovered = 0 if retiring else max(0, len(waiting) - max(0, st.allot.get(sem, 0) - len(held)))
        if sem in self.cluster.caps:
            self._demand[sem] = uncovered

    def take_want(self, now: float) -> tuple[str, Want] | None:
        """The demand to send to the bank, if it changed (or went unanswered for a while)."""
        bank = self.bank
        if bank is None or bank == self.name or self.phase is not Phase.ONLINE or self.leaving:
            return None
        demand = {s: n for s, n in self._demand.items() if s in self.cluster.caps}
        if self._want_sent == (bank, demand):
            return None
        if self._want_sent is None and not any(demand.values()):
            self._want_sent = (bank, demand)
            return None
        self._want_sent = (bank, demand)
        self._want_at = now
        return bank, Want(self.name, self.epoch, demand)

    @property
    def want_pending(self) -> bool:
        bank = self.bank
        if bank is None or bank == self.name or self.phase is not Phase.ONLINE:
            return False
        demand = {s: n for s, n in self._demand.items() if s in self.cluster.caps}
        return self._want_sent != (bank, demand) and (self._want_sent is not None or any(demand.values()))

    def _drain_spare(self) -> None:
        """The mint to the heir; free slots to the bank, else the heir (again after a drain grant came back)."""
        st = self.state
        if st is None or self.phase is not Phase.ONLINE:
            return
        self._repick_heir()
        heir = self.heir
        if st.mint is not None and heir != self.name:
            self._grant("", heir, 0, self._epoch_of(heir), mint=st.mint)
        bank = self.bank
        if bank is not None and bank not in self._joined():
            bank = None  # leaving too
        target = bank if bank not in (None, self.name) else (heir if heir != self.name else None)
        if target is not None:
            for sem, allot in sorted(st.allot.items()):
                spare = allot - len(self.held.get(sem, ()))
                if spare > 0:
                    self._grant(sem, target, spare, self._epoch_of(target))
        self._note("draining", to=target, allot=dict(st.allot))
