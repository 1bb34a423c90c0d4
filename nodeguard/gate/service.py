"""The gate service inside the daemon (the socket server and the admission loop)."""

from __future__ import annotations

import asyncio
from typing import Any

from nodeguard.gate.settings import GateSettings
from nodeguard.model.snapshot import NodeUsage


class GateService:
    """Placeholder until the gate lands: serves nothing."""

    def __init__(self, settings: GateSettings, cpus: int, state_dir: str) -> None:
        self.settings = settings
        self.cpus = cpus
        self.state_dir = state_dir

    async def run(self) -> None:
        await asyncio.Event().wait()

    def observe(self, node: NodeUsage) -> None:
        del node

    def reconfigure(self, settings: GateSettings) -> None:
        self.settings = settings

    def status(self) -> dict[str, Any]:
        return {}
