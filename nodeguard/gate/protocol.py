"""The gate's wire protocol: JSON lines over a unix socket, one request object per line, one response per line.

Requests (``op``), each with an optional ``id`` echoed in its response:

- ``submit``: name, dependsOn, readiness, priority, startTimeoutSeconds, detach, semaphore
- ``wait``: name, until (``starting``: admitted or failed; ``ready``: ready or failed)
- ``ready``, ``release``, ``cancel``, ``attach``: name
- ``status`` (optionally one name), ``ping``

A response is ``{"id": ..., "ok": true, ...}`` or ``{"id": ..., "ok": false,
"error": {"code": ..., "message": ...}}``. ``wait`` is answered when its
condition holds; other requests on the connection are answered meanwhile, so
responses may come out of order: match them by ``id``.
"""

from __future__ import annotations

import functools
import json
import re
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, Field, TypeAdapter, ValidationError, field_validator

from nodeguard.bounded_json import bounded_json
from nodeguard.config_base import LazyModel, format_location
from nodeguard.errors import NodeguardError
from nodeguard.gate.readiness import Readiness

MAX_LINE = 64 * 1024
MAX_NAME = 253  # a Kubernetes object name
MAX_START_TIMEOUT = 86_400.0
MAX_DETAILS = 20  # problems listed in one error response
_NAME = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.@:+=-]*$")


def _check_name(value: str) -> str:
    if len(value) > MAX_NAME:
        raise ValueError(f"a name has at most {MAX_NAME} characters, this one {len(value)}")
    if "/" in value or "\\" in value:
        raise ValueError("a name must not contain path separators ('/' or '\\')")
    if not _NAME.match(value):
        raise ValueError("a name is letters, digits and . _ - @ : + =, starting with a letter, digit or _")
    return value


LoadName = Annotated[str, AfterValidator(_check_name)]
RequestId = int | Annotated[str, Field(max_length=128)] | None


class _Request(LazyModel):
    id: RequestId = None


class Submit(_Request):
    op: Literal["submit"]
    name: LoadName
    depends_on: list[LoadName] = Field([], max_length=64)
    readiness: Readiness | None = Field(None, description="none: ready as soon as admitted")
    priority: int = Field(0, ge=-1_000_000, le=1_000_000, description="higher goes first")
    start_timeout_seconds: float | None = Field(None, gt=0, le=MAX_START_TIMEOUT)
    detach: bool = Field(False, description="once admitted, the load outlives this connection")
    semaphore: Annotated[str, Field(pattern=r"^[A-Za-z0-9][A-Za-z0-9._:-]{0,252}$")] | None = Field(
        None, description="a cluster semaphore (coordination.semaphores) to hold a slot of while starting"
    )

    @field_validator("depends_on")
    @classmethod
    def _distinct(cls, value: list[str]) -> list[str]:
        if len(set(value)) != len(value):
            raise ValueError("a dependency is listed twice")
        return value


class Wait(_Request):
    op: Literal["wait"]
    name: LoadName
    until: Literal["starting", "ready"] = "starting"


class Ready(_Request):
    op: Literal["ready"]
    name: LoadName


class Release(_Request):
    op: Literal["release"]
    name: LoadName


class Cancel(_Request):
    op: Literal["cancel"]
    name: LoadName


class Attach(_Request):
    op: Literal["attach"]
    name: LoadName


class StatusRequest(_Request):
    op: Literal["status"]
    name: LoadName | None = None


class Ping(_Request):
    op: Literal["ping"]


Request = Submit | Wait | Ready | Release | Cancel | Attach | StatusRequest | Ping


@functools.cache
def request_adapter() -> TypeAdapter[Request]:
    """The requests' validator, built on first use (the gate warms it off the event loop when it starts serving)."""
    return TypeAdapter(Annotated[Request, Field(discriminator="op")])


OPS = ("submit", "wait", "ready", "release", "cancel", "attach", "status", "ping")


class ProtocolError(NodeguardError):
    """A request that cannot be understood; answered with ``invalid`` and counted."""

    def __init__(self, message: str, request_id: RequestId = None, details: list[str] | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.request_id = request_id
        self.details = details or []


def parse_request(line: bytes) -> Request:
    try:
        data = json.loads(line)
    except (ValueError, RecursionError) as exc:
        raise ProtocolError(f"not a JSON object: {exc}") from None
    if not isinstance(data, dict):
        raise ProtocolError("expected one JSON object per line")
    raw_id = data.get("id")
    request_id: RequestId = raw_id if isinstance(raw_id, int | str) and not isinstance(raw_id, bool) else None
    if isinstance(request_id, str) and len(request_id) > 128:
        request_id = None
    op = data.get("op")
    if op not in OPS:
        raise ProtocolError(f"op: expected one of {', '.join(OPS)}, got {bounded_json(op, 60)}", request_id)
    try:
        return request_adapter().validate_python(data, strict=True)
    except ValidationError as exc:
        errors = exc.errors(include_url=False)
        details = [_render(error) for error in errors[:MAX_DETAILS]]
        if len(errors) > MAX_DETAILS:
            details.append(f"... and {len(errors) - MAX_DETAILS} more")
        raise ProtocolError(f"invalid {op} request: " + "; ".join(details), request_id, details) from None


def _render(error: Any) -> str:
    # The first location is the op (the union's tag), and a readiness object's type
    # follows "readiness": tags, not keys. Validators add their own names.
    raw = error["loc"][1:]
    loc = [
        p
        for i, p in enumerate(raw)
        if isinstance(p, int) or not (p.startswith(("function-", "union[")) or (i > 0 and raw[i - 1] == "readiness"))
    ]
    kind = error["type"]
    message = {"extra_forbidden": "unknown field", "missing": "required field missing"}.get(kind, error["msg"])
    message = message.removeprefix("Value error, ")
    line = f"{format_location(loc)}: {message}"
    if kind != "missing":
        line += f", got {bounded_json(error['input'])}"  # the input is the client's: any depth, any size
    return line


def ok(request_id: RequestId, **fields: Any) -> dict[str, Any]:
    return {"id": request_id, "ok": True, **fields}


def error(request_id: RequestId, code: str, message: str, details: list[str] | None = None) -> dict[str, Any]:
    body: dict[str, Any] = {"code": code, "message": message}
    if details:
        body["details"] = details
    return {"id": request_id, "ok": False, "error": body}


def encode(message: dict[str, Any]) -> bytes:
    return json.dumps(message, separators=(",", ":")).encode() + b"\n"
