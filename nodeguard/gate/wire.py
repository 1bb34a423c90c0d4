"""What every client of the gate socket shares: where the socket is, the errors, and a blocking connection.

The blocking connection (``BlockingGateClient``) serves the short-lived commands
that make one request at a time (``admit``, ``oci-hook``, ``gatectl``): they
import no event loop, so a container create does not wait for asyncio to load.
``connection.GateClient`` is the asyncio one, for ``nodeguard gate`` and the
benchmarks. Both send one JSON request per line, match responses by ``id``,
and fail alike: GateUnavailable (with its ``cause``), ConnectionLost, GateError.
"""

from __future__ import annotations

import itertools
import json
import os
import socket
import time

from nodeguard.errors import NodeguardError

TYPE_CHECKING = False  # typing.TYPE_CHECKING without importing typing: the OCI hook runs on every container create
if TYPE_CHECKING:
    from typing import Any

DEFAULT_SOCKET = "/run/nodeguard/gate.sock"
LINE_LIMIT = 16 << 20  # longer response lines are a broken connection


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


def encode_request(request_id: int, op: str, fields: dict[str, Any]) -> bytes:
    message = {"op": op, "id": request_id, **{k: v for k, v in fields.items() if v is not None}}
    return json.dumps(message).encode() + b"\n"


def checked(response: dict[str, Any]) -> dict[str, Any]:
    """The response itself, or its error raised as a GateError."""
    if not response.get("ok"):
        err = response.get("error") or {}
        raise GateError(str(err.get("code", "error")), str(err.get("message", "")), err.get("details"))
    return response


def unavailable(path: str, exc: OSError, started: float) -> GateUnavailable:
    cause = "missing" if isinstance(exc, FileNotFoundError) else "refused"
    return GateUnavailable(f"{path}: {exc.strerror}", path=path, cause=cause, waited=time.monotonic() - started)


def no_answer(path: str, seconds: float) -> GateUnavailable:
    return GateUnavailable(f"{path}: no answer in {seconds:g} s", path=path, cause="no_answer", waited=seconds)


class BlockingGateClient:
    """One connection, one request at a time, in the calling thread."""

    def __init__(self, sock: socket.socket, path: str = "") -> None:
        self.path = path
        self._sock = sock
        self._buffer = b""
        self._ids = itertools.count(1)
        self._lost: ConnectionLost | None = None

    @classmethod
    def connect(cls, path: str, patience: float = 0.0) -> BlockingGateClient:
        """Connect, retrying for ``patience`` seconds while the socket is missing or refuses (a daemon restarting)."""
        started = time.monotonic()
        deadline = started + patience
        delay = 0.05
        while True:
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            try:
                sock.connect(path)
                return cls(sock, path)
            except PermissionError as exc:  # not a daemon restarting: trying again would not help
                sock.close()
                raise GateUnavailable(f"{path}: {exc.strerror}", path=path, cause="denied") from None
            except (FileNotFoundError, ConnectionRefusedError) as exc:
                sock.close()
                if time.monotonic() + delay > deadline:
                    raise unavailable(path, exc, started) from None
            except BaseException:
                sock.close()
                raise
            time.sleep(delay)
            delay = min(1.0, delay * 2)

    def request(self, op: str, *, answer_within: float | None = None, **fields: Any) -> dict[str, Any]:
        """The response to one request; GateError if it is an error, ConnectionLost if the daemon went away,
        GateUnavailable (``no_answer``) if ``answer_within`` seconds pass without one (a daemon stopped or hung)."""
        if self._lost is not None:
            raise self._lost
        request_id = next(self._ids)
        deadline = None if answer_within is None else time.monotonic() + answer_within
        try:
            self._sock.settimeout(answer_within)
            self._sock.sendall(encode_request(request_id, op, fields))
            while True:
                response = self._read(deadline)
                # An error not tied to a request of ours (unauthorised, a line too long) is the answer too.
                if response.get("id") == request_id or response.get("ok") is False:
                    break
        except TimeoutError:
            if answer_within is None:  # the socket's own ETIMEDOUT
                self._lost = ConnectionLost("connection to the gate lost")
                raise self._lost from None
            raise no_answer(self.path, answer_within) from None
        except (OSError, ValueError):  # a broken connection, or a line that is not a JSON object
            self._lost = ConnectionLost("connection to the gate lost")
            raise self._lost from None
        return checked(response)

    def _read(self, deadline: float | None) -> dict[str, Any]:
        while b"\n" not in self._buffer:
            if len(self._buffer) > LINE_LIMIT:
                raise ValueError("response line too long")
            if deadline is not None:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError
                self._sock.settimeout(left)
            chunk = self._sock.recv(65536)
            if not chunk:
                raise ConnectionResetError("the daemon closed the connection")
            self._buffer += chunk
        line, _, self._buffer = self._buffer.partition(b"\n")
        response = json.loads(line)
        if not isinstance(response, dict):
            raise ValueError("a response that is not a JSON object")
        return response

    def close(self) -> None:
        self._sock.close()
