"""A real mosquitto per test: own config on a free loopback port, persistence off (or on), stopped by PID."""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.ports import free_port

MOSQUITTO = shutil.which("mosquitto") or "/usr/sbin/mosquitto"


def wait_listening(port: int, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        with socket.socket() as sock:
            if sock.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.02)
    raise AssertionError(f"nothing listens on port {port}")


class Broker:
    def __init__(self, workdir: Path, *, anonymous: bool = True, persistence: bool = False) -> None:
        self.port = free_port()
        self.workdir = workdir
        self.config = workdir / "mosquitto.conf"
        self.log = workdir / "mosquitto.log"
        # With persistence: retained messages, sessions and pending wills are saved on shutdown and restored.
        stored = f"persistence true\npersistence_location {workdir}/\nautosave_interval 1\n"
        self.config.write_text(
            f"listener {self.port} 127.0.0.1\n"
            f"allow_anonymous {'true' if anonymous else 'false'}\n"
            f"{stored if persistence else 'persistence false' + chr(10)}"
            "max_queued_messages 100000\n"
            "set_tcp_nodelay true\n"
            # Started as root, mosquitto drops to its own user, which may not write the test's directory.
            f"{'user root' + chr(10) if os.geteuid() == 0 else ''}"
            f"log_dest file {self.log}\n"
            "log_type error\nlog_type warning\nlog_type notice\n"
        )
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        self.proc = subprocess.Popen(
            [MOSQUITTO, "-c", str(self.config)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
        )
        wait_listening(self.port)

    def stop(self, *, crash: bool = False) -> None:
        """SIGTERM (mosquitto publishes every pending will as it shuts down), or SIGKILL: a crash."""
        if self.proc is None:
            return
        if self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGKILL if crash else signal.SIGTERM)
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                os.kill(self.proc.pid, signal.SIGKILL)
                self.proc.wait(5)
        self.proc = None


@pytest.fixture
def broker(tmp_path: Path) -> Iterator[Broker]:
    if not os.access(MOSQUITTO, os.X_OK):
        pytest.skip("mosquitto is not installed (Debian package mosquitto)")
    broker = Broker(tmp_path)
    broker.start()
    try:
        yield broker
    finally:
        broker.stop()
