"""The protocol's vocabulary: a node's configuration and genesis shares (I5, I11), the effects a step hands the
service, the phases of a connection and what a node knows of a peer."""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

from nodeguard.coordination.records import Grant, Member, Saved, SlotLedger

Estate = tuple[Mapping[str, int], Mapping[str, int] | None]  # allotments, and the mint if it held it
WILL_GRACE = 1.0  # seconds an heir waits after a will before reading the dead node's ledger
RETRY = 1.0  # seconds before an unanswered grant or question is sent again (with ask)
GRANT_RETRY = 2  # retries of a grant's copy (an acknowledgement can wait for the recipient's clean-up, 1 s)
SUCCESSION = 3  # members named in a ledger's succession: the heir and who inherits if it is gone too (I16)
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


class Claim(StrEnum):
    """A node's claim on a dead node's estate (I16)."""

    MINE = "mine"  # adopt it now
    WAIT = "wait"  # a member before this one may still adopt it, or its ledger after its will is not read yet
    DONE = "done"  # adopted by someone else, or by nobody this node can stand in for


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
    final_succession: tuple[str, ...] = ()  # who its final ledger names to inherit, in order (I16)
    member: Member | None = None  # its membership record (the bank reads them)
