"""Topic names and payloads of the coordination protocol: versioned JSON, parsed defensively.

Under ``nodeguard/<cluster>/`` (docs/coordination-protocol.md, §2):

``ledger/<node>``  retained, no expiry: the node's committed protocol state. Read by the
                   node itself when it (re)connects, by the bank (subscribed to all), and
                   on demand by an heir after a will.
``inbox/<node>``   not retained: messages to one node: ledger copies (grants, acknowledgements,
                   estates, questions) and demands (to the bank).
``member/<node>``  retained: the node's membership record (joined, leaving, left).
``bank``           retained: the bank record: who holds the mint, the applied caps, the joined members
                   by name, the others with state and heir (every node subscribes; it changes with
                   the membership, not with admissions).
``census``         retained: the bank's full view with every member's allotment, once a heartbeat;
                   read on demand (status, metrics).
``gone/<node>``    retained Last Will (with Will Delay): ``{"node", "epoch"}``.
``status/<node>``  retained, with a Message Expiry: the heartbeat (renews the lease); for people.
``sync/<node>``    not retained: the node's own barrier messages.

Every payload is a JSON object with ``"v": 2`` and a ``"kind"``. A decoder raises
:class:`Malformed` (or :class:`UnknownVersion`) and never anything else, so a bad
message is counted and ignored by the caller.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

from nodeguard.coordination.names import valid_name
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
    SemStatus,
    SlotLedger,
    Succession,
    Want,
)

VERSION = 2
ROOT = "nodeguard"
MAX_PAYLOAD = 1 << 20
MAX_ITEMS = 100_000
KINDS = ("status", "ledger", "gone", "sync", "inbox", "member")


class Malformed(ValueError):
    """A payload that does not follow the protocol."""


class UnknownVersion(Malformed):
    """A payload of a protocol version this node does not speak."""


class Topics:
    def __init__(self, cluster: str) -> None:
        if not valid_name(cluster):
            raise ValueError(f"invalid cluster name {cluster!r}")
        self.prefix = f"{ROOT}/{cluster}"

    def status(self, node: str) -> str:
        return f"{self.prefix}/status/{node}"

    def ledger(self, node: str) -> str:
        return f"{self.prefix}/ledger/{node}"

    def gone(self, node: str) -> str:
        return f"{self.prefix}/gone/{node}"

    def sync(self, node: str) -> str:
        return f"{self.prefix}/sync/{node}"

    def inbox(self, node: str) -> str:
        return f"{self.prefix}/inbox/{node}"

    def member(self, node: str) -> str:
        return f"{self.prefix}/member/{node}"

    @property
    def census(self) -> str:
        return f"{self.prefix}/census"

    @property
    def bank(self) -> str:
        return f"{self.prefix}/bank"

    def subscriptions(self, node: str) -> list[str]:
        """Every node's: its inbox, the wills and the bank record; nothing that grows with admissions. (Its own
        retained ledger is read when it connects, the census on demand.)"""
        return [self.inbox(node), f"{self.prefix}/gone/+", self.bank, self.sync(node)]

    def bank_subscriptions(self) -> list[str]:
        """The bank's, besides (with No Local): every other node's ledger and membership record (one delivery per
        ledger, not one per node)."""
        return [f"{self.prefix}/ledger/+", f"{self.prefix}/member/+"]

    def parse(self, topic: str) -> tuple[str, str] | None:
        """``(kind, node)`` of a topic of this cluster (``("census", "")`` for the census), or ``None``."""
        head, sep, rest = topic.partition(self.prefix + "/")
        if head or not sep:
            return None
        if rest in ("census", "bank"):
            return rest, ""
        kind, sep, node = rest.partition("/")
        if not sep or kind not in KINDS or not valid_name(node):
            return None
        return kind, node


# --- encoding ---------------------------------------------------------------------------


def _dump(obj: Mapping[str, Any]) -> bytes:
    return json.dumps(obj, separators=(",", ":"), sort_keys=True).encode()


def encode_ledger(ledger: SlotLedger) -> bytes:
    return _dump(ledger_object(ledger))


def _grant_object(g: Grant) -> dict[str, Any]:
    obj: dict[str, Any] = {"id": g.id, "sem": g.sem, "to": g.to, "epoch": g.epoch, "n": g.n, "seq": g.seq}
    if g.mint is not None:
        obj["mint"] = dict(g.mint)
    return obj


def _lost_object(lost: Lost) -> dict[str, Any]:
    obj: dict[str, Any] = {"seq": lost.seq, "allot": dict(lost.allot), "heir": lost.heir}
    if lost.mint is not None:
        obj["mint"] = dict(lost.mint)
    if lost.succession is not None:
        obj["succession"] = [list(s) for s in lost.succession]
    return obj


def ledger_object(ledger: SlotLedger) -> dict[str, Any]:
    """The ledger as the JSON object ``encode_ledger`` writes (and the node's state file embeds)."""
    obj: dict[str, Any] = {
        "v": VERSION,
        "kind": "ledger",
        "node": ledger.node,
        "seq": ledger.seq,
        "epoch": ledger.epoch,
        "heir": ledger.heir,
        "allot": dict(ledger.allot),
        "grants": [_grant_object(g) for g in ledger.grants],
        "applied": {donor: sorted(ids) for donor, ids in ledger.applied.items()},
        "adopted": dict(ledger.adopted),
        "lost": [_lost_object(lost) for lost in ledger.lost],
    }
    if ledger.mint is not None:
        obj["mint"] = dict(ledger.mint)
    if ledger.leaving:
        obj["leaving"] = True
    if ledger.succession is not None:
        obj["succession"] = [list(s) for s in ledger.succession]
    return obj


def encode_copy(copy: Copy) -> bytes:
    return _dump(
        {
            "v": VERSION,
            "kind": "copy",
            "node": copy.ledger.node,
            "ask": copy.ask,
            "queue": dict(copy.queue),
            "forward": {sem: [to, epoch] for sem, (to, epoch) in copy.forward.items()},
            "ledger": ledger_object(copy.ledger),
        }
    )


def encode_want(want: Want) -> bytes:
    return _dump({"v": VERSION, "kind": "want", "node": want.node, "epoch": want.epoch, "sems": dict(want.sems)})


def encode_member(member: Member) -> bytes:
    return _dump(
        {"v": VERSION, "kind": "member", "node": member.node, "epoch": member.epoch, "state": member.state.value,
         "heir": member.heir}
    )  # fmt: skip


def encode_census(census: Census) -> bytes:
    return _dump(
        {
            "v": VERSION,
            "kind": "census",
            "node": census.bank,
            "epoch": census.epoch,
            "seq": census.seq,
            "caps": dict(census.caps),
            "target": dict(census.target),
            "members": {
                name: {"state": m.state.value, "heir": m.heir, "allot": dict(m.allot), "epoch": m.epoch}
                for name, m in census.members.items()
            },
            "joined": dict(census.joined),
            "ledgerSeq": census.ledger_seq,
        }
    )


def encode_status(status: NodeStatus) -> bytes:
    return _dump(
        {
            "v": VERSION,
            "kind": "status",
            "node": status.node,
            "version": status.version,
            "epoch": status.epoch,
            "seq": status.seq,
            "ready": status.ready,
            "phase": status.phase,
            "heartbeat": status.heartbeat_ms,
            "semaphores": {
                name: {"allotment": s.allot, "held": s.held, "waiting": s.waiting, "admitted": s.admitted}
                for name, s in status.sems.items()
            },
            "adopted": dict(status.adopted),
        }
    )


def encode_gone(gone: Gone) -> bytes:
    return _dump({"v": VERSION, "kind": "gone", "node": gone.node, "epoch": gone.epoch})


def encode_sync(node: str, nonce: int) -> bytes:
    return _dump({"v": VERSION, "kind": "sync", "node": node, "nonce": nonce})


# --- decoding ---------------------------------------------------------------------------


def _object(payload: bytes, kind: str | tuple[str, ...], node: str | None) -> dict[str, Any]:
    if len(payload) > MAX_PAYLOAD:
        raise Malformed(f"payload of {len(payload)} bytes")
    try:
        obj = json.loads(payload)
    except (ValueError, RecursionError) as exc:  # UnicodeDecodeError is a ValueError
        raise Malformed(f"not JSON: {exc}") from None
    if not isinstance(obj, dict):
        raise Malformed("not a JSON object")
    if obj.get("v") != VERSION:
        raise UnknownVersion(f"protocol version {obj.get('v')!r}")
    kinds = (kind,) if isinstance(kind, str) else kind
    if obj.get("kind") not in kinds:
        raise Malformed(f"kind {obj.get('kind')!r} on a {'/'.join(kinds)} topic")
    if node is not None and obj.get("node") != node:
        raise Malformed(f"node {obj.get('node')!r} on the topic of {node!r}")
    return obj


def _int(obj: Mapping[str, Any], key: str, minimum: int = 0) -> int:
    value = obj.get(key)
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise Malformed(f"{key}: expected an integer >= {minimum}, got {value!r}")
    return value


def _name(value: Any, what: str) -> str:
    if not isinstance(value, str) or not valid_name(value):
        raise Malformed(f"{what}: expected a name, got {value!r}")
    return value


def _map(value: Any, what: str) -> dict[str, Any]:
    if not isinstance(value, dict) or len(value) > MAX_ITEMS:
        raise Malformed(f"{what}: expected an object")
    return value


def _list(value: Any, what: str) -> list[Any]:
    if not isinstance(value, list) or len(value) > MAX_ITEMS:
        raise Malformed(f"{what}: expected a list")
    return value


def _counts(value: Any, what: str) -> dict[str, int]:
    counts = {}
    for key, n in _map(value, what).items():
        if not isinstance(n, int) or isinstance(n, bool) or n < 0:
            raise Malformed(f"{what}.{key}: expected an integer >= 0")
        counts[_name(key, what)] = n
    return counts


def _mint(value: Any, what: str) -> dict[str, int] | None:
    return None if value is None else _counts(value, what)


def decode_ledger(payload: bytes, node: str) -> SlotLedger:
    return ledger_from_object(_object(payload, "ledger", node), node)


def ledger_from_object(obj: dict[str, Any], node: str) -> SlotLedger:
    """A ledger from its JSON object (checked), as embedded in a copy or the state file."""
    if obj.get("node") != node:
        raise Malformed(f"node {obj.get('node')!r} in a ledger of {node!r}")
    heir = obj.get("heir", "")
    if heir != "":
        heir = _name(heir, "heir")
    grants = []
    for raw in _list(obj.get("grants", []), "grants"):
        item = _map(raw, "grants[]")
        grants.append(
            Grant(
                id=_int(item, "id"),
                sem=""
                if item.get("mint") is not None and item.get("sem") == ""
                else _name(item.get("sem"), "grants[].sem"),
                to=_name(item.get("to"), "grants[].to"),
                epoch=_int(item, "epoch"),
                n=_int(item, "n", 0 if item.get("mint") is not None else 1),
                seq=_int(item, "seq"),
                mint=_mint(item.get("mint"), "grants[].mint"),
            )
        )
    applied = {}
    for donor, ids in _map(obj.get("applied", {}), "applied").items():
        if not all(isinstance(i, int) and not isinstance(i, bool) for i in _list(ids, "applied[]")):
            raise Malformed("applied: expected lists of integers")
        applied[_name(donor, "applied")] = frozenset(ids)
    lost = []
    for raw in _list(obj.get("lost", []), "lost"):
        item = _map(raw, "lost[]")
        lost_heir = item.get("heir", "")
        lost.append(
            Lost(
                seq=_int(item, "seq"),
                allot=_counts(item.get("allot"), "lost[].allot"),
                heir="" if lost_heir == "" else _name(lost_heir, "lost[].heir"),
                mint=_mint(item.get("mint"), "lost[].mint"),
                succession=_succession(item.get("succession"), "lost[].succession"),
            )
        )
    return SlotLedger(
        node=node,
        seq=_int(obj, "seq"),
        epoch=_int(obj, "epoch"),
        heir=heir,
        mint=_mint(obj.get("mint"), "mint"),
        leaving=obj.get("leaving") is True,
        allot=_counts(obj.get("allot"), "allot"),
        grants=tuple(grants),
        applied=applied,
        adopted=_counts(obj.get("adopted", {}), "adopted"),
        lost=tuple(lost),
        succession=_succession(obj.get("succession"), "succession"),
    )


def _succession(value: Any, what: str) -> Succession | None:
    """None when absent: a ledger of a version without successions (its heir alone adopts it, I16)."""
    if value is None:
        return None
    out = []
    for raw in _list(value, what):
        pair = _list(raw, what)
        if len(pair) != 2 or not isinstance(pair[1], int) or isinstance(pair[1], bool) or pair[1] < 0:
            raise Malformed(f"{what}: expected [node, epoch] pairs")
        out.append((_name(pair[0], what), pair[1]))
    return tuple(out)


def decode_status(payload: bytes, node: str) -> NodeStatus:
    obj = _object(payload, "status", node)
    sems = {}
    for name, raw in _map(obj.get("semaphores"), "semaphores").items():
        item = _map(raw, "semaphores[]")
        sems[_name(name, "semaphores")] = SemStatus(
            allot=_int(item, "allotment"),
            held=_int(item, "held"),
            waiting=_int(item, "waiting"),
            admitted=_int(item, "admitted"),
        )
    ready, phase, version = obj.get("ready"), obj.get("phase", ""), obj.get("version", "")
    if not isinstance(ready, bool) or not isinstance(phase, str) or not isinstance(version, str):
        raise Malformed("ready, phase, version: wrong types")
    return NodeStatus(
        node=node,
        epoch=_int(obj, "epoch"),
        seq=_int(obj, "seq"),
        ready=ready,
        phase=phase,
        sems=sems,
        adopted=_counts(obj.get("adopted", {}), "adopted"),
        version=version,
        heartbeat_ms=_int(obj, "heartbeat"),
    )


def decode_gone(payload: bytes, node: str) -> Gone:
    return Gone(node=node, epoch=_int(_object(payload, "gone", node), "epoch"))


def decode_sync(payload: bytes, node: str) -> int:
    return _int(_object(payload, "sync", node), "nonce")


def decode_inbox(payload: bytes) -> Copy | Want:
    """A message in a node's inbox: a ledger copy or a demand; ``node`` names its sender."""
    obj = _object(payload, ("copy", "want"), None)
    sender = _name(obj.get("node"), "node")
    if obj["kind"] == "want":
        return Want(node=sender, epoch=_int(obj, "epoch"), sems=_counts(obj.get("sems"), "sems"))
    ask = obj.get("ask", False)
    if not isinstance(ask, bool):
        raise Malformed("ask: expected a boolean")
    return Copy(
        ledger=ledger_from_object(_map(obj.get("ledger"), "ledger"), sender),
        ask=ask,
        queue=_counts(obj.get("queue", {}), "queue"),
        forward=_forward(obj.get("forward", {})),
    )


def _forward(value: Any) -> dict[str, tuple[str, int]]:
    forward = {}
    for sem, item in _map(value, "forward").items():
        pair = _list(item, "forward[]")
        if len(pair) != 2 or not isinstance(pair[1], int) or isinstance(pair[1], bool) or pair[1] < 0:
            raise Malformed("forward: expected [node, epoch] pairs")
        forward[_name(sem, "forward")] = (_name(pair[0], "forward[].node"), pair[1])
    return forward


def decode_member(payload: bytes, node: str) -> Member:
    obj = _object(payload, "member", node)
    try:
        state = MemberState(str(obj.get("state")))
    except ValueError:
        raise Malformed(f"state: {obj.get('state')!r}") from None
    heir = obj.get("heir", "")
    return Member(node=node, epoch=_int(obj, "epoch"), state=state, heir="" if heir == "" else _name(heir, "heir"))


def decode_census(payload: bytes) -> Census:
    obj = _object(payload, "census", None)
    members = {}
    for name, raw in _map(obj.get("members", {}), "members").items():
        item = _map(raw, "members[]")
        try:
            state = MemberState(str(item.get("state")))
        except ValueError:
            raise Malformed(f"members[].state: {item.get('state')!r}") from None
        heir = item.get("heir", "")
        members[_name(name, "members")] = MemberView(
            state=state,
            heir="" if heir == "" else _name(heir, "members[].heir"),
            allot=_counts(item.get("allot", {}), "members[].allot"),
            epoch=_int(item, "epoch"),
        )
    return Census(
        bank=_name(obj.get("node"), "node"),
        epoch=_int(obj, "epoch"),
        seq=_int(obj, "seq"),
        caps=_counts(obj.get("caps"), "caps"),
        target=_counts(obj.get("target", {}), "target"),
        members=members,
        joined=_counts(obj.get("joined", {}), "joined"),
        ledger_seq=_int(obj, "ledgerSeq") if "ledgerSeq" in obj else 0,
    )
