"""The daemon's HTTP endpoints: /metrics, /healthz, /readyz, /status, /history.

A small HTTP/1.1 server on asyncio streams, in the daemon's own event loop:
scrapes and status reads run between ticks, so they never see half-updated
state and need no locks. GET and HEAD only; one request per connection.

/readyz is the daemon's health: ready only while no part reports a problem
(no tick yet, the gate not serving, cgroup writes refused, waiting for the
node lock that another nodeguard holds). ``/readyz?successor`` is the same,
except that a daemon waiting to take the node over from its predecessor is
ready: a DaemonSet rolling with ``maxSurge`` stops the old pod only once the
new one is ready, and the old pod hands its holds over when it stops. At most
``MAX_CONNECTIONS`` are served at once (more are closed at once), each for at
most ``READ_TIMEOUT`` seconds of reading: a local user opening connections
cannot take the daemon's descriptors, and asyncio's server pauses accepting
(and logs it) rather than stopping when they run out. /history reads the
decision history's files in a worker thread: the ticks go on meanwhile.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any
from urllib.parse import parse_qs

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

from nodeguard.history.jsonl import json_text
from nodeguard.log import get_logger
from nodeguard.netaddr import split_host_port

log = get_logger("nodeguard.http")

MAX_REQUEST_BYTES = 8192
READ_TIMEOUT = 5.0
MAX_CONNECTIONS = 64


@dataclass(frozen=True, slots=True)
class Response:
    status: int
    body: bytes
    content_type: str = "text/plain; charset=utf-8"


REASONS = {
    200: "OK",
    400: "Bad Request",
    404: "Not Found",
    405: "Method Not Allowed",
    500: "Internal Server Error",
    503: "Service Unavailable",
}


class HttpServer:
    def __init__(
        self,
        registry: CollectorRegistry,
        health: Callable[[], Mapping[str, str | None]],
        status: Callable[[], dict[str, Any]],
        waiting: Callable[[], str | None] = lambda: None,
        history: Callable[[Mapping[str, list[str]]], tuple[int, dict[str, Any] | str]] | None = None,
    ) -> None:
        self.registry = registry
        self.health = health  # part -> its problem, None when it is fine
        self.status = status
        self.waiting = waiting  # while the daemon waits to take the node over: what it waits for
        self.history = history  # query parameters -> (status, the answer or an error); None: no history
        self.requests = 0
        self.errors = 0
        self.refused = 0  # connections closed unanswered: MAX_CONNECTIONS were open
        self.open = 0

    def route(self, method: str, target: str) -> Response:
        path, _, query = target.partition("?")
        if method not in ("GET", "HEAD"):
            return Response(405, b"only GET and HEAD\n")
        if path == "/metrics":
            return Response(200, generate_latest(self.registry), CONTENT_TYPE_LATEST)
        if path == "/healthz":
            return Response(200, b"ok\n")
        if path == "/readyz":
            waiting = self.waiting() if "successor" in parse_qs(query, keep_blank_values=True) else None
            if waiting is not None:
                return Response(200, f"ready to take the node over\n{waiting}\n".encode())
            problems = [f"{part}: {problem}" for part, problem in self.health().items() if problem is not None]
            if not problems:
                return Response(200, b"ready\n")
            return Response(503, ("not ready\n" + "".join(f"{line}\n" for line in problems)).encode())
        if path == "/status":
            body = json.dumps(self.status(), default=str, allow_nan=False).encode()
            return Response(200, body, "application/json")
        if path == "/history":
            return self.history_response(target)
        return Response(404, b"not found: try /metrics /healthz /readyz /status /history\n")

    def history_response(self, target: str) -> Response:
        """/history?pod=POD&since=TIME&at=TIME: reads files, so the server calls it in a worker thread."""
        if self.history is None:
            return Response(404, b"no decision history: history.enabled is off\n")
        status, body = self.history(parse_qs(target.partition("?")[2]))
        if isinstance(body, str):
            return Response(status, body.encode() + b"\n")
        return Response(status, json_text(body, None).encode(), "application/json")

    async def respond(self, method: str, target: str) -> Response:
        """The response to a request; /history's in a worker thread."""
        if target.split("?", 1)[0] == "/history" and method in ("GET", "HEAD"):
            return await asyncio.to_thread(self.history_response, target)
        return self.route(method, target)

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if self.open >= MAX_CONNECTIONS:
            self.refused += 1
            writer.transport.abort()  # frees the descriptor now; a scraper retries
            return
        self.open += 1
        try:
            await self._handle(reader, writer)
        finally:
            self.open -= 1

    async def _handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.requests += 1
        method = "GET"
        try:
            head = await asyncio.wait_for(reader.readuntil(b"\r\n\r\n"), READ_TIMEOUT)
            request_line = head.split(b"\r\n", 1)[0].decode("latin-1").split()
            if len(request_line) != 3 or not request_line[2].startswith("HTTP/"):
                response = Response(400, b"bad request line\n")
            else:
                method = request_line[0]
                response = await self.respond(method, request_line[1])
        except (asyncio.IncompleteReadError, asyncio.LimitOverrunError, TimeoutError, ConnectionError):
            self.errors += 1
            writer.close()
            return
        except Exception as exc:  # a failing endpoint must not take the daemon down
            self.errors += 1
            log.error("http handler failed", error=str(exc), exc_info=True)
            response = Response(500, b"internal error\n")
        header = (
            f"HTTP/1.1 {response.status} {REASONS.get(response.status, '')}\r\n"
            f"Content-Type: {response.content_type}\r\nContent-Length: {len(response.body)}\r\n"
            "Connection: close\r\n\r\n"
        ).encode()
        try:
            writer.write(header if method == "HEAD" else header + response.body)
            await asyncio.wait_for(writer.drain(), READ_TIMEOUT)  # a client that does not read is let go
        except (ConnectionError, TimeoutError):
            writer.transport.abort()
            return
        writer.close()

    async def start(self, listen: str) -> asyncio.Server:
        host, port = split_host_port(listen, any_port=True)
        return await asyncio.start_server(self.handle, host, port, limit=MAX_REQUEST_BYTES)
