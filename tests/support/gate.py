"""The real daemon with its gate, real clients (``python -m nodeguard ...``), and a plain socket client."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from nodeguard.config import Settings
from tests.support.daemon import DaemonProcess
from tests.support.poll import wait_until

REPO = Path(__file__).resolve().parents[2]
SLOW_SERVER = str(Path(__file__).with_name("slow_server.py"))
# No HTTP endpoints: several daemons run at once here, and the default port is shared.
QUIET: dict[str, Any] = {"http": {"enabled": False}} if "http" in Settings.model_fields else {}


class Session:
    """One connection to the gate: requests in order, responses read one by one."""

    def __init__(self, path: str) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(30)
        self.sock.connect(path)
        self.file = self.sock.makefile("rwb")

    def send(self, request: dict[str, Any] | bytes) -> None:
        line = request if isinstance(request, bytes) else json.dumps(request).encode()
        self.file.write(line + b"\n")
        self.file.flush()

    def receive(self) -> dict[str, Any]:
        line = self.file.readline()
        assert line, "the daemon closed the connection"
        return dict(json.loads(line))

    def request(self, request: dict[str, Any] | bytes) -> dict[str, Any]:
        self.send(request)
        return self.receive()

    def close(self) -> None:
        self.file.close()
        self.sock.close()


def answer(path: str, request: dict[str, Any]) -> dict[str, Any] | None:
    """The response to one request on a connection of its own; None while nothing answers at ``path``."""
    try:
        session = Session(path)
    except OSError:
        return None
    try:
        return session.request(request)
    finally:
        session.close()


class Gate:
    """``nodeguard run`` with a gate on a socket in ``socket_dir`` (default: next to the ledger)."""

    def __init__(self, tmp: Path, gate: dict[str, Any], socket_dir: Path | None = None) -> None:
        run = tmp / "run"
        self.socket = str((socket_dir or run) / "gate.sock")
        self.config = {
            "global": {
                "sensing": {"kubepods": False, "tickSeconds": 0.2},
                # Several of these run at once on one machine, as separate nodes: none acts on its cgroups
                # (a daemon that may write holds the node, and a second one refuses to start).
                "actuation": {"ledgerPath": str(run / "ledger.json"), "dryRun": True},
                "gate": {"socket": self.socket, **gate},
                **QUIET,
            }
        }
        self.daemon = DaemonProcess(self.config, tmp)
        self.clients: list[subprocess.Popen[bytes]] = []

    def start(self, *, wait: bool = True) -> Gate:
        """Start the daemon and (``wait``) wait until its gate answers; see ``wait_answering``."""
        self.daemon.start()
        if wait:
            self.wait_answering()
        return self

    def wait_answering(self) -> None:
        self.daemon.wait_for(self._answers, 20, "the gate socket")

    def _answers(self) -> bool:
        return bool((answer(self.socket, {"op": "ping"}) or {}).get("ok"))

    def status_if_up(self) -> dict[str, Any] | None:
        """The gate's status; None while nothing answers on its socket."""
        answered = answer(self.socket, {"op": "status"})
        return None if answered is None else dict(answered["gate"])

    def reconfigure(self, gate: dict[str, Any]) -> None:
        self.config["global"]["gate"] = {"socket": self.socket, **gate}
        self.daemon.config_path.write_text(json.dumps(self.config))
        self.daemon.signal(signal.SIGHUP)

    def request(self, request: dict[str, Any] | bytes) -> dict[str, Any]:
        session = Session(self.socket)
        try:
            return session.request(request)
        finally:
            session.close()

    def status(self) -> dict[str, Any]:
        response = self.request({"op": "status"})
        assert response["ok"], response
        return dict(response["gate"])

    def load(self, name: str) -> dict[str, Any] | None:
        for load in self.status()["loads"]:
            if load["name"] == name:
                return dict(load)
        return None

    def wait_state(self, name: str, state: str, timeout: float = 20) -> dict[str, Any]:
        def reached() -> dict[str, Any] | None:
            load = self.load(name)
            return load if load is not None and load["state"] == state else None

        try:
            return dict(wait_until(reached, timeout, f"load {name} to be {state}"))
        except AssertionError as exc:  # with the status at the end of the wait, not at its start
            raise AssertionError(f"{exc}; status: {self._brief()}") from None

    def _brief(self) -> str:
        with contextlib.suppress(Exception):
            return json.dumps([(x["name"], x["state"], x["reason"]) for x in self.status()["loads"]])
        return "(no status)"

    def client(self, *args: str, stdin: int | None = None) -> subprocess.Popen[bytes]:
        """``python -m nodeguard ARGS`` against this gate, in its own process group."""
        proc = subprocess.Popen(
            [sys.executable, "-m", "nodeguard", *args],
            stdin=stdin,
            cwd=REPO,
            env={**os.environ, "NODEGUARD_GATE_SOCKET": self.socket},
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        self.clients.append(proc)
        return proc

    def stop(self) -> None:
        for proc in self.clients:
            if proc.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
            if proc.stdout is not None:
                proc.stdout.close()
        self.daemon.kill()


@contextlib.contextmanager
def running(tmp: Path, gate: dict[str, Any], socket_dir: Path | None = None) -> Iterator[Gate]:
    instance = Gate(tmp, gate, socket_dir)
    try:
        yield instance.start()
    finally:
        instance.stop()


def output(proc: subprocess.Popen[bytes], timeout: float = 30) -> tuple[int, str]:
    out, _ = proc.communicate(timeout=timeout)
    return proc.returncode, out.decode(errors="replace")
