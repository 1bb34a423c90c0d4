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
    """Nobody serves the gate socket, or it may not be used.

    ``cause`` says which (``nodeguard.gate.hook_errors`` words it for an operator):
    ``missing`` (no socket at ``path``), ``refused`` (a socket nobody listens on),
    ``no_answer`` (a connection the daemon never answered), ``denied`` (the
    socket's mode or owner keeps this user out); ``waited``: seconds spent trying.
    """

    def __init__(self, message: str, *, path: str = "", cause: str = "", waited: float = 0.0) -> None:
        super().__init__(message)
        self.path = path
        self.cause = cause
        self.waited = waited


class GateError(NodeguardError):
    """The gate answered with an error."""

    def __init__(self, code: str, message: str, details: list[str] | None = None) -> None:
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message
        self.details = details or []


class GateClient:
    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter, path: str = "") -> None:
        self.path = path
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
        started = loop.time()
        deadline = started + patience
        delay = 0.05
        while True:
            try:
                reader, writer = await asyncio.open_unix_connection(path, limit=16 << 20)
                return cls(reader, writer, path)
            except PermissionError as exc:  # not a daemon restarting: trying again would not help
                raise GateUnavailable(f"{path}: {exc.strerror}", path=path, cause="denied") from None
            except (FileNotFoundError, ConnectionRefusedError) as exc:
                if loop.time() + delay > deadline:
                    cause = "missing" if isinstance(exc, FileNotFoundError) else "refused"
                    raise GateUnavailable(
                        f"{path}: {exc.strerror}", path=path, cause=cause, waited=loop.time() - started
                    ) from None
            await asyncio.sleep(delay)
            delay = min(1.0, delay * 2)

    async def request(self, op: str, *, answer_within: float | None = None, **fields: Any) -> dict[str, Any]:
        """The response to one request; GateError if it is an error, ConnectionLost if the daemon went away,
        GateUnavailable (``no_answer``) if ``answer_within`` seconds pass without one (a daemon stopped or hung)."""
        if self._lost is not None:
            raise self._lost
        request_id = next(self._ids)
        future: asyncio.Future[dict[str, Any]] = asyncio.get_running_loop().create_future()
        self._waiting[request_id] = future
        message = {"op": op, "id": request_id, **{k: v for k, v in fields.items() if v is not None}}
        try:
            self._writer.write(json.dumps(message).encode() + b"\n")
            response = await asyncio.wait_for(self._answer(future), answer_within)
        except TimeoutError:
            if answer_within is None:  # the socket's own ETIMEDOUT
                raise ConnectionLost("connection to the gate lost") from None
            said = f"{self.path}: no answer in {answer_within:g} s"
            raise GateUnavailable(said, path=self.path, cause="no_answer", waited=answer_within) from None
        except (ConnectionError, OSError):
            raise ConnectionLost("connection to the gate lost") from None
        finally:
            self._waiting.pop(request_id, None)
        if not response.get("ok"):
            err = response.get("error") or {}
            raise GateError(str(err.get("code", "error")), str(err.get("message", "")), err.get("details"))
        return response

    async def _answer(self, future: asyncio.Future[dict[str, Any]]) -> dict[str, Any]:
        await self._writer.drain()
        return await future

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
