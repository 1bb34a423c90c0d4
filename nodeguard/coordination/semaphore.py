"""Cluster semaphores: the coordination protocol as state transitions, without I/O.

A semaphore is a named cluster-wide cap ``C`` on loads (``prepare: 8``). Every
node runs a :class:`Node`; the service feeds it messages, connection events and
the clock, and carries out what it asks for (persist, publish, read). Nothing
here touches the network, the disk or the clock, so tests drive it through any
interleaving.

Protocol
--------
*Allotments.* The cap is split into per-node allotments: at genesis node ``i``
of the sorted member list gets ``C // m`` slots plus one of the ``C % m``
remainders (rotated per semaphore). A node admits a load locally while
``held < allotment``; there is no other way to hold a slot.

*Ledger.* Each node owns one retained message, its ledger (``ledger/<node>``,
no expiry): per semaphore its allotment, the grants it has sent and not seen
acknowledged, the grants it has applied (acknowledgements), the estates it has
adopted and the estates it has lost. Only the node writes it; a sequence number
orders its versions. The node persists a state under its state dir *before*
any message shows it.

*Grants.* Nodes publish their demand (held + waiting) in their status. A donor
with spare slots computes the same max-min fair plan as everyone else from its
view (ties go to the members with the fewest admissions; a node with waiting
loads uses the slots it has and hands one on only as it releases it, so slots
rotate without ping-pong), lowers its own allotment, persists, and only then
publishes a ledger listing ``Grant(id, to, epoch=recipient's connection, n)``. The
recipient applies a grant once (keyed by donor and id), only while it is
connected in that epoch, and acknowledges it in its ledger; the donor then
drops it. A grant whose recipient has moved to a later epoch without applying
it, or whose recipient was declared gone, did not apply it in its final ledger
and whose estate its heir has adopted, can no longer be applied by anyone: the
donor takes it back. Slots in
flight belong to nobody, so a lost, duplicated or reordered message can only
leave a slot unused for a while, never count it twice.

*Lease and fencing.* A node may admit only while its lease is valid: the lease
runs ``leaseSeconds`` from the moment it *sent* a message whose PUBACK came
back. The broker publishes a node's Last Will no earlier than ``willDelay``
after the last packet it received from it, and ``leaseSeconds < willDelay``
(with a margin for clock rate and the broker's one-second timer), so a node's
lease has always run out before its will can appear. When the lease runs out
the node revokes every slot it holds and admits nothing (self-fencing). Until
then it keeps admitting within its allotment: a broker outage shorter than the
lease costs nothing.

*Death and heirs.* The will (``gone/<node>``, retained, Will Delay) carries the
epoch of the connection that died. The heir of node ``N`` is fixed: the next
member after ``N`` in the sorted member list. A will grace (``WILL_GRACE``)
after the will, if its connection lasted that long, the heir re-reads ``N``'s
retained ledger from the broker (a fresh subscription and a barrier);
if that ledger is from the dead epoch or earlier, its allotment is ``N``'s
estate and the heir adds it to its own, recording ``adopted[N] = ledger seq``
(idempotent: a second will for the same ledger adopts nothing). A node that
comes back reads its own retained will and ledger before it admits: if a will
for a newer epoch than it has handled is there, it rolls back to exactly that
retained ledger with allotment zero, and lists the estate as ``lost`` until its
heir acknowledges it (the heir adopts ``lost`` entries it has not adopted, so
the estate is adopted exactly once whichever side acts first).

Invariant
---------
For every semaphore, at every instant::

    sum of held  <=  sum of allotments of nodes with a valid lease
                 <=  sum of allotments + grants in flight + estates not yet adopted  <=  C

A grant in flight belongs to nobody: the donor's allotment drops when it is
created, the recipient's rises when it applies it. An estate (the allotment in
a dead node's last ledger) counts until its heir adopts it, then in the heir's.

Why it holds, without ordering between publishers and with lost or duplicated
messages:

1. Conservation. Every transfer is a decrease by one writer followed by an
   increase by another, and the increase is keyed so that it happens at most
   once: grants by (donor, id) and the recipient's epoch, estates by the
   dead node's ledger seq. The donor's decrease is persisted before the grant
   is visible, and a grant is taken back only when the recipient provably
   cannot apply it any more: its epoch is over and a later ledger of it does
   not apply it, or it was declared gone, its final ledger does not apply it
   and its heir has adopted that ledger (which the recipient, when it
   returns, is sure to learn and roll back to). Retained messages and sequence
   numbers make every decision depend on the *latest* committed ledger, never
   on the order in which two publishers' messages arrive.
2. One heir. The heir is a pure function of the member list, so two nodes
   never both adopt ``N``. The amount is read from the broker's retained copy,
   which after the will is ``N``'s last committed ledger: anything ``N`` did
   later was never seen by anyone, and ``N`` rolls back to that same copy.
3. No holder past its lease. A node holds slots only while its lease is valid,
   and its lease ends before its will can be published, so an estate is never
   used by the heir while the dead (or cut-off) node still holds part of it.
4. Wills of live connections. mosquitto publishes every pending will as it
   shuts down, while the connections are still up. A node that sees the will
   of its own connection publishes nothing more on it (an heir reading later
   could otherwise take an older ledger than the last one): it stops admitting
   and rejoins on a new connection. Heirs read only after the will grace on a
   connection that lasted through it, so wills of a broker going down are
   never acted on; after the restart the nodes' question to their heirs finds
   nothing adopted, and they keep their allotments.
5. Broker restarts. Without persistence a restarted broker forgets retained
   messages and wills, so no will can be acted on for the old connections;
   nodes republish their ledgers from their persisted states. A node that was
   fenced and comes back to a broker without its session (possibly restarted)
   cannot see a will that may have been acted on before the restart, so it
   waits for its heir's status on the new broker and rolls back if the heir
   reports having adopted it. That question is written down before every
   connection of a fenced node and stays open across reconnects and restarts
   until the heir answers it.

The persisted state survives a crash of the process; after a restart of the
machine a node distrusts it and continues from its retained ledger, as after a
lost state dir (store.py).

Assumptions: bounded clock-rate drift between node and broker; the broker
honours Will Delay and Session Expiry >= Will Delay, and publishes the will of
a live connection only as it shuts down, dropping every connection within the
will grace; it delivers retained
messages on subscribe and, on one connection, in the order it queued them (the
barrier; the link subscribes with QoS 0, so that nothing queued while offline
can be delivered out of order after a resumed session); it does not drop
messages queued for a connected client (mosquitto: ``max_queued_messages``
large enough), which the barrier's reads rely on; other lost messages only
delay.

Liveness limits (safety is unaffected): an estate waits for its heir, so if a
node and its successor are both gone for good the first one's slots stay
unused; after a broker restart a fenced node waits for its heir to reconnect;
a node whose state dir is lost *and* whose retained ledger is lost (broker
restart) starts from its genesis share, which is safe only on a fresh cluster.
Changing a cap or the member list needs a fresh state on every node.
"""

from __future__ import annotations

import hashlib
import heapq
import json
import math
from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

WILL_GRACE = 1.0  # seconds an heir waits after a will before reading the dead node's ledger


class StateMismatch(ValueError):
    """Persisted state belongs to a different cap or member list for a semaphore."""

    def __init__(self, semaphore: str) -> None:
        self.semaphore = semaphore
        super().__init__(
            f"semaphore {semaphore!r}: the persisted state was made for another cap or member list; "
            "changing either needs a fresh state on every node"
        )


# --- protocol data (on the wire and on disk) ------------------------------------------


@dataclass(frozen=True)
class Grant:
    id: int
    sem: str
    to: str
    epoch: int  # the recipient's connection epoch; applicable only in it
    n: int
    seq: int  # the donor's ledger seq that created it


@dataclass(frozen=True)
class Lost:
    """An estate a node lost to its heir: its allotments as of its ledger ``seq``."""

    seq: int
    allot: Mapping[str, int]


@dataclass(frozen=True)
class Ledger:
    node: str
    seq: int
    epoch: int
    fps: Mapping[str, str]
    allot: Mapping[str, int]
    grants: tuple[Grant, ...] = ()
    applied: Mapping[str, frozenset[int]] = field(default_factory=dict)
    adopted: Mapping[str, int] = field(default_factory=dict)
    lost: tuple[Lost, ...] = ()


@dataclass(frozen=True)
class SemStatus:
    allot: int
    held: int
    waiting: int
    admitted: int


@dataclass(frozen=True)
class Status:
    node: str
    epoch: int
    seq: int
    ready: bool
    phase: str
    sems: Mapping[str, SemStatus]
    adopted: Mapping[str, int] = field(default_factory=dict)
    version: str = ""
    heartbeat_ms: int = 0  # wall clock, for people reading it


@dataclass(frozen=True)
class Gone:
    """A Last Will: the connection of ``node`` in ``epoch`` ended without it."""

    node: str
    epoch: int


@dataclass
class Saved:
    """A node's durable protocol state: persisted before any of it is published."""

    seq: int
    epoch: int
    fps: dict[str, str]
    allot: dict[str, int]
    grants: dict[int, Grant] = field(default_factory=dict)
    applied: dict[str, set[int]] = field(default_factory=dict)
    adopted: dict[str, int] = field(default_factory=dict)
    lost: list[Lost] = field(default_factory=list)
    next_grant: int = 1
    handled_will: int = 0  # the newest epoch of this node's own will it has acted on
    lost_up_to: int = 0  # the newest ledger seq of this node known to be its heir's
    published: bool = False  # a ledger of this state may be on the broker
    await_heir: bool = False  # back on a broker that may have lost a will: ask the heir before admitting

    @classmethod
    def from_ledger(cls, ledger: Ledger, *, epoch: int, next_grant: int, **extra: Any) -> Saved:
        """A state continuing from ``ledger`` (this node's own, read back from the broker or the state file)."""
        return cls(
            seq=ledger.seq,
            epoch=epoch,
            fps=dict(ledger.fps),
            allot=dict(ledger.allot),
            grants={g.id: g for g in ledger.grants},
            applied={d: set(ids) for d, ids in ledger.applied.items()},
            adopted=dict(ledger.adopted),
            lost=list(ledger.lost),
            next_grant=next_grant,
            **extra,
        )

    def copy(self) -> Saved:
        return Saved(
            seq=self.seq,
            epoch=self.epoch,
            fps=dict(self.fps),
            allot=dict(self.allot),
            grants=dict(self.grants),
            applied={k: set(v) for k, v in self.applied.items()},
            adopted=dict(self.adopted),
            lost=list(self.lost),
            next_grant=self.next_grant,
            handled_will=self.handled_will,
            lost_up_to=self.lost_up_to,
            published=self.published,
            await_heir=self.await_heir,
        )

    def ledger(self, node: str) -> Ledger:
        return Ledger(
            node=node,
            seq=self.seq,
            epoch=self.epoch,
            fps=dict(self.fps),
            allot=dict(self.allot),
            grants=tuple(sorted(self.grants.values(), key=lambda g: g.id)),
            applied={k: frozenset(v) for k, v in sorted(self.applied.items()) if v},
            adopted=dict(sorted(self.adopted.items())),
            lost=tuple(self.lost),
        )


# --- the cluster's configuration --------------------------------------------------------


def _digest(*parts: object) -> str:
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()


@dataclass(frozen=True)
class Cluster:
    """Members and caps, identical on every node (their fingerprints are compared)."""

    members: tuple[str, ...]
    caps: Mapping[str, int]
    fps: Mapping[str, str] = field(init=False)

    def __post_init__(self) -> None:
        members = tuple(sorted(self.members))
        if not members or len(set(members)) != len(members):
            raise ValueError("members must be a non-empty list of distinct names")
        if any(cap < 0 for cap in self.caps.values()):
            raise ValueError("caps must be >= 0")
        object.__setattr__(self, "members", members)
        object.__setattr__(self, "caps", dict(self.caps))
        object.__setattr__(self, "fps", {s: _digest(s, c, members)[:16] for s, c in self.caps.items()})

    def heir(self, node: str) -> str:
        i = self.members.index(node)
        return self.members[(i + 1) % len(self.members)]

    def share(self, sem: str, node: str) -> int:
        """The genesis allotment: an even split, remainders rotated per semaphore."""
        m, cap = len(self.members), self.caps[sem]
        offset = int(_digest(sem)[:8], 16) % m
        i = self.members.index(node)
        return cap // m + (1 if (i - offset) % m < cap % m else 0)

    def genesis(self, node: str, epoch: int) -> Saved:
        return Saved(
            seq=1,
            epoch=epoch,
            fps=dict(self.fps),
            allot={s: self.share(s, node) for s in self.caps},
            next_grant=epoch << 20,
        )


def water_fill(capacity: int, demand: Mapping[str, int], rank: Mapping[str, tuple[int, str]]) -> dict[str, int]:
    """Max-min fair targets: one slot at a time to the least served, ties by rank."""
    target = dict.fromkeys(demand, 0)
    heap = [(0, rank[m], m) for m, d in demand.items() if d > 0]
    heapq.heapify(heap)
    while capacity > 0 and heap:
        given, r, m = heapq.heappop(heap)
        target[m] = given + 1
        capacity -= 1
        if given + 1 < demand[m]:
            heapq.heappush(heap, (given + 1, r, m))
    return target


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
class Peer:
    """What this node knows of one member (itself included)."""

    ledger: Ledger | None = None  # the highest seq seen
    latest: Ledger | None = None  # the last one received, and on which connection: the broker's copy
    latest_conn: int = -1
    status: Status | None = None
    status_at: float = -math.inf  # monotonic receipt time
    status_conn: int = -1
    gone: int = -1  # newest will epoch seen
    gone_conn: int = -1
    gone_done: int = -1  # newest will epoch acted on


@dataclass
class _Member:
    allot: int
    held: int
    demand: int
    admitted: int
    pending: int
    epoch: int


class Node:
    """One node's side of the protocol."""

    def __init__(
        self,
        name: str,
        cluster: Cluster,
        saved: Saved | None,
        *,
        lease_seconds: float,
        status_ttl: float,
        will_grace: float = WILL_GRACE,
    ) -> None:
        if name not in cluster.members:
            raise ValueError(f"{name!r} is not a member of the cluster")
        self.name = name
        self.cluster = cluster
        self.heir = cluster.heir(name)
        self.lease_seconds = lease_seconds
        self.status_ttl = status_ttl
        self.will_grace = will_grace
        self.state: Saved | None = None if saved is None else self._adapt(saved.copy())
        self.epoch = saved.epoch if saved is not None else 0
        self.phase = Phase.OFFLINE
        self.fenced = True
        self.fenced_reason = "starting"
        self.lease_until = -math.inf
        self.conn = 0
        self.session_present = False
        self._question_before = False
        self.peers = {m: Peer() for m in cluster.members}
        self.waiting: dict[str, dict[str, None]] = {s: {} for s in cluster.caps}
        self.held: dict[str, set[str]] = {s: set() for s in cluster.caps}
        self.admitted: dict[str, int] = dict.fromkeys(cluster.caps, 0)
        self.counters: Counter[str] = Counter()
        self.status_seq = 0
        # what the service should do next
        self.wants_persist = False
        self.wants_ledger = False  # a change others act on: publish soon
        self.ledger_stale = False  # only clean-up changed: publish with the next heartbeat
        self.wants_status = True
        self.wants_sync = False  # re-read the broker's retained state (a barrier), then call synced()
        self.wants_reconnect = False  # this connection saw its own will: leave it, rejoin on a new one
        self._reads: set[str] = set()
        self._due_reads: dict[str, float] = {}  # dead node -> when its retained ledger is read (will grace)
        self._retract_after: dict[int, int] = {}  # grant id -> the dead recipient's ledger seq its heir must adopt
        self._fx = Effects()
        self._freed: dict[str, list[float]] = {s: [] for s in cluster.caps}
        self._via: dict[str, list[tuple[str, int]]] = {s: [] for s in cluster.caps}

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
        if load in self.waiting[sem]:
            del self.waiting[sem][load]
        elif load in self.held[sem]:
            self.held[sem].discard(load)
            self._freed[sem].append(now)
        else:
            return self._take()
        self.wants_status = True
        self._settle(sem, now)
        return self._take()

    @property
    def admitting(self) -> bool:
        return self.state is not None and not self.fenced

    # --- connection -------------------------------------------------------------------

    def begin_connect(self, wall_ms: int) -> int:
        """The epoch of the next connection (persist before connecting: the will names it)."""
        # Wall time only makes epochs grow across a lost state dir; order comes from max().
        self.epoch = max(self.epoch + 1, wall_ms)
        if self.state is not None:
            self.state.epoch = self.epoch
            self.state.next_grant = max(self.state.next_grant, self.epoch << 20)
            # Pessimistic, and on disk before the connection exists: a crash between finding the broker
            # restarted and writing that down must not let the next start skip the question to the heir.
            self._question_before = self.state.await_heir
            if self.fenced and self.state.published and self.heir != self.name:
                self.state.await_heir = True
            self.wants_persist = True
        return self.epoch

    def connected(self, now: float, session_present: bool) -> Effects:
        self.conn += 1
        self.phase = Phase.SYNCING
        self.session_present = session_present
        self.wants_status = True
        self._reads.clear()
        return self._take()

    def disconnected(self, now: float) -> Effects:
        self.phase = Phase.OFFLINE
        self.wants_sync = self.wants_reconnect = False
        self._reads.clear()
        self._due_reads.clear()  # considered again once back online
        self.wants_status = True
        self._note("disconnected", lease_left=round(max(0.0, self.lease_until - now), 3))
        return self._take()

    def lease_renewed(self, sent_at: float, conn: int, now: float) -> Effects:
        """A message sent at ``sent_at`` on connection ``conn`` was acknowledged by the broker."""
        if conn != self.conn:
            return self._take()
        self.lease_until = max(self.lease_until, sent_at + self.lease_seconds)
        # The broker still had this very connection, so no will was published for it.
        if self.fenced and self.phase is Phase.ONLINE and now < self.lease_until:
            self._unfence(now)
        return self._take()

    def synced(self, now: float) -> Effects:
        """The broker's retained state has been read on this connection: rejoin."""
        if self.phase is not Phase.SYNCING:
            return self._take()
        me = self.peers[self.name]
        own = me.latest if me.latest_conn == self.conn else None
        if own is not None and not self._compatible(own):
            self.counters["ignored.fingerprint"] += 1
            own = None
        if self.state is None:
            self.state = self._recover(own)
        st = self.state
        if me.gone_conn == self.conn and me.gone > st.handled_will:
            # A will of this node the broker still holds: its heir takes (or took) the retained ledger.
            if self.heir != self.name and own is not None and own.epoch <= me.gone:
                self._fence(now, "will")
                self._rollback_exact(own)
            st.handled_will = me.gone
            self.wants_persist = True
        # A broker without this node's session and without its will may have restarted since a will of
        # it was acted on; the question stays open across reconnects and restarts until the heir answers.
        st.await_heir = self.heir != self.name and (
            self._question_before
            or (self.fenced and not self.session_present and me.gone_conn != self.conn and st.published)
        )
        self.wants_persist = True
        if st.await_heir:
            self.phase = Phase.WAITING_HEIR
            self._note("waiting for heir", heir=self.heir)
            self._check_heir(now)
            return self._take()
        self._go_online(now)
        return self._take()

    def tick(self, now: float) -> Effects:
        if not self.fenced and now >= self.lease_until:
            self._fence(now, "lease")
        if self.phase is Phase.ONLINE:
            for node, due in list(self._due_reads.items()):
                if now >= due:
                    del self._due_reads[node]
                    self._reads.add(node)
        if self.phase is Phase.ONLINE and self.state is not None:
            for node in {g.to for g in self.state.grants.values()}:
                self._reconcile(node, now)  # grants whose recipient moved on come back
            if self.admitting:
                self._settle_all(now)
        return self._take()

    # --- messages ---------------------------------------------------------------------

    def on_ledger(self, ledger: Ledger, now: float) -> Effects:
        peer = self.peers.get(ledger.node)
        if peer is None:
            self.counters["ignored.unknown_node"] += 1
            return self._take()
        peer.latest, peer.latest_conn = ledger, self.conn
        if peer.ledger is not None and ledger.seq <= peer.ledger.seq:
            self.counters["ignored.stale"] += 1
            return self._take()
        peer.ledger = ledger
        if self.phase is Phase.ONLINE and ledger.node != self.name:
            self._reconcile(ledger.node, now)
            self._settle_all(now)
        return self._take()

    def on_status(self, status: Status, now: float) -> Effects:
        peer = self.peers.get(status.node)
        if peer is None:
            self.counters["ignored.unknown_node"] += 1
            return self._take()
        if status.node == self.name:
            return self._take()
        old = peer.status
        if old is not None and (status.epoch, status.seq) <= (old.epoch, old.seq):
            self.counters["ignored.stale"] += 1
            return self._take()
        peer.status, peer.status_at, peer.status_conn = status, now, self.conn
        if self.phase is Phase.WAITING_HEIR and status.node == self.heir:
            self._check_heir(now)
        elif self.phase is Phase.ONLINE:
            self._settle_all(now)
        return self._take()

    def on_gone(self, gone: Gone, now: float) -> Effects:
        peer = self.peers.get(gone.node)
        if peer is None:
            self.counters["ignored.unknown_node"] += 1
            return self._take()
        peer.gone_conn = self.conn
        if gone.epoch <= peer.gone:
            return self._take()
        peer.gone = gone.epoch
        if self.phase is not Phase.ONLINE:
            return self._take()
        if gone.node != self.name:
            self._consider_gone(gone.node, now)
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

    def stop(self, now: float) -> Effects:
        """The process is stopping: every slot it holds is revoked, nothing more is admitted."""
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
        """Nodes whose retained ledger must be re-read from the broker (after their will)."""
        reads, self._reads = self._reads, set()
        return reads

    def read_done(self, node: str, ledger: Ledger | None, conn: int, now: float) -> Effects:
        """The broker's retained ledger of ``node`` (``None``: it has none), read on ``conn``."""
        if conn != self.conn or self.phase is not Phase.ONLINE:
            return self._take()  # read again after the next sync
        peer = self.peers[node]
        if ledger is not None:
            peer.latest, peer.latest_conn = ledger, self.conn
        if peer.gone > peer.gone_done:
            if ledger is not None and ledger.epoch <= peer.gone and self._compatible(ledger):
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
        return self.phase is Phase.ONLINE and self.state is not None

    def status(self, version: str = "", wall_ms: int = 0) -> Status:
        st = self.state
        self.status_seq += 1
        return Status(
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

    def _adapt(self, saved: Saved) -> Saved:
        for sem, fp in self.cluster.fps.items():
            if sem in saved.fps and saved.fps[sem] != fp:
                raise StateMismatch(sem)
            if sem not in saved.fps:  # a semaphore added to the config: its genesis share
                saved.fps[sem] = fp
                saved.allot[sem] = self.cluster.share(sem, self.name)
        for sem in [s for s in saved.fps if s not in self.cluster.fps]:
            del saved.fps[sem]
            saved.allot.pop(sem, None)
        return saved

    def _compatible(self, ledger: Ledger) -> bool:
        return all(self.cluster.fps.get(s) in (None, fp) for s, fp in ledger.fps.items())

    def _recover(self, own: Ledger | None) -> Saved:
        """No persisted state: continue from this node's retained ledger, or from genesis."""
        if own is None:
            self._note("genesis")
            self.wants_persist = True
            return self.cluster.genesis(self.name, self.epoch)
        self._note("recovered from the broker", seq=own.seq)
        next_grant = max([self.epoch << 20, *(g.id + 1 for g in own.grants)])
        saved = Saved.from_ledger(own, epoch=self.epoch, next_grant=next_grant, published=True)
        self.wants_persist = True
        return self._adapt(saved)

    def _rollback_exact(self, own: Ledger) -> None:
        """Declared gone: the heir takes ``own`` (the retained ledger); continue from it, empty."""
        st = self._st
        st.allot = dict.fromkeys(self.cluster.caps, 0)
        st.grants = {g.id: g for g in own.grants}
        st.applied = {d: set(ids) for d, ids in own.applied.items()}
        st.adopted = dict(own.adopted)
        st.lost = list(own.lost)
        if any(own.allot.values()):
            st.lost.append(Lost(own.seq, dict(own.allot)))
        st.lost_up_to = max(st.lost_up_to, own.seq)
        st.seq = max(st.seq, own.seq) + 1
        self.wants_persist = self.wants_ledger = True
        self.counters["rollbacks"] += 1
        self._note("rolled back after own will: estate goes to heir", seq=own.seq, estate=dict(own.allot))

    def _rollback_approx(self, seq: int) -> None:
        """The heir adopted ledger ``seq`` on a broker that is gone: drop what came after it."""
        st = self._st
        st.allot = dict.fromkeys(self.cluster.caps, 0)
        st.grants = {i: g for i, g in st.grants.items() if g.seq <= seq}
        st.lost_up_to = seq
        st.seq += 1
        self.wants_persist = self.wants_ledger = True
        self.counters["rollbacks"] += 1
        self._note("rolled back: heir reports adoption", seq=seq)

    def _check_heir(self, now: float) -> None:
        peer = self.peers[self.heir]
        if peer.status is None or peer.status_conn != self.conn:
            return
        adopted = peer.status.adopted.get(self.name, 0)
        if adopted > self._st.lost_up_to:
            self._rollback_approx(adopted)
        self._st.await_heir = False
        self.wants_persist = True
        self._go_online(now)

    def _will_of_this_connection(self, now: float) -> None:
        """The broker published the will of the connection we are on: it does so for live connections only as it
        shuts down (mosquitto sends every pending will then). Nothing more may go out on this connection, or an
        heir could take a ledger older than our last one: stop admitting and rejoin on a new connection, where
        the retained will (if the broker kept it) or the heir (if it did not) says what was taken."""
        self.counters["own_will_on_this_connection"] += 1
        self._fence(now, "will")
        self.phase = Phase.SYNCING
        self.wants_sync = False
        self.wants_reconnect = True
        self._note("own will on this connection: rejoining on a new one", epoch=self.epoch)

    def _go_online(self, now: float) -> None:
        if self.peers[self.name].gone >= self.epoch:
            self._will_of_this_connection(now)
            return
        self.phase = Phase.ONLINE
        st = self._st
        st.published = True
        st.seq += 1  # the first ledger of a new epoch must supersede every earlier one
        self.wants_persist = self.wants_ledger = self.wants_status = True
        if self.fenced and now < self.lease_until:
            self._unfence(now)
        for node in self.peers:
            if node != self.name:
                self._reconcile(node, now)
                self._consider_gone(node, now)
        self._settle_all(now)

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

    # --- internals: reconciling with peers ---------------------------------------------------

    @property
    def _st(self) -> Saved:
        assert self.state is not None
        return self.state

    def _consider_gone(self, node: str, now: float) -> None:
        peer = self.peers[node]
        if peer.gone <= peer.gone_done:
            return
        stake = self.cluster.heir(node) == self.name or any(g.to == node for g in self._st.grants.values())
        if stake:
            # Read after the will grace, on a connection that lasted through it: a broker shutting down publishes
            # the wills of live nodes and then drops every connection, so such wills are never acted on.
            self._due_reads.setdefault(node, now + self.will_grace)
        else:
            peer.gone_done = peer.gone

    def _estate(self, node: str, final: Ledger, gone_epoch: int) -> None:
        """``node``'s will for ``gone_epoch`` is out and ``final`` is its last ledger."""
        st = self._st
        done = st.adopted.get(node, 0)
        if self.cluster.heir(node) == self.name and final.seq > done:
            estates = [final.allot, *(lost.allot for lost in final.lost if lost.seq > done)]
            self._adopt(node, final.seq, estates, final.fps)
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
        heir = self.cluster.heir(node)
        if heir == self.name:
            adopted = self._st.adopted.get(node, 0)
        else:
            ledger = self.peers[heir].ledger
            adopted = ledger.adopted.get(node, 0) if ledger is not None else 0
        for grant_id, seq in list(self._retract_after.items()):
            grant = self._st.grants.get(grant_id)
            if grant is None:
                del self._retract_after[grant_id]
            elif grant.to == node and seq <= adopted:
                del self._retract_after[grant_id]
                self._retract(grant, "recipient gone, estate adopted")

    def _adopt(self, node: str, seq: int, estates: Iterable[Mapping[str, int]], fps: Mapping[str, str]) -> None:
        st = self._st
        gained: Counter[str] = Counter()
        for estate in estates:
            for sem, n in estate.items():
                if sem in st.allot and fps.get(sem) == self.cluster.fps[sem] and n > 0:
                    gained[sem] += n
                elif n:
                    self.counters["ignored.foreign_estate"] += 1
        for sem, n in gained.items():
            st.allot[sem] += n
        st.adopted[node] = seq
        st.seq += 1
        self.wants_persist = self.wants_ledger = self.wants_status = True
        self.counters["adoptions"] += 1
        self._note("adopted estate", of=node, seq=seq, slots=dict(gained))

    def _retract(self, grant: Grant, why: str) -> None:
        st = self._st
        del st.grants[grant.id]
        if grant.sem in st.allot:
            st.allot[grant.sem] += grant.n
        st.seq += 1
        self.wants_persist = self.wants_ledger = True
        self.counters["grants.retracted"] += 1
        self._note("took grant back", to=grant.to, id=grant.id, n=grant.n, why=why)

    def _reconcile(self, node: str, now: float) -> None:
        """Act on ``node``'s newest ledger: grants to this node, acks, estates."""
        ledger = self.peers[node].ledger
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
                continue  # a grant to an earlier connection: its donor takes it back
            if grant.sem not in st.allot or ledger.fps.get(grant.sem) != self.cluster.fps[grant.sem] or grant.n <= 0:
                self.counters["ignored.bad_grant"] += 1
                continue
            st.allot[grant.sem] += grant.n
            st.applied.setdefault(node, set()).add(grant.id)
            st.seq += 1
            self._via[grant.sem].append((node, grant.id))
            # The acknowledgement only lets the donor forget the grant: it can wait for the heartbeat.
            self.wants_persist = self.ledger_stale = True
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
                st.seq += 1
                self.wants_persist = self.ledger_stale = True
                self.counters["grants.acknowledged"] += 1
            elif ledger.epoch > grant.epoch:
                self._retract(grant, "recipient moved on")
        # Estates ``node`` lost to this node.
        if self.cluster.heir(node) == self.name:
            done = st.adopted.get(node, 0)
            fresh = [lost for lost in ledger.lost if lost.seq > done]
            if fresh:
                self._adopt(node, max(lost.seq for lost in fresh), [lost.allot for lost in fresh], ledger.fps)
        # Grants to members that ``node`` is the heir of, waiting for its adoption.
        for dead in {g.to for i, g in st.grants.items() if i in self._retract_after}:
            if self.cluster.heir(dead) == node:
                self._retract_adopted(dead)
        # This node's lost estates its heir has adopted.
        if node == self.heir:
            upto = ledger.adopted.get(self.name, 0)
            if any(lost.seq <= upto for lost in st.lost):
                st.lost = [lost for lost in st.lost if lost.seq > upto]
                st.seq += 1
                self.wants_persist = self.ledger_stale = True

    # --- internals: admission and donation ---------------------------------------------------

    def _settle_all(self, now: float) -> None:
        for sem in self.waiting:
            self._settle(sem, now)

    def _settle(self, sem: str, now: float) -> None:
        st = self.state
        if st is None or self.fenced or st.allot[sem] <= len(self.held[sem]):
            return  # no spare slot: nothing to admit and nothing to give
        # A node with waiting loads uses the slots it has; it hands one on only as it releases it
        # (that is where fairness rotates slots): re-planning every received slot made them ping-pong.
        if self.phase is Phase.ONLINE and (not self.waiting[sem] or self._freed[sem]):
            self._donate(sem, now)
        waiting, held = self.waiting[sem], self.held[sem]
        while waiting and len(held) < st.allot[sem]:
            load = next(iter(waiting))
            del waiting[load]
            held.add(load)
            self.admitted[sem] += 1
            via = self._via[sem].pop(0) if self._via[sem] else None
            self._fx.admitted.append(Admitted(sem, load, via))
            self.counters["admitted"] += 1

    def _members(self, sem: str, now: float) -> dict[str, _Member]:
        st = self._st
        fp = self.cluster.fps[sem]
        held = len(self.held[sem])
        view = {
            self.name: _Member(
                allot=st.allot[sem],
                held=held,
                demand=held + len(self.waiting[sem]),
                admitted=self.admitted[sem],
                pending=0,
                epoch=self.epoch,
            )
        }
        # Grants of this semaphore in flight, by recipient: (donor, grant).
        in_flight: dict[str, list[tuple[str, Grant]]] = {}
        for donor, peer in self.peers.items():
            grants = st.grants.values() if donor == self.name else (peer.ledger.grants if peer.ledger else ())
            for g in grants:
                if g.sem == sem:
                    in_flight.setdefault(g.to, []).append((donor, g))
        for node, peer in self.peers.items():
            status = peer.status
            if node == self.name or status is None or not status.ready:
                continue
            if now - peer.status_at > self.status_ttl or peer.gone >= status.epoch:
                continue
            if peer.ledger is not None and peer.ledger.epoch > status.epoch:
                continue  # its status lags its ledger: a grant now would go to a connection already over
            sem_status = status.sems.get(sem)
            if sem_status is None:
                continue
            ledger = peer.ledger
            if ledger is not None and ledger.epoch == status.epoch and ledger.fps.get(sem) == fp:
                allot, applied, mine_only = ledger.allot.get(sem, 0), ledger.applied, False
            else:  # no ledger of this epoch yet: only this node's own grants are known to be pending
                allot, applied, mine_only = sem_status.allot, {}, True
            pending = sum(
                g.n
                for donor, g in in_flight.get(node, ())
                if g.epoch == status.epoch
                and (donor == self.name or not mine_only)
                and g.id not in applied.get(donor, ())
            )
            view[node] = _Member(
                allot=allot,
                held=sem_status.held,
                demand=sem_status.held + sem_status.waiting,
                admitted=sem_status.admitted,
                pending=pending,
                epoch=status.epoch,
            )
        return view

    def _donate(self, sem: str, now: float) -> None:
        """Give spare slots to members below their fair share, as every donor plans it."""
        view = self._members(sem, now)
        if len(view) < 2:
            return
        rank = {m: (v.admitted, m) for m, v in view.items()}
        capacity = sum(v.allot + v.pending for v in view.values())
        target = water_fill(capacity, {m: v.demand for m, v in view.items()}, rank)
        surplus = {m: v.allot - max(target[m], v.held) for m, v in view.items()}
        if surplus[self.name] <= 0:
            return
        order = sorted((m for m, v in view.items() if target[m] - v.allot - v.pending > 0), key=rank.__getitem__)
        needs = [target[m] - view[m].allot - view[m].pending for m in order]
        i = 0
        for donor in sorted(m for m in view if surplus[m] > 0):
            give = surplus[donor]
            while give > 0 and i < len(order):
                n = min(give, needs[i])
                if donor == self.name:
                    self._grant(sem, order[i], n, view[order[i]].epoch)
                give -= n
                needs[i] -= n
                if needs[i] == 0:
                    i += 1
            if donor == self.name:
                return

    def _grant(self, sem: str, to: str, n: int, epoch: int) -> None:
        st = self._st
        st.allot[sem] -= n
        st.seq += 1
        grant = Grant(id=st.next_grant, sem=sem, to=to, epoch=epoch, n=n, seq=st.seq)
        st.next_grant += 1
        st.grants[grant.id] = grant
        freed = self._freed[sem].pop(0) if self._freed[sem] else None
        self._fx.donated.append(Donated(grant, freed))
        # Others read allotments from ledgers; a status is for demand and phase changes.
        self.wants_persist = self.wants_ledger = True
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
