"""Membership as the bank record shows it: the epochs of other nodes' connections, the joined members, and the
choice of this node's heir, named in its ledger (I8) and never a leaving or gone node (I12)."""

from __future__ import annotations

from nodeguard.coordination.protocol.core import NodeCore
from nodeguard.coordination.protocol.model import SUCCESSION, Phase
from nodeguard.coordination.records import MemberState, Succession


class Membership(NodeCore):
    """Who is joined, at which epoch, and who inherits from whom."""

    def _epoch_of(self, node: str) -> int:
        """The connection epoch of ``node``, as the census (or the bank's own records) tell."""
        census = self.census
        if census is not None and census.bank == node:
            return census.epoch
        peer = self._peer(node)
        epochs = [peer.member.epoch if peer.member else 0, peer.ledger.epoch if peer.ledger else 0]
        if census is not None and node in census.members:
            epochs.append(census.members[node].epoch)
        if census is not None and node in census.joined:
            epochs.append(census.joined[node])
        return max(epochs)

    def _joined(self) -> list[str]:
        census = self.census
        if census is None:
            return []
        epochs = dict(census.joined)
        epochs.setdefault(census.bank, census.epoch)
        for node, view in census.members.items():
            if view.state is MemberState.JOINED:
                epochs[node] = view.epoch
        out = []
        for node, epoch in epochs.items():
            peer = self._peer(node)
            leaving = peer.ledger is not None and peer.ledger.leaving and peer.ledger.epoch >= epoch
            member = peer.member
            leaving |= member is not None and member.state is not MemberState.JOINED and member.epoch >= epoch
            listed = census.members.get(node)
            if listed is not None and listed.state is not MemberState.JOINED:
                continue
            if node != self.name and peer.gone < epoch and not leaving:
                out.append(node)
        return sorted(out)

    def _repick_heir(self) -> None:
        """Keep a joined heir; else the next joined member after this one (I8: the ledger names it); after it, the
        next joined members, each with the epoch it is named in: the succession (I16)."""
        st = self.state
        if st is None or self.phase is not Phase.ONLINE:
            return
        if self.census is None:
            return  # no view of the members yet: keep the one named
        joined = self._joined()
        heir = st.heir
        if not (st.heir in joined or (not joined and st.heir == self.name)):
            if not joined:
                heir = self.name
            else:
                after = [m for m in joined if m > self.name]
                heir = after[0] if after else joined[0]
        succession: Succession = ()
        if heir != self.name:
            i = joined.index(heir)
            ring = [joined[(i + k) % len(joined)] for k in range(min(SUCCESSION, len(joined)))]
            succession = tuple((node, self._epoch_of(node)) for node in ring)
        if heir == st.heir and succession == st.succession:
            return
        if heir != st.heir:
            self.wants_member = True
            self.counters["heir.changed"] += 1
            self._note("heir", heir=heir)
        st.heir, st.succession = heir, succession
        st.seq += 1
        self.wants_persist = self.wants_ledger = True
        for node, _ in succession:
            self._copies.setdefault(node, False)  # each learns of its ward (it reads its ledger after a will)

    def _successors(self, node: str) -> list[str]:
        """Who may have adopted ``node``'s estate: its heir and the rest of its succession (I8, I16)."""
        peer = self._peer(node)
        names = [self._heir_of(node), *peer.final_succession]
        if peer.ledger is not None and peer.ledger.succession:
            names += [n for n, _ in peer.ledger.succession]
        return [n for n in dict.fromkeys(names) if n and n != node]

    def _heir_of(self, node: str) -> str:
        peer = self._peer(node)
        if peer.final_heir:
            return peer.final_heir
        if peer.ledger is not None and peer.ledger.heir:
            return peer.ledger.heir
        census = self.census
        if census is not None and node in census.members:
            return census.members[node].heir
        return ""
