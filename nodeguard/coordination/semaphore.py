"""Cluster semaphores: the coordination protocol as state transitions, without I/O.

The specification, its numbered invariants (I1 ...) and the proof that the cap
holds are in docs/coordination-protocol.md; comments here cite them. Every
node runs a :class:`ProtocolNode`; the service (service.py) feeds it messages,
connection events and the clock, and carries out what it asks for (persist,
publish, send copies, read retained ledgers). Nothing here touches the network,
the disk or the clock, so tests drive it through any interleaving
(tests/coordination/sim.py).
"""

from __future__ import annotations

import hashlib
import json
import math
from collections import Counter, OrderedDict
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

from nodeguard.coordination.records import (
    Census,
    Copy,
    Gone,
    Grant,
    Lost,
    Member,
    MemberState,
    MemberView,
    NodeStatus,
    Saved,
    SemStatus,
    SlotLedger,
    Want,
)

Estate = tuple[Mapping[str, int], Mapping[str, int] | None]  # allotments, and the mint if it held it
WILL_GRACE = 1.0  # seconds an heir waits after a will before reading the dead node's ledger
RETRY = 1.0  # seconds before an unanswered grant or question is sent again (with ask)
GRANT_RETRY = 2  # retries of a grant's copy (an acknowledgement can wait for the recipient's clean-up, 1 s)
WANT_RETRY = 5  # retries of a node's demand to the bank (lost only with a connection, which resends it anyway)


def _digest(*parts: object) -> str:
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()


@dataclass(frozen=True)
class Cluster:
    """This node's configuration: the seeds (genesis holders) and the caps it is configured with."""

    seeds: tuple[str, ...]
    caps: Mapping[str, int]

    def __post_init__(self) -> None:
        seeds = tuple(sorted(self.seeds))
        if not seeds or len(set(seeds)) != len(seeds):
            raise ValueError("seeds must be a non-empty list of distinct names")
        if any(cap < 0 for cap in self.caps.values()):
            raise ValueError("caps must be >= 0")
        object.__setattr__(self, "seeds", seeds)
        object.__setattr__(self, "caps", dict(self.caps))

    @property
    def first_seed(self) -> str:
        return self.seeds[0]

    def share(self, sem: str, node: str) -> int:
        """The genesis allotment of a seed: an even split, remainders rotated per semaphore (I11)."""
        m, cap = len(self.seeds), self.caps[sem]
        offset = int(_digest(sem)[:8], 16) % m
        i = self.seeds.index(node)
        return cap // m + (1 if (i - offset) % m < cap % m else 0)

    def genesis(self, node: str, epoch: int) -> Saved:
        """A seed's first state; the first seed also holds the mint with every cap (I5, I11)."""
        return Saved(
            seq=1,
            epoch=epoch,
            allot={s: self.share(s, node) for s in self.caps},
            heir=node,
            mint=dict(self.caps) if node == self.first_seed else None,
            next_grant=epoch << 20,
        )

    def empty(self, node: str, epoch: int) -> Saved:
        """A joining node's first state: no slots; it gets them by grants (I11)."""
        return Saved(seq=1, epoch=epoch, allot=dict.fromkeys(self.caps, 0), heir=node, next_grant=epoch << 20)


# --- effects ----------------------------------------------------------------------------


@dataclass(frozen=True)
class Admitted:
    sem: str
    load: str
    via: tuple[str, int] | None = None  # the grant (donor, id) applied in the same step, if any


@dataclass(frozen=True)
class Revoked:
    sem: str
    load: str


@dataclass(frozen=True)
class Donated:
    grant: Grant
    freed_at: float | None  # when the donated slot was released here, if in the same step
    via: tuple[str, int] | None = None  # the grant this slot arrived by, if passed straight on (the bank)


@dataclass
class Effects:
    admitted: list[Admitted] = field(default_factory=list)
    revoked: list[Revoked] = field(default_factory=list)
    donated: list[Donated] = field(default_factory=list)
    notes: list[tuple[str, dict[str, Any]]] = field(default_factory=list)


class Phase(StrEnum):
    OFFLINE = "offline"  # no connection (admits within the lease)
    SYNCING = "syncing"  # connected, reading the broker's retained state
    WAITING_HEIR = "waiting-heir"  # fenced, back on a broker without its session: waits for its heir
    ONLINE = "online"


@dataclass
class PeerState:
    """What this node knows of another node (or itself)."""

    ledger: SlotLedger | None = None  # the highest seq seen
    latest: SlotLedger | None = None  # the last one received, and on which connection: the broker's copy
    latest_conn: int = -1
    copy_conn: int = -1  # the connection on which a copy from it last arrived
    gone: int = -1  # newest will epoch seen
    gone_conn: int = -1
    gone_done: int = -1  # newest will epoch acted on
    final_heir: str = ""  # the heir its final ledger names (after its will)
    member: Member | None = None  # its membership record (the bank reads them)


class ProtocolNode:
    """One node's side of the protocol."""

    def __init__(
        self,
        name: str,
        cluster: Cluster,
        saved: Saved | None,
        *,
        lease_seconds: float,
        will_grace: float = WILL_GRACE,
        retry: float = RETRY,
    ) -> None:
        self.name = name
        self.cluster = cluster
        self.lease_seconds = lease_seconds
        self.will_grace = will_grace
        self.retry = retry
        self.state: Saved | None = None if saved is None else self._adapt(saved.copy())
        self.epoch = saved.epoch if saved is not None else 0
        self.phase = Phase.OFFLINE
        self.fenced = True
        self.fenced_reason = "starting"
        self.leaving = False
        self.lease_until = -math.inf
        self.conn = 0
        self.session_present = False
        self._question_before = False
        self.peers: dict[str, PeerState] = {}
        self.census: Census | None = None  # the bank record (subscribed)
        self.full_census: Census | None = None  # the last census read (status)
        self.waiting: dict[str, dict[str, None]] = {s: {} for s in cluster.caps}
        self.held: dict[str, set[str]] = {s: set() for s in cluster.caps}
        self.admitted: dict[str, int] = dict.fromkeys(cluster.caps, 0)
        self.counters: Counter[str] = Counter()
        self.status_seq = 0
        self.census_seq = 0
        # what the service should do next
        self.wants_persist = False
        self.wants_ledger = False  # a change others act on: publish soon
        self.ledger_stale = False  # only clean-up changed: publish with the next heartbeat
        self.wants_status = True
        self.wants_member = False  # publish the membership record
        self.wants_census = False  # the bank: membership, mint or caps changed: publish the bank record soon
        self.census_stale = False  # the bank: allotments changed, publish the census with the next period
        self.wants_sync = False  # re-read the broker's retained state (a barrier), then call synced()
        self.wants_reconnect = False  # this connection saw its own will: leave it, rejoin on a new one
        self._copies: dict[str, bool] = {}  # peer -> ask: send it a copy of the next committed ledger
        self._reads: set[str] = set()
        self._due_reads: dict[str, float] = {}  # dead node -> when its retained ledger is read (will grace)
        self._retract_after: dict[int, int] = {}  # grant id -> the dead recipient's ledger seq its heir must adopt
        self._sent_at: dict[int, float] = {}  # grant id -> when its copy last went out
        self._polled_at = -math.inf
        self._asked_at = -math.inf
        # demand (non-bank) and the bank's queue
        self.contended: dict[str, bool] = {}
        self._demand: dict[str, int] = {}
        self._want_sent: tuple[str, dict[str, int]] | None = None
        self._want_at = -math.inf
        self.queue: dict[str, OrderedDict[str, tuple[int, int]]] = {}
        self._told: dict[str, dict[str, bool]] = {}  # holder -> sem -> contention it was last told of
        self._contended: dict[str, bool] = {}  # sem -> others wait at the bank
        self.forward: dict[str, tuple[str, int]] = {}  # a holder: sem -> whom the bank said its next freed slot is for
        # the bank: sem -> holder -> (promised node, its epoch, the holder's newest grant id when promised)
        self._promised: dict[str, dict[str, tuple[str, int, int]]] = {}
        self._holders: dict[str, set[str]] = {}  # the bank: sem -> nodes whose ledgers show slots
        self._newest_grant: dict[str, int] = {}  # the bank: node -> the highest grant id seen in its ledgers
        self._fx = Effects()
        self._freed: dict[str, list[float]] = {s: [] for s in cluster.caps}
        self._via: dict[str, list[tuple[str, int]]] = {s: [] for s in cluster.caps}
        self._inbound: dict[str, list[tuple[str, int]]] = {}  # the bank: grants whose slots it passes on

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
        """A load stops waiting or gives its slot back."""
        if load in self.waiting.get(sem, {}):
            del self.waiting[sem][load]
        elif load in self.held.get(sem, set()):
            self.held[sem].discard(load)
            self._freed[sem].append(now)
        else:
            return self._take()
        self.wants_status = True
        self._settle(sem, now)
        return self._take()

    @property
    def admitting(self) -> bool:
        return self.state is not None and not self.fenced and not self.leaving

    @property
    def heir(self) -> str:
        return self.state.heir if self.state is not None and self.state.heir else self.name

    @property
    def is_bank(self) -> bool:
        return self.state is not None and self.state.mint is not None

    @property
    def bank(self) -> str | None:
        """Who holds the mint, as far as this node knows (None: unknown, or its holder is gone)."""
        if self.is_bank:
            return self.name
        census = self.census
        if census is None or census.bank == self.name or self._peer(census.bank).gone >= census.epoch:
            return None
        return census.bank

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
        if not self.fenced and now >= self.lease_until:
            self._fence(now, "lease")
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

    # --- messages ---------------------------------------------------------------------

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
        if self.phase is Phase.WAITING_HEIR and copy is not None and ledger.node == self.heir:
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
            if gone.node == self.heir:
                self._repick_heir()
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

    def drain(self, now: float) -> Effects:
        """Leaving (SIGTERM): admit nothing more, take the held slots back (the gate stops with the daemon) and hand
        the whole allotment, and the mint, on at once (I12); the service waits for the acknowledgements."""
        st = self.state
        self.leaving = True
        self._fence(now, "stopping")
        if st is not None:
            st.leaving = True
            st.seq += 1
            self.wants_persist = self.wants_ledger = True
        self.wants_member = self.wants_status = True
        for sem in self.waiting:
            self.waiting[sem].clear()
        self._drain_spare()
        return self._take()

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

    def stop(self, now: float) -> Effects:
        """The process is stopping: every slot it holds is revoked, nothing more is admitted."""
        self.leaving = True
        self._fence(now, "stopping")
        return self._take()

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

    def read_done(self, node: str, ledger: SlotLedger | None, conn: int, now: float) -> Effects:
        """The broker's retained ledger of ``node`` (``None``: it has none), read on ``conn``."""
        if conn != self.conn or self.phase is not Phase.ONLINE:
            return self._take()  # read again after the next sync
        peer = self._peer(node)
        if ledger is not None:
            peer.latest, peer.latest_conn = ledger, self.conn
        if peer.gone > peer.gone_done:
            if ledger is not None and ledger.epoch <= peer.gone:
                self._estate(node, ledger, peer.gone)
            peer.gone_done = peer.gone
        if ledger is not None and (peer.ledger is None or ledger.seq > peer.ledger.seq):
            peer.ledger = ledger
            self._reconcile(node, now)
        self._settle_all(now)
        return self._take()

    # --- output -----------------------------------------------------------------------

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

    # --- internals: rejoin --------------------------------------------------------------

    def _peer(self, node: str) -> PeerState:
        peer = self.peers.get(node)
        if peer is None:
            peer = self.peers[node] = PeerState()
        return peer

    def _has_estate(self) -> bool:
        st = self.state
        return st is not None and st.published and (any(st.allot.values()) or st.mint is not None)

    def _adapt(self, saved: Saved) -> Saved:
        saved.leaving = False  # a new process: a member again
        for sem in self.cluster.caps:
            saved.allot.setdefault(sem, 0)
        return saved

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
            st.lost.append(Lost(own.seq, dict(own.allot), own.heir, None if own.mint is None else dict(own.mint)))
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

    def _ask_heir(self, now: float) -> None:
        self._asked_at = now
        self._copies[self.heir] = True

    def _check_heir(self, now: float) -> None:
        peer = self._peer(self.heir)
        if peer.ledger is None or peer.copy_conn != self.conn:
            return
        adopted = peer.ledger.adopted.get(self.name, 0)
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

    # --- internals: membership ---------------------------------------------------------------

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
        """Keep a joined heir; else the next joined member after this one (I8: the ledger names it)."""
        st = self.state
        if st is None or self.phase is not Phase.ONLINE:
            return
        if self.census is None:
            return  # no view of the members yet: keep the one named
        joined = self._joined()
        if st.heir in joined or (not joined and st.heir == self.name):
            return
        if not joined:
            heir = self.name
        else:
            after = [m for m in joined if m > self.name]
            heir = after[0] if after else joined[0]
        if heir == st.heir:
            return
        st.heir = heir
        st.seq += 1
        self.wants_persist = self.wants_ledger = self.wants_member = True
        if heir != self.name:
            self._copies.setdefault(heir, False)  # the heir learns of its ward (it reads its ledger after a will)
        self.counters["heir.changed"] += 1
        self._note("heir", heir=heir)

    # --- internals: reconciling with peers ---------------------------------------------------

    @property
    def _st(self) -> Saved:
        assert self.state is not None
        return self.state

    def _known(self, sem: str) -> bool:
        census = self.census
        return sem in self.cluster.caps or sem in self._st.allot or (census is not None and sem in census.caps)

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

    def _consider_gone(self, node: str, now: float) -> None:
        peer = self._peer(node)
        if peer.gone <= peer.gone_done or self.state is None:
            return
        stake = (
            self.is_bank or self._heir_of(node) == self.name or any(g.to == node for g in self.state.grants.values())
        )
        if stake:
            # Read after the will grace, on a connection that lasted through it: a broker shutting down publishes
            # the wills of live nodes and then drops every connection, so such wills are never acted on (I9).
            self._due_reads.setdefault(node, now + self.will_grace)

    def _estate(self, node: str, final: SlotLedger, gone_epoch: int) -> None:
        """``node``'s will for ``gone_epoch`` is out and ``final`` is its last ledger (I8)."""
        st = self._st
        peer = self._peer(node)
        peer.final_heir = final.heir
        done = st.adopted.get(node, 0)
        if final.heir == self.name and final.seq > done:
            estates = [(final.allot, final.mint)]
            estates += [(lost.allot, lost.mint) for lost in final.lost if lost.seq > done and lost.heir == self.name]
            self._adopt(node, final.seq, estates)
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

    def _retract_adopted(self, node: str) -> None:
        """Take back the grants to ``node`` waiting for its heir's adoption, if the heir has adopted."""
        if not self._retract_after:
            return
        heir = self._heir_of(node)
        if heir == self.name:
            adopted = self._st.adopted.get(node, 0)
        else:
            ledger = self._peer(heir).ledger if heir else None
            adopted = ledger.adopted.get(node, 0) if ledger is not None else 0
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
        fresh = [lost for lost in ledger.lost if lost.seq > done and lost.heir == self.name]
        if fresh:
            self._adopt(node, max(lost.seq for lost in fresh), [(lost.allot, lost.mint) for lost in fresh])
            self._copies[node] = False  # it drops them once it sees the adoption
        # Grants to nodes that ``node`` is the heir of, waiting for its adoption.
        for dead in {g.to for i, g in st.grants.items() if i in self._retract_after}:
            if self._heir_of(dead) == node:
                self._retract_adopted(dead)
        # This node's lost estates that ``node`` (their heir) has adopted.
        upto = ledger.adopted.get(self.name, 0)
        if any(lost.heir == node and lost.seq <= upto for lost in st.lost):
            st.lost = [lost for lost in st.lost if not (lost.heir == node and lost.seq <= upto)]
            st.seq += 1
            self.wants_persist = self.ledger_stale = True
        if any(lost.heir == node for lost in st.lost):
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
            for lost in st.lost:  # ask the heir, and read its retained ledger (it may have left since)
                if lost.heir and lost.heir != self.name:
                    self._copies.setdefault(lost.heir, True)
                    self._reads.add(lost.heir)
        if self._retract_after and now - self._polled_at >= self.retry:
            for dead in {g.to for i, g in st.grants.items() if i in self._retract_after}:
                heir = self._heir_of(dead)
                if heir and heir != self.name:
                    self._reads.add(heir)
        if now - self._polled_at >= self.retry:
            self._polled_at = now
            if self.leaving:
                self.wants_member = True  # until it is gone: whoever missed it must not name it heir
        if any(self._demand.values()) and now - self._want_at >= WANT_RETRY * self.retry and self._want_sent:
            self._want_sent = None  # unanswered: say it again

    # --- internals: admission, demand and the bank -------------------------------------------

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

    def _settle_all(self, now: float) -> None:
        if self.state is None:
            return
        if self.is_bank:
            self._mint_adjust_all()
        for sem in sorted(set(self.state.allot) | set(self.waiting)):
            self._settle(sem, now)

    def _admit(self, sem: str) -> None:
        load = next(iter(self.waiting[sem]))
        del self.waiting[sem][load]
        self.held[sem].add(load)
        self.admitted[sem] += 1
        via = self._via[sem].pop(0) if self._via.get(sem) else None
        self._fx.admitted.append(Admitted(sem, load, via))
        self.counters["admitted"] += 1

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

    def _adopted_by_heir(self, node: str, peer: PeerState) -> bool:
        ledger = peer.ledger
        if ledger is None:
            return True
        heir = self._heir_of(node)
        if heir == self.name:
            return self._st.adopted.get(node, 0) >= ledger.seq
        heir_ledger = self._peer(heir).ledger if heir else None
        return heir_ledger is not None and heir_ledger.adopted.get(node, 0) >= ledger.seq

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

    # --- internals: effects ----------------------------------------------------------------

    def _note(self, event: str, **fields: Any) -> None:
        self._fx.notes.append((event, fields))

    def _take(self) -> Effects:
        fx, self._fx = self._fx, Effects()
        for sem in self._via:
            self._via[sem].clear()
            self._freed[sem].clear()
        return fx
