"""Commands import only what they run, and the daemon only the features that are on (issue 22).

Each check runs the real entry code in a fresh interpreter and looks at
``sys.modules`` afterwards: `nodeguard oci-hook` runs on every container
create and `nodeguard admit` before every gated start, so what they import is
start-up time on the critical path (bench/startup.py measures it).
"""

from __future__ import annotations

import contextlib
import json
import os
import socket
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

REPO = Path(__file__).resolve().parents[1]
EXAMPLE = REPO / "packaging" / "examples" / "kubernetes.json"

# What the gate's clients must not load: the config's models (pydantic), the console renderer (rich), the
# clients of features they do not use (httpx, aiomqtt), the planner and the config, and structlog (they print
# their own messages). asyncio too for the hook, admit and gatectl: it alone costs about twice a bare
# interpreter start here, and they make one request at a time over a blocking socket.
NEVER_IN_CLIENTS = ("pydantic", "rich", "httpx", "aiomqtt", "structlog", "nodeguard.policy", "nodeguard.config")
# What a daemon with coordination and Kubernetes off must not load.
NEVER_IN_PLAIN_DAEMON = (
    "aiomqtt",
    "paho",
    "httpx",
    "rich",
    "nodeguard.kubernetes.client",
    "nodeguard.coordination.service",
)

# The console script's entry point (pyproject.toml), as the OCI hook and init containers run it.
CLIENT = """
import json, sys
from nodeguard.entry import main
code = main(json.loads(sys.argv[1]))
print("MODULES " + json.dumps({"code": code, "modules": sorted(sys.modules)}))
"""


def loaded(names: list[str], forbidden: tuple[str, ...]) -> list[str]:
    """The modules of ``names`` that are, or are inside, one of ``forbidden``."""
    return [name for name in names if any(name == f or name.startswith(f + ".") for f in forbidden)]


def run_client(args: list[str], stdin: bytes = b"") -> dict[str, Any]:
    result = subprocess.run(
        [sys.executable, "-c", CLIENT, json.dumps(args)], input=stdin, capture_output=True, cwd=REPO, timeout=60
    )
    lines = [line for line in result.stdout.decode().splitlines() if line.startswith("MODULES ")]
    assert lines, result.stdout.decode() + result.stderr.decode()
    return dict(json.loads(lines[-1].removeprefix("MODULES ")))


@contextlib.contextmanager
def fake_gate(path: Path) -> Iterator[None]:
    """A gate socket that answers every request at once: the load is ready (enough for the clients' happy path)."""
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(str(path))
    server.listen(16)
    stop = threading.Event()

    def answer(conn: socket.socket) -> None:
        with conn, conn.makefile("rwb") as stream:
            for line in stream:
                request = json.loads(line)
                load = {"name": request.get("name") or "x", "state": "ready", "reason": "ready: fake"}
                stream.write(
                    json.dumps({"id": request.get("id"), "ok": True, "load": load, "gate": {}}).encode() + b"\n"
                )
                stream.flush()

    def accept() -> None:
        server.settimeout(0.1)
        while not stop.is_set():
            try:
                conn, _ = server.accept()
            except TimeoutError:
                continue
            threading.Thread(target=answer, args=(conn,), daemon=True).start()

    thread = threading.Thread(target=accept, daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join()
        server.close()


OCI_STATE = {"ociVersion": "1.0.2", "id": "0123abcd", "pid": 4242, "bundle": "/b", "annotations": {}}


@pytest.mark.parametrize("status", ["creating", "stopped"])
def test_the_oci_hook_imports_no_config_planner_pydantic_or_event_loop(tmp_path: Path, status: str) -> None:
    """`nodeguard oci-hook` at createRuntime and at poststop, against a gate that answers, loads none of pydantic, rich, httpx, aiomqtt, structlog, the planner, the config or asyncio."""
    with fake_gate(tmp_path / "gate.sock"):
        run = run_client(
            ["oci-hook", "--socket", str(tmp_path / "gate.sock")], json.dumps({**OCI_STATE, "status": status}).encode()
        )
    assert run["code"] == 0
    assert loaded(run["modules"], (*NEVER_IN_CLIENTS, "asyncio")) == []


def test_the_oci_hook_with_the_daemon_down_imports_no_more(tmp_path: Path) -> None:
    """`nodeguard oci-hook` with nothing on the socket (--connect-timeout 0) exits 75 having loaded none of the modules above."""
    state = json.dumps({**OCI_STATE, "status": "creating"}).encode()
    run = run_client(["oci-hook", "--socket", str(tmp_path / "absent.sock"), "--connect-timeout", "0"], state)
    assert run["code"] == 75
    assert loaded(run["modules"], (*NEVER_IN_CLIENTS, "asyncio")) == []


@pytest.mark.parametrize(
    "args",
    [
        ["admit", "--name", "backup-1"],
        ["admit", "--name", "web", "--ready-http", "http://127.0.0.1:1/healthz", "--after", "db"],
        ["gatectl", "status"],
        ["gatectl", "release", "backup-1"],
    ],
    ids=["admit", "admit-with-probe", "gatectl-status", "gatectl-release"],
)
def test_admit_and_gatectl_import_no_config_planner_pydantic_or_event_loop(tmp_path: Path, args: list[str]) -> None:
    """`nodeguard admit` and `gatectl`, against a gate that answers, load none of pydantic, rich, httpx, aiomqtt, structlog, the planner, the config or asyncio."""
    with fake_gate(tmp_path / "gate.sock"):
        run = run_client([*args, "--socket", str(tmp_path / "gate.sock")])
    assert run["code"] == 0
    assert loaded(run["modules"], (*NEVER_IN_CLIENTS, "asyncio")) == []


def test_gate_imports_no_config_planner_or_pydantic(tmp_path: Path) -> None:
    """`nodeguard gate -- true` (asyncio: it runs and watches its command) loads none of pydantic, rich, httpx, aiomqtt, structlog, the planner or the config."""
    with fake_gate(tmp_path / "gate.sock"):
        run = run_client(["gate", "--name", "job", "--socket", str(tmp_path / "gate.sock"), "--", "true"])
    assert run["code"] == 0
    assert loaded(run["modules"], NEVER_IN_CLIENTS) == []


DAEMON = """
import asyncio, json, sys
from nodeguard.entry import main

def stop_after_two_ticks(coro):
    from nodeguard.daemon import Daemon  # cmd_run has imported it by now

    tick = Daemon.tick

    def counted(self):
        plan = tick(self)
        if self.stats.ticks == 2:
            print("MODULES " + json.dumps(sorted(sys.modules)), flush=True)
            self.stopping.set()
        return plan

    Daemon.tick = counted
    return run(coro)

run, asyncio.run = asyncio.run, stop_after_two_ticks
sys.exit(main(["run", "--dry-run", "--config", sys.argv[1]]))
"""


def daemon_modules(tmp_path: Path, gate: dict[str, Any]) -> list[str]:
    """The modules `nodeguard run` with the example kubernetes config (coordination and Kubernetes turned off) and
    this gate section has loaded after two ticks (JSON logs, HTTP on)."""
    config = json.loads(EXAMPLE.read_text())
    assert not config["global"].get("coordination", {}).get("enabled", False)
    config["global"]["kubernetes"] = {"enabled": False}
    config["global"]["sensing"].update({"cgroupRoot": "/sys/fs/cgroup", "tickSeconds": 0.05})
    config["global"]["actuation"] = {"ledgerPath": str(tmp_path / "ledger.json")}
    config["global"]["gate"] = {"socket": str(tmp_path / "gate.sock"), **gate}
    config["global"]["http"] = {"listen": "127.0.0.1:0"}
    path = tmp_path / "config.json"
    path.write_text(json.dumps(config))
    result = subprocess.run(
        [sys.executable, "-c", DAEMON, str(path)],
        capture_output=True,
        cwd=REPO,
        timeout=60,
        env={k: v for k, v in os.environ.items() if k != "NOTIFY_SOCKET"},
    )
    lines = [line for line in result.stdout.decode().splitlines() if line.startswith("MODULES ")]
    assert result.returncode == 0 and lines, result.stdout.decode() + result.stderr.decode()
    return list(json.loads(lines[-1].removeprefix("MODULES ")))


def test_a_daemon_without_coordination_or_kubernetes_does_not_import_them(tmp_path: Path) -> None:
    """`nodeguard run` with coordination and Kubernetes off (gate and HTTP on), two ticks: no aiomqtt, paho, httpx or rich, nor the coordination service or the Kubernetes client."""
    modules = daemon_modules(tmp_path, {})
    assert "nodeguard.gate.service" in modules and "structlog" in modules  # it did run, with its gate and logs
    assert loaded(modules, NEVER_IN_PLAIN_DAEMON) == []


def test_a_daemon_with_the_gate_off_does_not_import_the_gate(tmp_path: Path) -> None:
    """`nodeguard run` with the gate off, two ticks: none of the gate's service, server, protocol or state file."""
    modules = daemon_modules(tmp_path, {"enabled": False})
    assert "nodeguard.surfaces.metrics" in modules  # it did run, serving its metrics
    gate = ("nodeguard.gate.service", "nodeguard.gate.server", "nodeguard.gate.protocol", "nodeguard.gate.store")
    assert loaded(modules, NEVER_IN_PLAIN_DAEMON + gate) == []
