"""A small async client for the API server and the kubelet: bearer token, cluster CA, deadlines.

httpx does the HTTP. This module adds what the service account needs: the
token re-read as the kubelet rotates it (projected tokens expire within hours),
TLS verified against the configured CA only (no system store, no environment
proxies), one deadline for the whole request, a cap on the body, JSON decoded
off the event loop when large, and errors that carry the Kubernetes Status.
"""

from __future__ import annotations

import asyncio
import json
import os
import ssl
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import httpx

from nodeguard import __version__
from nodeguard.errors import NodeguardError

USER_AGENT = f"nodeguard/{__version__}"
MAX_BODY_BYTES = 256 << 20  # a PodList of a full node is a few MiB
_DECODE_INLINE_BYTES = 64 << 10  # larger bodies are decoded in a thread: json.loads of MiBs takes tens of ms


class KubeError(NodeguardError):
    """A request that did not succeed: ``status`` is None when no HTTP answer came (or none was sent)."""

    def __init__(self, message: str, status: int | None = None, reason: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.reason = reason


@dataclass(frozen=True, slots=True)
class Reply:
    status: int
    body: Any  # decoded JSON; None when the body was empty or not JSON


def status_message(body: Any) -> tuple[str | None, str | None]:
    """(reason, message) of a ``kind: Status`` body, where it is one."""
    if isinstance(body, Mapping) and body.get("kind") == "Status":
        reason, message = body.get("reason"), body.get("message")
        return (reason if isinstance(reason, str) else None, message if isinstance(message, str) else None)
    return None, None


def raise_for(reply: Reply, what: str) -> None:
    if 200 <= reply.status < 300:
        return
    reason, message = status_message(reply.body)
    raise KubeError(f"{what}: HTTP {reply.status}" + (f" {reason}: {message}" if message else ""), reply.status, reason)


def _file_key(path: str) -> tuple[int, int, int]:
    # stat follows the ..data symlink that a projected volume swaps atomically.
    st = os.stat(path)
    return (st.st_ino, st.st_mtime_ns, st.st_size)


class KubeClient:
    """Requests to one server (the API server or one kubelet) as the service account."""

    def __init__(
        self,
        base_url: str,
        *,
        token_path: str | None,
        ca_path: str | None,
        timeout_seconds: float,
        transport: httpx.AsyncBaseTransport | None = None,
    ) -> None:
        self.base_url = base_url.rstrip("/")
        self.secure = self.base_url.startswith("https://")
        # Plain http is for `kubectl proxy` on loopback: never send the token in clear text.
        self.token_path = token_path if self.secure else None
        self.ca_path = ca_path if self.secure else None
        self.timeout = timeout_seconds
        self._transport = transport
        self._token: str | None = None
        self._token_key: tuple[int, int, int] | None = None
        self._client: httpx.AsyncClient | None = None
        self._ca_key: tuple[int, int, int] | None = None

    # --- credentials ------------------------------------------------------------

    def _read_token(self) -> str | None:
        if self.token_path is None:
            return None
        try:
            key = _file_key(self.token_path)
            if key != self._token_key or self._token is None:
                with open(self.token_path, encoding="utf-8") as handle:
                    token = handle.read().strip()
                if not token:
                    raise KubeError(f"token file {self.token_path} is empty")
                self._token, self._token_key = token, key
        except (OSError, UnicodeDecodeError) as exc:
            raise KubeError(f"cannot read the token {self.token_path}: {exc}") from None
        return self._token

    async def _http(self) -> httpx.AsyncClient:
        """The connection pool; rebuilt when the CA bundle changes."""
        key = None
        if self.ca_path is not None:
            try:
                key = _file_key(self.ca_path)
            except OSError as exc:
                raise KubeError(f"cannot read the CA {self.ca_path}: {exc}") from None
        if self._client is not None and key == self._ca_key:
            return self._client
        verify: ssl.SSLContext | bool = True
        if self.ca_path is not None:
            try:
                # Only this CA: a server whose certificate another CA signed is refused.
                verify = ssl.create_default_context(cafile=self.ca_path)
            except (OSError, ssl.SSLError, ValueError) as exc:
                raise KubeError(f"cannot load the CA {self.ca_path}: {exc}") from None
        old, self._client = self._client, None
        if old is not None:
            await old.aclose()
        self._client = httpx.AsyncClient(
            base_url=self.base_url,
            verify=verify,
            timeout=self.timeout,
            trust_env=False,  # no HTTPS_PROXY or SSL_CERT_FILE from the environment: only the configured CA
            headers={"User-Agent": USER_AGENT, "Accept": "application/json"},
            transport=self._transport,
        )
        self._ca_key = key
        return self._client

    # --- requests ---------------------------------------------------------------

    async def request(
        self,
        method: str,
        path: str,
        *,
        params: Mapping[str, str] | None = None,
        body: Any = None,
        max_bytes: int = MAX_BODY_BYTES,
    ) -> Reply:
        """One request within ``timeout_seconds`` in all; KubeError when no HTTP answer came."""
        token = self._read_token()
        client = await self._http()
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        content = None
        if body is not None:
            content = json.dumps(body).encode()
            headers["Content-Type"] = "application/json"
        try:
            # One deadline for the whole exchange: httpx's timeouts are per read, and
            # a server that trickles bytes would otherwise hold the request forever.
            async with asyncio.timeout(self.timeout):
                async with client.stream(method, path, params=params, content=content, headers=headers) as response:
                    chunks, size = [], 0
                    async for chunk in response.aiter_bytes():
                        size += len(chunk)
                        if size > max_bytes:
                            raise KubeError(f"{method} {path}: body over {max_bytes} bytes", response.status_code)
                        chunks.append(chunk)
                    status = response.status_code
        except TimeoutError:
            raise KubeError(f"{method} {path}: no answer within {self.timeout:g}s") from None
        except (httpx.HTTPError, httpx.InvalidURL, httpx.StreamError, OSError) as exc:
            raise KubeError(f"{method} {path}: {type(exc).__name__}: {exc}") from None
        data = b"".join(chunks)
        return Reply(status, await decode(data))

    async def get_json(self, path: str, params: Mapping[str, str] | None = None) -> Any:
        reply = await self.request("GET", path, params=params)
        raise_for(reply, f"GET {path}")
        if reply.body is None:
            raise KubeError(f"GET {path}: the answer is not JSON", reply.status)
        return reply.body

    async def aclose(self) -> None:
        if self._client is not None:
            await self._client.aclose()
            self._client = None


async def decode(data: bytes) -> Any:
    """JSON, or None for an empty or malformed body; big bodies off the event loop."""
    if not data:
        return None
    try:
        if len(data) <= _DECODE_INLINE_BYTES:
            return json.loads(data)
        return await asyncio.to_thread(json.loads, data)
    except (ValueError, RecursionError):
        return None
