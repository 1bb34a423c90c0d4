"""The state one protocol node keeps, shared by all its parts, and the effects a step collects for the service.

Who holds the mint (I5) and who this node's heir is (I8) are read here; the parts above change them.
"""

from __future__ import annotations

import math
from collections import Counter, OrderedDict
from typing import Any

from nodeguard.coordination.protocol.model import RETRY, WILL_GRACE, Cluster, Effects, PeerState, Phase
from nodeguard.coordination.records import Census, Saved, SlotLedger


class NodeCore:
    """One node's state: its persisted ledger, its connection, its peers, the bank's queue and what to do next."""

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
        self._estates: dict[str, SlotLedger] = {}  # dead node -> its final ledger, while its succession is unsettled
        self._lost_told: dict[str, int] = {}  # successor -> its ledger seq last answered with this node's lost estates
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

    def _peer(self, node: str) -> PeerState:
        peer = self.peers.get(node)
        if peer is None:
            peer = self.peers[node] = PeerState()
        return peer

    def _adapt(self, saved: Saved) -> Saved:
        saved.leaving = False  # a new process: a member again
        for sem in self.cluster.caps:
            saved.allot.setdefault(sem, 0)
        return saved

    @property
    def _st(self) -> Saved:
        assert self.state is not None
        return self.state

    def _note(self, event: str, **fields: Any) -> None:
        self._fx.notes.append((event, fields))

    def _take(self) -> Effects:
        fx, self._fx = self._fx, Effects()
        for sem in self._via:
            self._via[sem].clear()
            self._freed[sem].clear()
        return fx
