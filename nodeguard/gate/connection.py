"""A client's connection to the gate socket: requests matched to responses by id, several in flight at once."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import os
from typing import Any

from nodeguard.errors import NodeguardError

DEFAULT_SOCKET = "/run/nodeguard/gate.sock"


def default_socket() -> str:
    return os.environ.get("NODEGUARD_GATE_SOCKET") or DEFAULT_SOCKET


class ConnectionLost(NodeguardError):
    """The daemon closed the connection (it stopped, or dropped us)."""


class GateUnavailable(NodeguardError):
    """Nobody serves the gate socket."""


class GateError(NodeguardError):
    """The gate answered with an error."""

    def __init__(self, code: str, message: str, details: list[str] | None = None) -> None:
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message
        self.details = details or []


class GateClient:
    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._reader = reader
        self._writer = writer
        self._ids = itertools.count(1)
        self._waiting: dict[int, asyncio.Future[dict[str, Any]]] = {}
        self._lost: ConnectionLost | None = None
        self._task = asyncio.get_running_loop().create_task(self._read(), name="gate-client-read")

    @classmethod
    async def connect(cls, path: str, patience: float = 0.0) -> GateClient:
        """Connect, retrying for ``patience`` seconds while the socket is missing or refuses (a daemon restarting)."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + patience
        delay = 0.05
        while True:
            try:
                reader, writer = await asyncio.open_unix_connection(path, limit=16 << 20)
                return cls(reader, writer)
            except (FileNotFoundError, ConnectionRefusedError) as exc:
                if loop.time() + delay > deadline:
                    raise GateUnavailable(f"{path}: {exc.strerror}") from None
            await asyncio.sleep(delay)
            delay = min(1.0, delay * 2)

    async def request(self, op: str, **fields: Any) -> dict[str, Any]:
        """The response to one request; GateError if it is an error, ConnectionLost if the daemon went away."""
        if self._lost is not None:
            raise self._lost
        request_id = next(self._ids)
        future: asyncio.Future[dict[str, Any]] = asyncio.get_running_loop().create_future()
        self._waiting[request_id] = future
        message = {"op": op, "id": request_id, **{k: v for k, v in fields.items() if v is not None}}
        try:
            self._writer.write(json.dumps(message).encode() + b"\n")
            await self._writer.drain()
            response = await future
        except (ConnectionError, OSError):
            raise ConnectionLost("connection to the gate lost") from None
        finally:
            self._waiting.pop(request_id, None)
        if not response.get("ok"):
            err = response.get("error") or {}
            raise GateError(str(err.get("code", "error")), str(err.get("message", "")), err.get("details"))
        return response

    async def _read(self) -> None:
        try:
            while True:
                line = await self._reader.readline()
                if not line:
                    break
                response = json.loads(line)
                future = self._waiting.get(response.get("id"))
                if future is not None and not future.done():
                    future.set_result(response)
                elif response.get("ok") is False:
                    # An error not tied to a request of ours (unauthorised, a line too long): fail them all.
                    for future in self._waiting.values():
                        if not future.done():
                            future.set_result(response)
        except (ConnectionError, OSError, ValueError):
            pass
        self._lost = ConnectionLost("connection to the gate lost")
        for future in self._waiting.values():
            if not future.done():
                future.set_exception(self._lost)

    async def close(self) -> None:
        self._task.cancel()
        self._writer.close()
        with contextlib.suppress(ConnectionError, OSError, asyncio.CancelledError):
            await self._writer.wait_closed()
        with contextlib.suppress(asyncio.CancelledError):
            await self._task
