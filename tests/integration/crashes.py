"""A daemon crashed while it holds levers: what its SIGKILL leaves in the ledger and the kernel."""

from __future__ import annotations

import json
import signal
from pathlib import Path
from typing import Any

from nodeguard.actuators.ledger import Ledger
from tests.support.daemon import DaemonProcess
from tests.support.node import SLOW, ShapedNode, protect_config


def held(ledger: Path) -> dict[str, set[str]]:
    """The groups each lever holds in the ledger file."""
    found = Ledger.load(str(ledger))
    return {lever: set(found.of(lever)) for lever in ("cpu.max", "cpu.weight")}


def settled(ledger: Path) -> bool:
    """Whether no write the ledger records is still under way (its value saved as pending, not yet applied)."""
    return all(record.pending is None for record in Ledger.load(str(ledger)).records.values())


def crash_holding(node: ShapedNode, tmp_path: Path, *, quotas: bool) -> Path:
    """Run a daemon until it holds the Burstable tier's weight down (and, with ``quotas``, burners' quotas too),
    then SIGKILL it; returns the ledger it left."""
    ledger = tmp_path / "run/ledger.json"
    guard: dict[str, Any] = {"weightHoldSeconds": 600}
    config = protect_config(node, ledger, **guard)
    daemon = DaemonProcess(config, tmp_path).start()
    tier = f"{node.parent}/kubepods/burstable"

    def lowered() -> bool:
        # The ledger is written before the kernel: wait for both, or a SIGKILL between them leaves it as it was.
        return tier in held(ledger)["cpu.weight"] and node.hierarchy.weight(tier) != node.weights[tier]

    try:
        daemon.wait_for(lowered, 30 * SLOW, "the tier's weight held")
        if quotas:
            # Then, reloaded, a node waterline the burners exceed: their quotas go down beside the tier's weight.
            # (Given from the start, it throttled the burners before they could harm the pod: no weight came down.)
            config["global"]["guard"]["objectives"].append({
                "metric": "cpu_total_utilization", "action": "throttle", "threshold": "50%", "restoreBelow": "30%",
                "triggerAfter": 1, "restoreAfter": 2,
            })  # fmt: skip
            daemon.config_path.write_text(json.dumps(config))
            daemon.signal(signal.SIGHUP)
            daemon.wait_for(lambda: all(held(ledger).values()) and bool(node.throttled()), 30 * SLOW,
                            "a weight and a quota held")  # fmt: skip
    finally:
        daemon.kill()
    assert daemon.wait() == -signal.SIGKILL
    return ledger
