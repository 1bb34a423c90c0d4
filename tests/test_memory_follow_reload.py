"""A running daemon reads the workloads' memory files only while it needs them, across reloads (hybrid host)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from nodeguard.config import load_document
from nodeguard.daemon import Daemon
from tests.support import cgroups as rc

CPU = {"metric": "cpu_total_usage", "action": "throttle", "threshold": 64, "restoreBelow": 60}
STALL = {"metric": "protected_memory_stall", "action": "throttle", "threshold": "5%", "restoreBelow": "1%"}


def write_config(path: Path, mount: Path, name: str, objectives: list[dict[str, Any]]) -> None:
    path.write_text(json.dumps({"global": {
        "sensing": {"cgroupRoot": str(mount), "cgroupVersion": "v2", "tickSeconds": 0.2},
        "workloads": {"groups": [{"match": name, "class": "BestEffort"}]},
        "guard": {"objectives": objectives},
        "actuation": {"ledgerPath": str(path.parent / "ledger.json")},
        "history": {"path": str(path.parent / "history")},
        "http": {"enabled": False},
        "gate": {"enabled": False},
    }}))  # fmt: skip


def test_a_reload_adding_or_removing_a_memory_objective_starts_or_stops_the_memory_reads(
    tmp_path: Path, hybrid_v2_mount: Path
) -> None:
    """A reload that adds protected_memory_stall makes the next tick read memory.pressure; one that removes it
    makes the next tick stop, and a reload the config check rejects changes neither."""
    mount = hybrid_v2_mount
    name, config = rc.unique_name(), tmp_path / "nodeguard.json"
    seen: list[bool] = []
    with rc.cgroups(mount / name):
        write_config(config, mount, name, [CPU])
        daemon = Daemon(load_document(config).settings_for({}, str(config)), config_path=config)
        daemon.start()
        try:

            def tick() -> None:
                daemon.tick()
                assert daemon.last_snapshot is not None
                seen.append(daemon.last_snapshot.workloads[name].memory_pressure is not None)

            tick()
            write_config(config, mount, name, [CPU, STALL])
            assert daemon.reload()
            tick()
            config.write_text('{"global": {"guard": {"objectives": "none"}}}')
            assert not daemon.reload()
            tick()
            write_config(config, mount, name, [CPU])
            assert daemon.reload()
            tick()
        finally:
            daemon.stop()
    assert seen == [False, True, True, False]
