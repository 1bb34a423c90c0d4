"""What the service carries out next: the state to persist, the peers to copy the committed ledger to (I3), the
ledgers to read, the membership record, the bank record and census, and the heartbeat status."""

from __future__ import annotations

import math

from nodeguard.coordination.protocol.model import Phase
from nodeguard.coordination.protocol.recovery import Recovery
from nodeguard.coordination.records import (
    Census,
    Member,
    MemberState,
    MemberView,
    NodeStatus,
    Saved,
    SemStatus,
)


class Outbox(Recovery):
    """The node's output, taken by the service."""

    @property
    def wants_reads(self) -> bool:
        return bool(self._reads)

    @property
    def next_read_at(self) -> float:
        """When the next will grace ends (math.inf: none pending)."""
        return min(self._due_reads.values(), default=math.inf)

    def take_reads(self) -> set[str]:
        """Nodes whose retained ledger must be re-read from the broker."""
        reads, self._reads = self._reads, set()
        return reads

    def snapshot(self) -> Saved | None:
        self.wants_persist = False
        return None if self.state is None else self.state.copy()

    @property
    def may_publish_ledger(self) -> bool:
        return self.phase in (Phase.ONLINE, Phase.WAITING_HEIR) and self.state is not None

    def take_copies(self) -> dict[str, bool]:
        """Peers to send a copy of the committed ledger to (value: ask for theirs)."""
        copies, self._copies = self._copies, {}
        return copies

    @property
    def copies_pending(self) -> bool:
        return bool(self._copies)

    def member(self) -> Member:
        self.wants_member = False
        self.counters["member.published"] += 1
        state = (
            MemberState.LEFT
            if self.leaving and self.drained
            else (MemberState.LEAVING if self.leaving else MemberState.JOINED)
        )
        return Member(self.name, self.epoch, state, self.heir)

    def take_census(self, *, full: bool) -> Census | None:
        """The bank's view: the bank record (``full`` False: joined members by name only) or the census."""
        if full:
            self.census_stale = False
        else:
            self.wants_census = False
        st = self.state
        if st is None or st.mint is None:
            return None
        members: dict[str, MemberView] = {}
        joined: dict[str, int] = {}
        for node, peer in sorted(self.peers.items()):
            if node == self.name:
                continue
            member, ledger = peer.member, peer.ledger
            if member is None and ledger is None:
                continue
            epoch = max(member.epoch if member else 0, ledger.epoch if ledger else 0)
            state = member.state if member is not None else MemberState.JOINED
            if ledger is not None and ledger.leaving and ledger.epoch >= epoch and state is MemberState.JOINED:
                state = MemberState.LEAVING
            if peer.gone >= epoch:
                state = MemberState.GONE
            allot = dict(ledger.allot) if ledger is not None else {}
            gone = state in (MemberState.GONE, MemberState.LEFT) and not any(allot.values())
            if gone and self._adopted_by_heir(node, peer):
                continue  # nothing of it is left anywhere: not a member any more
            heir = ledger.heir if ledger is not None else (member.heir if member else "")
            if state is MemberState.JOINED and not full:
                joined[node] = epoch
            else:
                members[node] = MemberView(state, heir, allot if full else {}, epoch)
        me = MemberView(
            MemberState.LEAVING if self.leaving else MemberState.JOINED, self.heir, dict(st.allot), self.epoch
        )
        members[self.name] = me  # with its heir: who inherits the bank, should it die
        self.census_seq += 1
        census = Census(
            bank=self.name,
            epoch=self.epoch,
            caps=dict(st.mint),
            target=dict(self.cluster.caps),
            members=members,
            seq=self.census_seq,
            joined=joined,
            ledger_seq=st.seq,
        )
        if full:
            self.full_census = census
        return census

    def status(self, version: str = "", wall_ms: int = 0) -> NodeStatus:
        st = self.state
        self.status_seq += 1
        return NodeStatus(
            node=self.name,
            epoch=self.epoch,
            seq=self.status_seq,
            ready=self.phase is Phase.ONLINE and self.admitting,
            phase=self.phase.value if not self.fenced or self.phase is not Phase.ONLINE else "fenced",
            sems={
                s: SemStatus(
                    allot=st.allot.get(s, 0) if st is not None else 0,
                    held=len(self.held[s]),
                    waiting=len(self.waiting[s]),
                    admitted=self.admitted[s],
                )
                for s in self.waiting
            },
            adopted=dict(st.adopted) if st is not None else {},
            version=version,
            heartbeat_ms=wall_ms,
        )
