"""A real mosquitto of a test's (or a benchmark's) own, and a TCP proxy between one node and it that can be cut.

The broker has its own config on a free loopback port, persistence off (or on), and is stopped by its PID.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import subprocess
import threading
from pathlib import Path

import pytest

from tests.support.poll import wait_until
from tests.support.ports import free_port

MOSQUITTO = shutil.which("mosquitto") or "/usr/sbin/mosquitto"


def skip_without_mosquitto() -> None:
    """Skip the test, saying why, where mosquitto is not installed."""
    if not os.access(MOSQUITTO, os.X_OK):
        pytest.skip("mosquitto is not installed (Debian package mosquitto)")


def listening(port: int) -> bool:
    """Whether something accepts connections on the loopback ``port`` now."""
    with socket.socket() as sock:
        return sock.connect_ex(("127.0.0.1", port)) == 0


def wait_listening(port: int, timeout: float = 10.0) -> None:
    """Until something accepts connections on the loopback ``port``."""
    wait_until(lambda: listening(port), timeout, f"something listening on port {port}", interval=0.02)


class Broker:
    """mosquitto on a free loopback port; ``sys_interval``: seconds between its $SYS statistics (a benchmark's)."""

    def __init__(
        self, workdir: Path, *, anonymous: bool = True, persistence: bool = False, sys_interval: int | None = None
    ) -> None:
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
            f"{'' if sys_interval is None else f'sys_interval {sys_interval}' + chr(10)}"
            # Started as root, mosquitto drops to its own user, which may not write the test's directory.
            f"{'user root' + chr(10) if os.geteuid() == 0 else ''}"
            f"log_dest file {self.log}\n"
            "log_type error\nlog_type warning\nlog_type notice\n"
        )
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> Broker:
        """Start it and wait until it listens."""
        self.proc = subprocess.Popen(
            [MOSQUITTO, "-c", str(self.config)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
        )
        wait_listening(self.port)
        return self

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


class CuttableProxy:
    """A TCP proxy between one node and the broker; ``cut()`` drops its connections and refuses new ones."""

    def __init__(self, target_port: int) -> None:
        self.target_port = target_port
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = int(self.listener.getsockname()[1])
        self.cut_off = threading.Event()
        self.sockets: set[socket.socket] = set()
        self.lock = threading.Lock()
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            if self.cut_off.is_set():
                client.close()
                continue
            try:
                upstream = socket.create_connection(("127.0.0.1", self.target_port))
            except OSError:
                client.close()
                continue
            with self.lock:
                self.sockets |= {client, upstream}
            threading.Thread(target=self._pump, args=(client, upstream), daemon=True).start()
            threading.Thread(target=self._pump, args=(upstream, client), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket) -> None:
        try:
            while data := src.recv(65536):
                dst.sendall(data)
        except OSError:
            pass
        for sock in (src, dst):
            with self.lock:
                self.sockets.discard(sock)
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
            sock.close()

    def cut(self) -> None:
        self.cut_off.set()
        with self.lock:
            sockets = list(self.sockets)
        for sock in sockets:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)

    def heal(self) -> None:
        self.cut_off.clear()

    def close(self) -> None:
        self.cut()
        self.listener.close()
