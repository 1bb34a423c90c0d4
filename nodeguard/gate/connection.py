"""A client's asyncio connection to the gate socket: requests matched to responses by id, several in flight at once.

The errors and the default socket live in ``wire.py`` (with the blocking connection); they are re-exported here."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
from typing import Any

from nodeguard.gate.wire import (
    DEFAULT_SOCKET,
    LINE_LIMIT,
    ConnectionLost,
    GateError,
    GateUnavailable,
    checked,
    default_socket,
    encode_request,
    no_answer,
    unavailable,
)

__all__ = ["DEFAULT_SOCKET", "ConnectionLost", "GateClient", "GateError", "GateUnavailable", "default_socket"]


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
                reader, writer = await asyncio.open_unix_connection(path, limit=LINE_LIMIT)
                return cls(reader, writer, path)
            except PermissionError as exc:  # not a daemon restarting: trying again would not help
                raise GateUnavailable(f"{path}: {exc.strerror}", path=path, cause="denied") from None
            except (FileNotFoundError, ConnectionRefusedError) as exc:
                if loop.time() + delay > deadline:
                    raise unavailable(path, exc, started) from None
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
        try:
            self._writer.write(encode_request(request_id, op, fields))
            response = await asyncio.wait_for(self._answer(future), answer_within)
        except TimeoutError:
            if answer_within is None:  # the socket's own ETIMEDOUT
                raise ConnectionLost("connection to the gate lost") from None
            raise no_answer(self.path, answer_within) from None
        except (ConnectionError, OSError):
            raise ConnectionLost("connection to the gate lost") from None
        finally:
            self._waiting.pop(request_id, None)
        return checked(response)

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
