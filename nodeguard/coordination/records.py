"""The records of the coordination protocol: what goes on the wire and on disk (docs/coordination-protocol.md).

Plain immutable data and the node's durable state; the state machine that uses
them is semaphore.py, the JSON codecs are topics.py and store.py.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any


@dataclass(frozen=True)
class Grant:
    """Slots (or the mint) in flight from the donor whose ledger lists it to ``to`` (§3, invariant I2)."""

    id: int
    sem: str
    to: str
    epoch: int  # the recipient's connection epoch; applicable only in it
    n: int
    seq: int  # the donor's ledger seq that created it
    mint: Mapping[str, int] | None = None  # a mint transfer carries the applied caps (§6)


Succession = tuple[tuple[str, int], ...]  # (node, its connection epoch when named), in order: who inherits (I16)


@dataclass(frozen=True)
class Lost:
    """An estate a node lost to ``heir``: its allotments (and mint) as of its ledger ``seq`` (§5)."""

    seq: int
    allot: Mapping[str, int]
    heir: str = ""
    mint: Mapping[str, int] | None = None
    succession: Succession | None = None  # the lost ledger's succession (None: written before there was one)


@dataclass(frozen=True)
class SlotLedger:
    """A node's committed protocol state (retained at ``ledger/<node>``, copies to peers' inboxes)."""

    node: str
    seq: int
    epoch: int
    allot: Mapping[str, int]
    heir: str = ""
    grants: tuple[Grant, ...] = ()
    applied: Mapping[str, frozenset[int]] = field(default_factory=dict)
    adopted: Mapping[str, int] = field(default_factory=dict)
    lost: tuple[Lost, ...] = ()
    mint: Mapping[str, int] | None = None  # held by exactly one node: the bank (I5)
    leaving: bool = False  # draining: send it nothing, pick another heir
    # The heir and the members after it, each with the epoch it was named in (I16); None: a ledger of a version
    # without successions, whose heir alone adopts it.
    succession: Succession | None = None


@dataclass(frozen=True)
class Copy:
    """A ledger sent to one peer's inbox; ``ask``: answer with yours; ``queue``: how many nodes wait at the bank;
    ``forward``: the bank's word to a holder: the next slot it frees goes straight to this node (and epoch)."""

    ledger: SlotLedger
    ask: bool = False
    queue: Mapping[str, int] = field(default_factory=dict)
    forward: Mapping[str, tuple[str, int]] = field(default_factory=dict)  # the bank: whom to pass a freed slot to


@dataclass(frozen=True)
class Want:
    """A node's demand the bank should serve: loads waiting beyond its allotment, per semaphore (§4)."""

    node: str
    epoch: int
    sems: Mapping[str, int]


class MemberState(StrEnum):
    JOINED = "joined"
    LEAVING = "leaving"  # draining: hands its free slots back, admits nothing
    LEFT = "left"  # drained; a held remainder is adopted after its will
    GONE = "gone"  # its will fired (only in a census)


@dataclass(frozen=True)
class Member:
    """A node's membership record (retained at ``member/<node>``), published on join, heir change and leave."""

    node: str
    epoch: int
    state: MemberState
    heir: str


@dataclass(frozen=True)
class MemberView:
    state: MemberState
    heir: str
    allot: Mapping[str, int]
    epoch: int = 0


@dataclass(frozen=True)
class Census:
    """The bank's view: who holds the mint, the applied caps, the members.

    Two forms: the *bank record* (retained at ``bank``, every node subscribes; published when the bank, the caps or
    the membership change) lists the joined members by name only and the others (leaving, left, gone) with their
    view; the *census* (retained at ``census``, read on demand for status) has every member's view with its
    allotments, refreshed once a heartbeat."""

    bank: str
    epoch: int  # the bank's connection epoch
    caps: Mapping[str, int]  # slots in existence per semaphore (the applied caps)
    target: Mapping[str, int]  # the caps configured on the bank (a lowering retires towards them)
    members: Mapping[str, MemberView] = field(default_factory=dict)
    seq: int = 0
    joined: Mapping[str, int] = field(default_factory=dict)  # the bank record: joined members (epoch), no views
    ledger_seq: int = 0  # the bank's ledger seq when it was made: the newer of this and a copy of its ledger wins


@dataclass(frozen=True)
class SemStatus:
    allot: int
    held: int
    waiting: int
    admitted: int


@dataclass(frozen=True)
class NodeStatus:
    """The heartbeat (retained with a Message Expiry at ``status/<node>``): for people and tools."""

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
    """A node's durable protocol state: persisted before any of it is published (I3)."""

    seq: int
    epoch: int
    allot: dict[str, int]
    heir: str = ""
    grants: dict[int, Grant] = field(default_factory=dict)
    applied: dict[str, set[int]] = field(default_factory=dict)
    adopted: dict[str, int] = field(default_factory=dict)
    lost: list[Lost] = field(default_factory=list)
    mint: dict[str, int] | None = None
    next_grant: int = 1
    handled_will: int = 0  # the newest epoch of this node's own will it has acted on
    lost_up_to: int = 0  # the newest ledger seq of this node known to be its heir's
    published: bool = False  # a ledger of this state may be on the broker
    await_heir: bool = False  # back on a broker that may have lost a will: ask the heir before admitting
    leaving: bool = False  # this process is draining (a new process starts as a member again)
    succession: Succession = ()  # the heir first, then who inherits if it is gone too (I16)
    # Claims on estates this node was named for at epochs up to this one have passed on: it came back without a
    # session, so a will of an earlier connection may have fired on a broker that has since forgotten it (I16).
    passed_before: int = 0

    @classmethod
    def from_ledger(cls, ledger: SlotLedger, *, epoch: int, next_grant: int, **extra: Any) -> Saved:
        """A state continuing from ``ledger`` (this node's own, read back from the broker or the state file)."""
        return cls(
            seq=ledger.seq,
            epoch=epoch,
            allot=dict(ledger.allot),
            heir=ledger.heir,
            grants={g.id: g for g in ledger.grants},
            applied={d: set(ids) for d, ids in ledger.applied.items()},
            adopted=dict(ledger.adopted),
            lost=list(ledger.lost),
            mint=None if ledger.mint is None else dict(ledger.mint),
            next_grant=next_grant,
            succession=ledger.succession or (),
            **extra,
        )

    def copy(self) -> Saved:
        return Saved(
            seq=self.seq,
            epoch=self.epoch,
            allot=dict(self.allot),
            heir=self.heir,
            grants=dict(self.grants),
            applied={k: set(v) for k, v in self.applied.items()},
            adopted=dict(self.adopted),
            lost=list(self.lost),
            mint=None if self.mint is None else dict(self.mint),
            next_grant=self.next_grant,
            handled_will=self.handled_will,
            lost_up_to=self.lost_up_to,
            published=self.published,
            await_heir=self.await_heir,
            leaving=self.leaving,
            succession=self.succession,
            passed_before=self.passed_before,
        )

    def ledger(self, node: str) -> SlotLedger:
        return SlotLedger(
            node=node,
            seq=self.seq,
            epoch=self.epoch,
            allot=dict(self.allot),
            heir=self.heir,
            grants=tuple(sorted(self.grants.values(), key=lambda g: g.id)),
            applied={k: frozenset(v) for k, v in sorted(self.applied.items()) if v},
            adopted=dict(sorted(self.adopted.items())),
            lost=tuple(self.lost),
            mint=None if self.mint is None else dict(self.mint),
            leaving=self.leaving,
            succession=self.succession,
        )
