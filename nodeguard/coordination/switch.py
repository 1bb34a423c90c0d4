"""Coordination on or off: how the daemon gets its coordination service.

Off (``coordination.enabled`` false, the default) the daemon gets
``CoordinationOff``, which answers what the daemon and the gate ask of the
service as the service itself does when disabled, without importing it: the
MQTT client (aiomqtt, paho) and the protocol are loaded only by a node that
coordinates. Turning coordination on or off takes a restart either way.
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Any

from nodeguard.coordination.settings import CoordinationError, CoordinationSettings
from nodeguard.log import get_logger

if TYPE_CHECKING:
    from collections.abc import Callable

    from nodeguard.coordination.service import CoordinationService

log = get_logger("nodeguard.coordination")


class CoordinationOff:
    """The coordination service of a node that does not coordinate."""

    enabled = False
    failed: str | None = None
    # Read (by the gate) of an enabled service only; here for the type's sake.
    previous_lease_until = 0.0
    client_fence_seconds = 0.0

    def __init__(self, settings: CoordinationSettings) -> None:
        self.settings = settings
        self.on_revoke: Callable[[str, str], None] | None = None

    async def run(self) -> None:
        await asyncio.Event().wait()

    def reconfigure(self, settings: CoordinationSettings) -> None:
        if settings != self.settings:
            log.warning("turning coordination on or off takes a restart; keeping the running settings")

    async def acquire(self, semaphore: str, load_id: str) -> None:
        raise CoordinationError("coordination is disabled (coordination.enabled)")

    def claim(self, semaphore: str, load_id: str) -> None:
        return None

    def release(self, semaphore: str, load_id: str) -> None:
        return None

    def status(self) -> dict[str, Any]:
        return {"enabled": False}


def coordination_service(settings: CoordinationSettings, node: str) -> Coordination:
    """The service (imported only now) when coordination is on, ``CoordinationOff`` when it is off."""
    if not settings.enabled:
        return CoordinationOff(settings)
    from nodeguard.coordination.service import CoordinationService

    return CoordinationService(settings, node)


if TYPE_CHECKING:
    Coordination = CoordinationService | CoordinationOff
