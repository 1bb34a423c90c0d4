"""Operating the real daemon: HTTP endpoints, metrics from real workloads, sd_notify, reload, bad starts."""

from __future__ import annotations

import json
import signal
import socket
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from nodeguard.surfaces.http import HttpServer
from tests.support import cgroups as rc
from tests.support.daemon import DaemonProcess
from tests.support.endpoints import get, metric_value
from tests.support.ports import free_port


def config(tmp_path: Path, port: int, **sections: Any) -> dict[str, Any]:
    settings: dict[str, Any] = {
        "sensing": {"kubepods": False, "tickSeconds": 0.3},
        "actuation": {"ledgerPath": str(tmp_path / "run/ledger.json")},
        "http": {"listen": f"127.0.0.1:{port}"},
        "gate": {"socket": str(tmp_path / "run/gate.sock")},
    }
    settings.update(sections)
    return {"global": settings}


@pytest.fixture
def v1_group() -> Iterator[tuple[str, list[Path]]]:
    with rc.v1_cpu_group() as group:
        yield group.name, group.dirs


def test_endpoints_and_metrics_follow_a_real_workload(tmp_path: Path, v1_group: tuple[str, list[Path]]) -> None:
    """/readyz turns ready, /status is JSON, and /metrics shows a real workload's CPU rise and leave."""
    name, dirs = v1_group
    port = free_port()
    groups = {"groups": [{"match": name, "class": "BestEffort"}]}
    daemon = DaemonProcess(
        config(
            tmp_path,
            port,
            workloads=groups,
            sensing={"kubepods": False, "tickSeconds": 0.3, "cgroupVersion": "v1", "discoverySeconds": 0.3},
        ),
        tmp_path,
    ).start()
    base = f"http://127.0.0.1:{port}"
    try:
        daemon.wait_for(lambda: _ok(base + "/readyz"), 15, "/readyz ready")
        assert get(base + "/healthz") == (200, "ok\n")
        status, body = get(base + "/status")
        assert status == 200 and json.loads(body)["ticks"] >= 1
        assert get(base + "/nope")[0] == 404
        daemon.wait_for(
            lambda: (
                metric_value(get(base + "/metrics")[1], "nodeguard_workload_cpu_usage_cores", workload=name) is not None
            ),
            10,
            "the idle workload's series",
        )
        idle = metric_value(get(base + "/metrics")[1], "nodeguard_workload_cpu_usage_cores", workload=name)
        assert idle is not None and idle < 0.1
        busy = rc.start_busy(*dirs)
        try:
            daemon.wait_for(
                lambda: (
                    (metric_value(get(base + "/metrics")[1], "nodeguard_workload_cpu_usage_cores", workload=name) or 0)
                    > 0.5
                ),
                10,
                "the workload's CPU in /metrics",
            )
        finally:
            rc.stop(busy)
        text = get(base + "/metrics")[1]
        assert metric_value(text, "nodeguard_ticks_total") is not None
        assert metric_value(text, "nodeguard_tick_duration_seconds_count") is not None
        for directory in reversed(dirs):
            rc.remove_cgroup(directory)
        daemon.wait_for(
            lambda: f'workload="{name}"' not in get(base + "/metrics")[1], 10, "the departed workload's series gone"
        )
    finally:
        daemon.signal(signal.SIGTERM)
        assert daemon.wait() == 0


def _ok(url: str) -> bool:
    try:
        return get(url)[0] == 200
    except OSError:
        return False


def test_readyz_is_unavailable_before_the_first_tick() -> None:
    """While a part reports a problem (no tick yet) /readyz answers 503 naming it; once none does, 200."""
    health: dict[str, str | None] = {"guard": "no successful tick yet", "gate": None}
    server = HttpServer(__import__("prometheus_client").CollectorRegistry(), lambda: health, dict)
    response = server.route("GET", "/readyz")
    assert response.status == 503 and b"guard: no successful tick yet" in response.body
    health["guard"] = None
    assert server.route("GET", "/readyz").status == 200
    assert server.route("POST", "/metrics").status == 405


def test_sd_notify_ready_watchdog_stopping_in_order(tmp_path: Path) -> None:
    """Under a NOTIFY_SOCKET the daemon sends READY=1, then WATCHDOG=1 pings, then STOPPING=1 at SIGTERM."""
    sock_path = tmp_path / "notify.sock"
    receiver = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    receiver.bind(str(sock_path))
    receiver.settimeout(15)
    daemon = DaemonProcess(config(tmp_path, free_port()), tmp_path)
    daemon.start(env={"NOTIFY_SOCKET": str(sock_path), "WATCHDOG_USEC": "2000000"})
    seen: list[str] = []
    try:
        while not any("WATCHDOG=1" in m for m in seen[1:]):
            seen.append(receiver.recv(4096).decode())
        daemon.signal(signal.SIGTERM)
        while not any("STOPPING=1" in m for m in seen):
            seen.append(receiver.recv(4096).decode())
    finally:
        daemon.kill()
        receiver.close()
    assert daemon.wait() is not None
    flat = [line for message in seen for line in message.splitlines()]
    ready, stopping = flat.index("READY=1"), flat.index("STOPPING=1")
    watchdogs = [i for i, line in enumerate(flat) if line == "WATCHDOG=1"]
    assert ready < watchdogs[0] and len(watchdogs) >= 2 and watchdogs[-1] < stopping
    assert any(line.startswith("STATUS=") for line in flat)


def test_sighup_with_a_broken_config_keeps_the_old_one(tmp_path: Path) -> None:
    """A reload with a broken file logs every error path and the daemon keeps running its old config."""
    port = free_port()
    daemon = DaemonProcess(config(tmp_path, port), tmp_path).start()
    try:
        daemon.wait_for(lambda: _ok(f"http://127.0.0.1:{port}/readyz"), 15, "ready")
        good = daemon.config_path.read_text()
        daemon.config_path.write_text(json.dumps({"global": {"sensing": {"tickSeconds": "fast"}, "bogus": 1}}))
        daemon.signal(signal.SIGHUP)
        daemon.wait_for(
            lambda: sum(e.get("event", "").startswith("reload rejected") for e in daemon.events()) >= 2,
            10,
            "the rejected reload logged",
        )
        problems = [e["problem"] for e in daemon.events() if e.get("event", "").startswith("reload rejected")]
        assert any(p.startswith("global.sensing.tickSeconds:") for p in problems)
        assert any(p.startswith("global.bogus: unknown key") for p in problems)
        assert _ok(f"http://127.0.0.1:{port}/healthz")
        metrics = get(f"http://127.0.0.1:{port}/metrics")[1]
        assert metric_value(metrics, "nodeguard_config_reloads_total", result="failed") == 1.0
        daemon.config_path.write_text(good)
        daemon.signal(signal.SIGHUP)
        daemon.wait_for(lambda: any(e.get("event") == "config reloaded" for e in daemon.events()), 10, "reload")
    finally:
        daemon.signal(signal.SIGTERM)
        assert daemon.wait() == 0
    assert "Traceback" not in daemon.log_path.read_text()


def test_port_in_use_is_a_clear_error(tmp_path: Path) -> None:
    """A daemon whose HTTP port is taken exits 1 with the reason, no traceback, nothing touched."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        daemon = DaemonProcess(config(tmp_path, port), tmp_path).start()
        assert daemon.wait(timeout=30) == 1
    log = daemon.log_path.read_text()
    assert "cannot serve HTTP" in log and "Traceback" not in log


def test_unreadable_config_and_no_cgroup_root(tmp_path: Path) -> None:
    """A missing config file exits 2; a cgroup root with no hierarchy exits 1; neither prints a traceback."""
    missing = DaemonProcess({}, tmp_path)
    missing.config_path.unlink()
    missing.start()
    assert missing.wait(timeout=30) == 2
    empty = tmp_path / "empty"
    empty.mkdir()
    bad_root = DaemonProcess(config(tmp_path, free_port(), sensing={"cgroupRoot": str(empty)}), tmp_path).start()
    assert bad_root.wait(timeout=30) == 1
    for process in (missing, bad_root):
        assert "Traceback" not in process.log_path.read_text()
    assert "no cgroup hierarchy" in bad_root.log_path.read_text()
