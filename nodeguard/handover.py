"""A stopping daemon's holds left to the successor that waits for the node (a rolling update's new pod).

The ledger is saved and the node let go; the successor adopts every record before its first tick. Should the
successor go away before it takes the node, the stopping daemon has the node again and gives back instead.
Before that, while the successor starts, the daemon that holds the node makes room for its start
(``StartRoom``; the successor's side is nodeguard/successor_start.py).
"""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import Callable

from nodeguard.actuators.ledger import Ledger, LedgerUnsaved
from nodeguard.actuators.node_lock import NodeBusy
from nodeguard.actuators.succession import Succession, Taken
from nodeguard.log import get_logger
from nodeguard.model.snapshot import Snapshot
from nodeguard.policy.metrics import CAPABILITIES, Resource
from nodeguard.policy.planner import Plan
from nodeguard.sd_notify import Notifier
from nodeguard.successor_start import START_RESERVE_CORES, Starting, note_room, successor_starting

log = get_logger("nodeguard.daemon")

# How long a stopping daemon waits for its successor to take the node after handing it over.
HANDOVER_SECONDS = 10.0


def hand_over(ledger: Ledger, succession: Succession, held: Callable[[Ledger], dict[str, int]]) -> bool:
    """Leave every hold to the successor that waits; False when this daemon holds the node still (or again, its
    successor gone before it took the node) and gives back instead."""
    try:
        ledger.save()
        succession.hand_over()
    except (LedgerUnsaved, OSError) as exc:
        log.error("cannot hand over to the waiting successor; giving back instead", error=str(exc))
        return False
    started = time.monotonic()
    taken = succession.taken(HANDOVER_SECONDS)
    took_ms = round(1000 * (time.monotonic() - started), 1)
    if taken is Taken.BACK:
        log.warning("the successor went away before taking the node; giving back", waited_ms=took_ms)
        return False
    if taken is Taken.LEFT:
        log.warning("the successor has not taken the node; the ledger waits for the next start",
                    waited_ms=took_ms, **held(ledger))  # fmt: skip
    else:
        log.info("handed every hold over to the successor", took_ms=took_ms, **held(ledger))
    return True


async def wait_for_node(succession: Succession, stopping: asyncio.Event, notifier: Notifier) -> int | None:
    """Wait until the predecessor lets the node go (None: this daemon holds it now), or the exit code: 0 for a
    stop that came first, 1 when the node cannot be had."""
    holder = succession.holder()
    log.info("waiting to take the node over when the nodeguard that holds it stops", holder=holder)
    notifier.notify(f"STATUS=waiting for the node lock: {holder} holds it")
    started = time.monotonic()
    try:
        if not await succession.wait(stopping):
            return 0
    except NodeBusy as exc:
        log.error("not starting: refusing to act beside another nodeguard", error=str(exc))
        return 1
    except OSError as exc:
        log.error("not starting: cannot wait for the node", error=str(exc))
        return 1
    log.info("holding the node", waited_seconds=round(time.monotonic() - started, 3))
    return None


def room_made(plan: Plan) -> bool:
    """Whether a tick planned with a starting successor's room read no node CPU waterline past its line: the
    room is there, measured over a whole tick, and the successor may start."""
    return not any(
        CAPABILITIES[metric].resource is Resource.CPU and not CAPABILITIES[metric].protected
        for metric in plan.gaps.throttle_down
    )


class StartRoom:
    """The room a daemon that holds the node makes for a successor that asked for it: its start's CPU counted
    ahead in the node's readings, each tick while the successor's note is there."""

    def __init__(self, ledger_path: str, proc_root: str) -> None:
        self.ledger_path, self.proc_root = ledger_path, proc_root
        self.starting: Starting | None = None

    def counted(self, snapshot: Snapshot, holding: bool) -> Snapshot:
        """The tick's snapshot with the room counted, while a live successor asks for it (and this daemon holds
        the node: a successor's own note goes at its first tick)."""
        starting = successor_starting(self.ledger_path, self.proc_root) if holding else None
        if starting is not None and (self.starting is None or starting.pid != self.starting.pid):
            log.info("making room for a starting successor", pid=starting.pid, cores=START_RESERVE_CORES)
        self.starting = starting
        if starting is None:
            return snapshot
        return dataclasses.replace(snapshot, node=snapshot.node.with_cores_reserved(START_RESERVE_CORES))

    def answer(self, plan: Plan) -> None:
        """Tell the successor to start once the tick planned with its room has it."""
        if self.starting is not None and room_made(plan):
            note_room(self.ledger_path, self.starting)

    def tidy(self) -> None:
        """At the daemon's stop: this daemon's own note (it stopped while it waited) and a note whose successor is
        gone, go with it."""
        successor_starting(self.ledger_path, self.proc_root)
