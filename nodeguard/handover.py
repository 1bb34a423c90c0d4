"""A stopping daemon's holds left to the successor that waits for the node (a rolling update's new pod).

The ledger is saved and the node let go; the successor adopts every record before its first tick. Should the
successor go away before it takes the node, the stopping daemon has the node again and gives back instead.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

from nodeguard.actuators.ledger import Ledger, LedgerUnsaved
from nodeguard.actuators.node_lock import NodeBusy
from nodeguard.actuators.succession import Succession, Taken
from nodeguard.log import get_logger
from nodeguard.sd_notify import Notifier

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
