"""systemd/nodeguard.service: the directives the daemon relies on, and systemd's own check of the file."""

from __future__ import annotations

import shutil
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

import pytest

from nodeguard.history.settings import HistorySettings

REPO = Path(__file__).resolve().parents[2]
UNIT = REPO / "systemd" / "nodeguard.service"
BINARY = "/usr/local/bin/nodeguard"


def parse_unit(text: str) -> dict[str, dict[str, list[str]]]:
    """Section -> key -> every value given (a key may repeat, as ExecReload= does)."""
    sections: dict[str, dict[str, list[str]]] = defaultdict(lambda: defaultdict(list))
    section = ""
    for raw in text.splitlines():
        line = raw.strip()
        if not line or line.startswith(("#", ";")):
            continue
        if line.startswith("["):
            section = line.strip("[]")
            continue
        key, sep, value = line.partition("=")
        assert sep, f"not KEY=value: {line!r}"
        sections[section][key.strip()].append(value.strip())
    return sections


def service() -> dict[str, list[str]]:
    return parse_unit(UNIT.read_text(encoding="utf-8"))["Service"]


def value(key: str) -> str:
    (found,) = service()[key]
    return found


def test_notify_type_with_watchdog_and_restart() -> None:
    """The unit waits for READY=1 from the main process, expects a watchdog ping and always restarts."""
    assert value("Type") == "notify"
    assert value("NotifyAccess") == "main"
    assert value("WatchdogSec") == "30s"
    assert value("Restart") == "always"
    assert value("RestartSec")


def test_commands_run_reload_and_stop() -> None:
    """ExecStart runs the daemon on /etc/nodeguard/config.json, reload sends SIGHUP, stop sends SIGTERM briefly."""
    assert value("ExecStart") == f"{BINARY} run --config /etc/nodeguard/config.json"
    assert service()["ExecReload"][-1] == "/bin/kill -HUP $MAINPID"
    assert value("KillSignal") == "SIGTERM"
    seconds = value("TimeoutStopSec")
    assert seconds.endswith("s") and int(seconds[:-1]) <= 30


def test_the_same_binary_path_as_the_gate_example() -> None:
    """Every command path of the unit is the one systemd/example-admitted.service calls the gate with."""
    example = (REPO / "systemd" / "example-admitted.service").read_text(encoding="utf-8")
    assert BINARY in example
    commands = [v.split()[0] for k in ("ExecStart", "ExecReload") for v in service()[k]]
    assert {c for c in commands if c.endswith("/nodeguard")} == {BINARY}


def test_sandbox_leaves_cgroups_and_run_dir_writable() -> None:
    """The file system is read-only except /sys/fs/cgroup and /run/nodeguard, which /sys-wide protections would break."""
    assert value("ProtectSystem") == "strict"
    assert set(value("ReadWritePaths").split()) == {"/sys/fs/cgroup", "/run/nodeguard"}
    for breaks_cgroup_writes in ("ProtectKernelTunables", "ProtectControlGroups"):
        assert service().get(breaks_cgroup_writes, ["no"])[-1] == "no", breaks_cgroup_writes
    for key in (
        "NoNewPrivileges",
        "ProtectHome",
        "PrivateTmp",
        "ProtectKernelModules",
        "ProtectKernelLogs",
        "ProtectClock",
        "ProtectHostname",
        "RestrictRealtime",
        "RestrictSUIDSGID",
        "LockPersonality",
        "MemoryDenyWriteExecute",
    ):
        assert value(key) == "yes", key
    assert set(value("RestrictAddressFamilies").split()) == {"AF_UNIX", "AF_INET", "AF_INET6", "AF_NETLINK"}
    assert value("SystemCallArchitectures") == "native"
    assert "ProtectProc" not in service() and "ProcSubset" not in service()  # it reads /proc of every process


def test_ledger_directory_survives_restarts() -> None:
    """/run/nodeguard is the unit's runtime directory and is kept when the unit stops, for the next start's reconcile."""
    assert value("RuntimeDirectory") == "nodeguard"
    assert value("RuntimeDirectoryPreserve") == "yes"


def test_the_decision_history_is_the_units_state_directory() -> None:
    """history.path's default is under /var/lib/nodeguard, the unit's state directory: made by systemd, private,
    writable under ProtectSystem=strict, kept across restarts and reboots."""
    assert Path(HistorySettings().path).parent == Path("/var/lib") / value("StateDirectory")
    assert value("StateDirectoryMode") == "0750"
    assert value("ProtectSystem") == "strict"


def test_capabilities_are_only_those_the_daemon_uses() -> None:
    """The bounding set holds exactly the capabilities for signalling, dropping to clients' ids and the socket owner."""
    assert set(value("CapabilityBoundingSet").split()) == {
        "CAP_KILL",
        "CAP_SETUID",
        "CAP_SETGID",
        "CAP_CHOWN",
        "CAP_FOWNER",
    }


def test_guard_is_protected_under_pressure() -> None:
    """Memory protection and a high CPU weight keep the guard running when the node is under pressure."""
    assert value("MemoryLow")
    assert int(value("CPUWeight")) > 100  # the default weight


def test_open_file_limit_leaves_room_for_every_client() -> None:
    """LimitNOFILE is what the daemon raises its own soft limit to, far above the gate's and HTTP's connection caps."""
    from nodeguard.daemon import WANTED_OPEN_FILES
    from nodeguard.gate.settings import GateSettings
    from nodeguard.surfaces.http import MAX_CONNECTIONS

    limit = int(value("LimitNOFILE"))
    assert limit == WANTED_OPEN_FILES
    assert limit >= GateSettings().max_connections + MAX_CONNECTIONS + 4096  # and the sensor's open cgroup files


def _verify(unit_text: str, tmp_path: Path) -> subprocess.CompletedProcess[str]:
    # The command must exist for systemd to accept the unit: point it at this venv's nodeguard.
    nodeguard = Path(sys.executable).with_name("nodeguard")
    unit = tmp_path / "nodeguard.service"
    unit.write_text(unit_text.replace(BINARY, str(nodeguard)), encoding="utf-8")
    return subprocess.run(["systemd-analyze", "verify", str(unit)], capture_output=True, text=True, timeout=60)


needs_systemd_analyze = pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="needs systemd-analyze")


@needs_systemd_analyze
def test_systemd_accepts_every_line(tmp_path: Path) -> None:
    """systemd-analyze verify reports nothing: no unknown key, no unparsable value."""
    result = _verify(UNIT.read_text(encoding="utf-8"), tmp_path)
    assert result.returncode == 0 and not result.stderr.strip(), result.stderr


@needs_systemd_analyze
def test_systemd_verify_catches_a_bad_line(tmp_path: Path) -> None:
    """The verify check above can fail: a misspelt key and a bad value are reported."""
    text = UNIT.read_text(encoding="utf-8").replace("ProtectSystem=strict", "ProtectSystem=stricter\nWatchDogSec=5s")
    result = _verify(text, tmp_path)
    assert "WatchDogSec" in result.stderr and "stricter" in result.stderr
