"""How nodeguard changes the system and undoes it: the ``actuation`` config section."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from nodeguard.config_base import FilePath, Model


class ActuationSettings(Model):
    """How nodeguard changes the system, and how it undoes it."""

    dry_run: bool = Field(False, description="log every write and eviction instead of making it")
    ledger_path: FilePath = Field(
        "/run/nodeguard/ledger.json", description="the ledger of original values (CPU quotas and weights, memory.high)"
    )
    on_start: Literal["restore", "adopt"] = Field(
        "restore", description="throttles found in the ledger at start: restore them, or keep holding them"
    )
    on_exit: Literal["restore", "keep"] = Field("restore", description="throttles held when the daemon stops")
    eviction_grace_seconds: float = Field(10.0, ge=0, le=3600)
    freeze_before_eviction: bool = True
