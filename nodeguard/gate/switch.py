"""The gate on or off: how the daemon gets its gate service.

Off (``gate.enabled`` false) the daemon gets ``GateOff``, which answers what
the daemon and its surfaces ask of the gate as a disabled ``GateService`` did,
without importing it: the socket server, the request and state-file models
and the load table are loaded only by a node that gates. A gate's state file
is left as it is while the gate is off. Turning the gate on or off takes a
restart either way.
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Any

from nodeguard.log import get_logger

if TYPE_CHECKING:
    from collections.abc import Callable

    from nodeguard.coordination.switch import Coordination
    from nodeguard.gate.service import GateService
    from nodeguard.gate.settings import GateSettings
    from nodeguard.model.snapshot import NodeUsage

log = get_logger("nodeguard.gate")


class GateOff:
    """The gate service of a node whose gate is off: no socket, no loads."""

    def __init__(self, settings: GateSettings) -> None:
        self.settings = settings
        self.on_admission: Callable[[float], None] | None = None

    async def run(self) -> None:
        log.info("gate disabled (gate.enabled is false)")
        await asyncio.Event().wait()

    def problem(self) -> str | None:
        return None  # off on purpose

    def observe(self, node: NodeUsage) -> None:
        return None

    def reconfigure(self, settings: GateSettings) -> None:
        if settings.enabled:
            log.warning("gate.socket and gate.enabled change only on restart", socket=self.settings.socket)
        self.settings = settings

    def status(self) -> dict[str, Any]:
        return {"enabled": False, "serving": False, "problem": None, "counts": {}, "counters": {}, "loads": []}


def gate_service(settings: GateSettings, cpus: int, state_dir: str, coordination: Coordination) -> Gate:
    """The service (imported only now) when the gate is on, ``GateOff`` when it is off."""
    if not settings.enabled:
        return GateOff(settings)
    from nodeguard.gate.service import GateService

    return GateService(settings, cpus, state_dir, coordination)


if TYPE_CHECKING:
    Gate = GateService | GateOff
