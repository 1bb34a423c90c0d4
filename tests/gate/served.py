"""A real GateService serving a real unix socket, in its own thread and event loop, for tests that talk to it.

Faster than a whole daemon (no interpreter start, no ticks) and the same code
path for every byte a client sends: the socket, the accept loop, the line
reader, the protocol, the table, the state file.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import json
import select
import socket
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any, TypeVar

from nodeguard.gate.service import GateService
from nodeguard.gate.settings import GateSettings

T = TypeVar("T")


class ServedGate:
    def __init__(self, directory: Path, **gate: Any) -> None:
        self.socket = str(directory / "gate.sock")
        self.settings = GateSettings.model_validate({"socket": self.socket, **gate})
        self.state_dir = str(directory)
        self.loop = asyncio.new_event_loop()
        self.service: GateService | None = None
        self._task: asyncio.Task[None] | None = None
        self._started = threading.Event()
        self.thread = threading.Thread(target=self._run, name="served-gate", daemon=True)

    def _run(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.service = GateService(self.settings, 2, self.state_dir)
        self._task = self.loop.create_task(self.service.run())
        self._started.set()
        with contextlib.suppress(asyncio.CancelledError):
            self.loop.run_until_complete(self._task)
        self.loop.close()

    def start(self) -> ServedGate:
        self.thread.start()
        assert self._started.wait(10)
        return self

    def call(self, function: Callable[[], T], timeout: float = 10) -> T:
        """``function()`` run in the gate's loop thread (its state is the loop's alone)."""

        async def run() -> T:
            return function()

        future: concurrent.futures.Future[T] = asyncio.run_coroutine_threadsafe(run(), self.loop)
        return future.result(timeout)

    @property
    def gate(self) -> GateService:
        assert self.service is not None
        return self.service

    def serving(self) -> bool:
        return self.call(lambda: self.gate.serving)

    def stop(self) -> None:
        if self._task is not None and not self.loop.is_closed():
            self.loop.call_soon_threadsafe(self._task.cancel)
        self.thread.join(10)


@contextlib.contextmanager
def served(directory: Path, **gate: Any) -> Iterator[ServedGate]:
    served_gate = ServedGate(directory, **gate).start()
    try:
        yield served_gate
    finally:
        served_gate.stop()


def connect(path: str, timeout: float = 10) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(timeout)
    sock.connect(path)
    return sock


def exchange(path: str, payload: bytes, timeout: float = 10) -> list[dict[str, Any]]:
    """Send ``payload`` on a fresh connection, reading answers meanwhile (the gate stops reading a client that
    does not read), close the sending side, and return every response line."""
    data = bytearray()
    with connect(path, timeout) as sock:
        view, deadline = memoryview(payload), time.monotonic() + timeout
        while view:
            readable, writable, _ = select.select([sock], [sock], [], 1.0)
            if readable:
                data += sock.recv(1 << 16)
            if writable:
                view = view[sock.send(view[: 1 << 16]) :]
            if time.monotonic() > deadline:
                raise TimeoutError(f"{len(view)} bytes still unsent")
        sock.shutdown(socket.SHUT_WR)
        while chunk := sock.recv(1 << 16):
            data += chunk
    return [json.loads(line) for line in bytes(data).splitlines() if line.strip()]


def ping(path: str) -> bool:
    try:
        answers = exchange(path, b'{"op":"ping","id":"p"}\n', timeout=5)
    except OSError:
        return False
    return answers == [{"id": "p", "ok": True}]
