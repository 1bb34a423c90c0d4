"""The node's protocol state on disk: written atomically before anything shows it.

It must survive a crash of the process (a restart within the will delay keeps
the allotment), which the page cache does; it need not survive a crash of the
machine: the file records the kernel's boot id, and after a reboot the node
distrusts it and continues from its retained ledger on the broker, which holds
everything any other node can have acted on. So there is no fsync on the path
of a grant; where there is no boot id, every write is fsync'd instead. Its home
is a tmpfs (``/run/nodeguard`` by default): on a disk file system the rename
that replaces the file can cost a millisecond (ext4 flushes the data of a file
renamed over another), on the path of every grant.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from nodeguard.atomic_file import UnsafeFile, boot_id, read_state_file, set_aside, write_atomic
from nodeguard.coordination.records import Saved
from nodeguard.coordination.topics import Malformed, decode_ledger, ledger_object
from nodeguard.log import get_logger

log = get_logger("nodeguard.coordination")

FORMAT = 1
MAX_STATE_BYTES = 16 << 20


def encode_saved(node: str, saved: Saved, boot: str | None = None) -> bytes:
    doc: dict[str, Any] = {
        "format": FORMAT,
        "node": node,
        "bootId": boot,
        "ledger": ledger_object(saved.ledger(node)),
        "nextGrant": saved.next_grant,
        "handledWill": saved.handled_will,
        "lostUpTo": saved.lost_up_to,
        "published": saved.published,
        "awaitHeir": saved.await_heir,
        "passedBefore": saved.passed_before,
    }
    return json.dumps(doc, separators=(",", ":")).encode()  # on the path of every grant: compact


def decode_saved(node: str, data: bytes) -> Saved:
    try:
        doc = json.loads(data)
    except ValueError as exc:
        raise Malformed(f"not JSON: {exc}") from None
    if not isinstance(doc, dict) or doc.get("format") != FORMAT or doc.get("node") != node:
        raise Malformed("not a coordination state of this node")
    ledger = decode_ledger(json.dumps(doc.get("ledger")).encode(), node)
    extras = [doc.get(k) for k in ("nextGrant", "handledWill", "lostUpTo")]
    if not all(isinstance(v, int) and not isinstance(v, bool) for v in extras):
        raise Malformed("nextGrant, handledWill, lostUpTo: expected integers")
    return Saved.from_ledger(
        ledger,
        epoch=ledger.epoch,
        next_grant=int(doc["nextGrant"]),
        handled_will=int(doc["handledWill"]),
        lost_up_to=int(doc["lostUpTo"]),
        published=bool(doc.get("published")),
        await_heir=bool(doc.get("awaitHeir")),
        passed_before=_passed_before(doc),
    )


def _passed_before(doc: dict[str, Any]) -> int:
    value = doc.get("passedBefore", 0)  # absent in a state written before successions: nothing passed
    if not isinstance(value, int) or isinstance(value, bool):
        raise Malformed("passedBefore: expected an integer")
    return value


class StateStore:
    def __init__(self, path: Path, node: str) -> None:
        self.path = path
        self.node = node
        self.boot = boot_id()

    def load(self) -> Saved | None:
        """The saved state, or ``None``: missing, written before a reboot, or corrupt (set aside)."""
        try:
            data = read_state_file(str(self.path), MAX_STATE_BYTES)
        except FileNotFoundError:
            return None
        except UnsafeFile as exc:
            log.error("coordination state not read; recovering from the broker", problem=exc.reason)
            return None
        try:
            saved = decode_saved(self.node, data)
            written_boot = json.loads(data).get("bootId")
        except Malformed as exc:
            aside = set_aside(str(self.path))
            log.error(
                "coordination state unreadable; set aside, recovering from the broker",
                error=str(exc),
                kept_as=str(aside),
            )
            return None
        if self.boot is not None and written_boot != self.boot:
            log.warning("the machine restarted since the coordination state was written; recovering from the broker")
            return None
        return saved

    def save(self, saved: Saved) -> None:
        """Write and rename: after a crash of the process the old or the new state is there, whole."""
        data = encode_saved(self.node, saved, self.boot)
        try:
            write_atomic(str(self.path), data, durable=self.boot is None)
        except FileNotFoundError:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            write_atomic(str(self.path), data, durable=self.boot is None)
