"""Topic names and payloads of the coordination protocol: versioned JSON, parsed defensively.

Under ``nodeguard/<cluster>/``:

``status/<node>``  retained, with a Message Expiry: node, version, epoch, phase, per
                   semaphore allotment, held, waiting, admitted; heartbeat (wall ms).
``ledger/<node>``  retained, no expiry: the node's committed protocol state.
``gone/<node>``    retained Last Will (with Will Delay): ``{"node", "epoch"}``.
``sync/<node>``    not retained: the node's own barrier messages.

Every payload is a JSON object with ``"v": 1`` and a ``"kind"``. A decoder raises
:class:`Malformed` (or :class:`UnknownVersion`) and never anything else, so a bad
message is counted and ignored by the caller.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from typing import Any

from nodeguard.coordination.semaphore import Gone, Grant, Ledger, Lost, SemStatus, Status

VERSION = 1
ROOT = "nodeguard"
MAX_PAYLOAD = 1 << 20
MAX_ITEMS = 100_000
NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:-]{0,252}$")
KINDS = ("status", "ledger", "gone", "sync")


class Malformed(ValueError):
    """A payload that does not follow the protocol."""


class UnknownVersion(Malformed):
    """A payload of a protocol version this node does not speak."""


def valid_name(name: str) -> bool:
    """Node, cluster and semaphore names: one topic level, no wildcards."""
    return bool(NAME.match(name))


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

    def subscriptions(self, node: str) -> list[str]:
        return [f"{self.prefix}/status/+", f"{self.prefix}/ledger/+", f"{self.prefix}/gone/+", self.sync(node)]

    def parse(self, topic: str) -> tuple[str, str] | None:
        """``(kind, node)`` of a topic of this cluster, or ``None``."""
        head, sep, rest = topic.partition(self.prefix + "/")
        if head or not sep:
            return None
        kind, sep, node = rest.partition("/")
        if not sep or kind not in KINDS or not valid_name(node):
            return None
        return kind, node


# --- encoding ---------------------------------------------------------------------------


def _dump(obj: Mapping[str, Any]) -> bytes:
    return json.dumps(obj, separators=(",", ":"), sort_keys=True).encode()


def encode_ledger(ledger: Ledger) -> bytes:
    return _dump(ledger_object(ledger))


def ledger_object(ledger: Ledger) -> dict[str, Any]:
    """The ledger as the JSON object ``encode_ledger`` writes (and the node's state file embeds)."""
    return {
        "v": VERSION,
        "kind": "ledger",
        "node": ledger.node,
        "seq": ledger.seq,
        "epoch": ledger.epoch,
        "fps": dict(ledger.fps),
        "allot": dict(ledger.allot),
        "grants": [
            {"id": g.id, "sem": g.sem, "to": g.to, "epoch": g.epoch, "n": g.n, "seq": g.seq} for g in ledger.grants
        ],
        "applied": {donor: sorted(ids) for donor, ids in ledger.applied.items()},
        "adopted": dict(ledger.adopted),
        "lost": [{"seq": lost.seq, "allot": dict(lost.allot)} for lost in ledger.lost],
    }


def encode_status(status: Status) -> bytes:
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


def _object(payload: bytes, kind: str, node: str) -> dict[str, Any]:
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
    if obj.get("kind") != kind:
        raise Malformed(f"kind {obj.get('kind')!r} on a {kind} topic")
    if obj.get("node") != node:
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


def decode_ledger(payload: bytes, node: str) -> Ledger:
    obj = _object(payload, "ledger", node)
    fps = {}
    for sem, fp in _map(obj.get("fps"), "fps").items():
        if not isinstance(fp, str):
            raise Malformed("fps: expected strings")
        fps[_name(sem, "fps")] = fp
    grants = []
    for raw in _list(obj.get("grants", []), "grants"):
        item = _map(raw, "grants[]")
        grants.append(
            Grant(
                id=_int(item, "id"),
                sem=_name(item.get("sem"), "grants[].sem"),
                to=_name(item.get("to"), "grants[].to"),
                epoch=_int(item, "epoch"),
                n=_int(item, "n", 1),
                seq=_int(item, "seq"),
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
        lost.append(Lost(seq=_int(item, "seq"), allot=_counts(item.get("allot"), "lost[].allot")))
    return Ledger(
        node=node,
        seq=_int(obj, "seq"),
        epoch=_int(obj, "epoch"),
        fps=fps,
        allot=_counts(obj.get("allot"), "allot"),
        grants=tuple(grants),
        applied=applied,
        adopted=_counts(obj.get("adopted", {}), "adopted"),
        lost=tuple(lost),
    )


def decode_status(payload: bytes, node: str) -> Status:
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
    return Status(
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
