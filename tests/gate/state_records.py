"""Gate state files written by hand: valid records of loads a gate admitted, laid over as a test needs."""

from __future__ import annotations

import json
import time
from pathlib import Path
from typing import Any

from nodeguard.atomic_file import boot_id
from nodeguard.gate import store
from nodeguard.gate.readiness import NotifyReadiness
from nodeguard.gate.states import Load, LoadSpec, LoadState

BOOT = boot_id()


def record(name: str, *, seq: int = 1, state: str = "starting", **changes: Any) -> dict[str, Any]:
    """A valid state-file record of a load admitted a second ago, with ``changes`` laid over it."""
    now = time.monotonic()
    load = Load(
        spec=LoadSpec(name=name, readiness=NotifyReadiness(type="notify"), detach=True),
        seq=seq,
        state=LoadState(state),
        reason="admitted: test",
        submitted_at=now - 2,
        admitted_at=now - 1,
        deadline=now + 300,
        finished_at=now - 0.5 if state == "ready" else None,
    )
    data = json.loads(store.encode([load], BOOT))["loads"][0]
    return {**data, **changes}


def write_state(directory: Path, loads: list[dict[str, Any]], raw: bytes | None = None) -> Path:
    """The gate's state file in ``directory``: these records, or ``raw`` bytes."""
    path = directory / store.STATE_FILE
    path.write_bytes(raw if raw is not None else json.dumps({"version": 1, "bootId": BOOT, "loads": loads}).encode())
    path.chmod(0o600)
    return path
