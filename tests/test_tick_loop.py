"""The daemon's tick loop on a real (hybrid host's v2) hierarchy: what a failing tick and a stop mid-wait leave."""

from __future__ import annotations

import asyncio
import json
from pathlib import Path

from nodeguard.config import load_document
from nodeguard.daemon import Daemon
from nodeguard.policy.planner import Plan
from tests.support import cgroups as rc

TICK = 0.05  # far shorter than the test, so the loop's schedule and a stop during its wait are both seen


def test_a_tick_that_raises_is_counted_and_the_next_ticks_still_run_until_a_stop_mid_wait(
    tmp_path: Path, hybrid_v2_mount: Path
) -> None:
    """A tick that raises (a bug) is counted as an error and the loop goes on ticking; a stop set while the loop
    waits for its next tick ends the loop without another tick."""
    name, config = rc.unique_name(), tmp_path / "nodeguard.json"
    config.write_text(json.dumps({"global": {
        "sensing": {"cgroupRoot": str(hybrid_v2_mount), "cgroupVersion": "v2", "tickSeconds": TICK},
        "workloads": {"groups": [{"match": name, "class": "BestEffort"}]},
        "guard": {"objectives": [{"metric": "cpu_total_usage", "action": "throttle", "threshold": 64,
                                  "restoreBelow": 60}]},
        "actuation": {"ledgerPath": str(tmp_path / "ledger.json")},
        "history": {"path": str(tmp_path / "history")},
        "http": {"enabled": False},
        "gate": {"enabled": False},
    }}))  # fmt: skip
    with rc.cgroups(hybrid_v2_mount / name):
        daemon = Daemon(load_document(config).settings_for({}, str(config)), config_path=config)
        daemon.start()
        real_tick, calls = daemon.tick, []

        def tick() -> Plan:
            calls.append("tick")
            if len(calls) == 2:
                raise RuntimeError("a bug in one tick")
            plan = real_tick()
            if len(calls) == 5:
                daemon.stopping.set()  # the stop arrives before the loop's wait for the sixth tick
            return plan

        daemon.tick = tick  # type: ignore[method-assign]
        try:
            asyncio.run(asyncio.wait_for(daemon._tick_loop(), timeout=30))
        finally:
            daemon.stop()
    assert len(calls) == 5
    assert daemon.stats.errors == 1
    assert daemon.stats.ticks == 4  # every tick but the failed one succeeded
