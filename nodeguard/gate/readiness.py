"""How a load proves it is ready: the client says so (notify), or the daemon probes it (exec, HTTP GET, TCP).

Probes are async: a TCP connect or an HTTP request with a timeout, or a
subprocess run as the user who submitted the load (never as the daemon's root:
any allowed peer could otherwise run commands as root).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import sys
from collections.abc import Callable
from typing import Annotated, Any, Literal
from urllib.parse import urlsplit

from pydantic import Field, field_validator

from nodeguard.config_base import LazyModel
from nodeguard.netaddr import split_host_port


class _Timing(LazyModel):
    period_seconds: float = Field(1.0, ge=0.05, le=3600, description="from one probe to the next")
    timeout_seconds: float = Field(1.0, gt=0, le=3600, description="one probe fails after this")
    success_threshold: int = Field(1, ge=1, le=100, description="consecutive successes that make the load ready")


class NotifyReadiness(LazyModel):
    """The client reports ``ready`` itself."""

    type: Literal["notify"]


class ExecProbe(_Timing):
    """Ready when the command exits 0."""

    type: Literal["exec"]
    command: list[Annotated[str, Field(min_length=1, max_length=4096)]] = Field(min_length=1, max_length=256)

    @field_validator("command")
    @classmethod
    def _no_nul(cls, value: list[str]) -> list[str]:
        if any("\0" in arg for arg in value):
            raise ValueError("arguments must not contain NUL")
        return value


class HttpProbe(_Timing):
    """Ready when a GET of ``url`` answers 200-399."""

    type: Literal["http"]
    url: str = Field(max_length=2048)

    @field_validator("url")
    @classmethod
    def _http_url(cls, value: str) -> str:
        try:
            parts = urlsplit(value)
            port = parts.port
        except ValueError as exc:
            raise ValueError(f"not a valid URL: {exc}") from None
        if parts.scheme != "http":
            raise ValueError("expected an http:// URL")
        if not parts.hostname:
            raise ValueError("the URL has no host")
        if port == 0:
            raise ValueError("port 0 is not a port")
        if any(c in value for c in "\r\n\0 "):
            raise ValueError("the URL contains whitespace or control characters")
        return value


class TcpProbe(_Timing):
    """Ready when a TCP connection to ``address`` (HOST:PORT) succeeds."""

    type: Literal["tcp"]
    address: str = Field(max_length=300)

    @field_validator("address")
    @classmethod
    def _host_port(cls, value: str) -> str:
        split_host_port(value)
        return value


Probe = ExecProbe | HttpProbe | TcpProbe
Readiness = Annotated[NotifyReadiness | ExecProbe | HttpProbe | TcpProbe, Field(discriminator="type")]


def dump_readiness(readiness: Readiness | None) -> dict[str, Any] | None:
    return None if readiness is None else readiness.model_dump(by_alias=True, mode="json")


def describe(readiness: Readiness | None) -> str:
    if readiness is None:
        return "none (ready once admitted)"
    if isinstance(readiness, NotifyReadiness):
        return "notify"
    if isinstance(readiness, ExecProbe):
        return "exec " + " ".join(readiness.command)
    if isinstance(readiness, HttpProbe):
        return f"http {readiness.url}"
    return f"tcp {readiness.address}"


# --- probing ---------------------------------------------------------------------


async def probe_once(probe: Probe, uid: int, gid: int) -> tuple[bool, str]:
    """One probe: (success, what happened)."""
    if isinstance(probe, HttpProbe):
        return await _http_once(probe)
    try:
        if isinstance(probe, TcpProbe):
            return await asyncio.wait_for(_tcp(probe), probe.timeout_seconds)
        return await _exec(probe, uid, gid)
    except TimeoutError:
        return False, f"timed out after {probe.timeout_seconds:g}s"
    except OSError as exc:
        return False, exc.strerror or str(exc)


def _import_httpx() -> None:
    import httpx  # noqa: F401


async def _http_once(probe: HttpProbe) -> tuple[bool, str]:
    # Only a daemon whose gate runs HTTP probes loads the HTTP client, the first time off the event loop
    # (about 0.1 s of imports): ticks and the gate go on meanwhile.
    if "httpx" not in sys.modules:
        await asyncio.to_thread(_import_httpx)
    import httpx

    try:
        return await asyncio.wait_for(_http(probe), probe.timeout_seconds)
    except (TimeoutError, httpx.TimeoutException):
        return False, f"timed out after {probe.timeout_seconds:g}s"
    except OSError as exc:
        return False, exc.strerror or str(exc)
    except httpx.HTTPError as exc:
        return False, f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__


async def _tcp(probe: TcpProbe) -> tuple[bool, str]:
    host, port = split_host_port(probe.address)
    _, writer = await asyncio.open_connection(host, port)
    writer.close()
    with contextlib.suppress(OSError):
        await writer.wait_closed()
    return True, "connected"


async def _http(probe: HttpProbe) -> tuple[bool, str]:
    import httpx

    # As kubelet's HTTP probes: no redirects followed (3xx is ready), a certificate is not verified, no proxy.
    async with httpx.AsyncClient(
        timeout=probe.timeout_seconds, verify=False, trust_env=False, headers={"User-Agent": "nodeguard-gate"}
    ) as client:
        response = await client.get(probe.url)
    code = response.status_code
    return 200 <= code < 400, f"HTTP {code}"


async def _exec(probe: ExecProbe, uid: int, gid: int) -> tuple[bool, str]:
    # Only a privileged daemon can (and must) drop to the peer's ids.
    as_peer: dict[str, Any] = {}
    if os.geteuid() == 0 and uid != 0:
        as_peer = {"user": uid, "group": gid, "extra_groups": []}
    elif os.geteuid() != uid and os.geteuid() != 0:
        return False, f"cannot run a probe as uid {uid}"
    proc = await asyncio.create_subprocess_exec(
        *probe.command,
        stdin=asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.DEVNULL,
        stderr=asyncio.subprocess.DEVNULL,
        start_new_session=True,  # a process group: a timed-out probe is killed with its children
        cwd="/",
        **as_peer,
    )
    try:
        code = await asyncio.wait_for(proc.wait(), probe.timeout_seconds)
    except (TimeoutError, asyncio.CancelledError):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        await asyncio.shield(proc.wait())
        raise
    return code == 0, f"exit status {code}"


async def wait_until_ready(probe: Probe, uid: int, gid: int, report: Callable[[str], None]) -> None:
    """Probe every period until ``successThreshold`` probes in a row succeed; ``report`` sees each result."""
    streak = 0
    loop = asyncio.get_running_loop()
    while True:
        started = loop.time()
        ok, detail = await probe_once(probe, uid, gid)
        streak = streak + 1 if ok else 0
        report(f"{'ok' if ok else 'failed'}: {detail}")
        if streak >= probe.success_threshold:
            return
        await asyncio.sleep(max(0.0, started + probe.period_seconds - loop.time()))
