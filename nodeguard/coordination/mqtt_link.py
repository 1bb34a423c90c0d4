"""The MQTT link: the only module that talks to the broker (and imports aiomqtt).

One connection at a time, MQTT v5, client id = node name, ``cleanStart`` false
with a session that outlives the will delay (a quick reconnect takes the session
over and cancels the pending will). Reconnects with jittered exponential
backoff and subscribes again on every connection. A fresh client per
connection, so nothing queued on a dead connection is sent later out of order.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import random
import socket
import ssl
import time
from dataclasses import dataclass, field
from typing import Any, Protocol

import aiomqtt
import paho.mqtt.client as paho
from aiomqtt.exceptions import MqttConnectError
from paho.mqtt.packettypes import PacketTypes
from paho.mqtt.properties import Properties
from paho.mqtt.reasoncodes import ReasonCode
from paho.mqtt.subscribeoptions import SubscribeOptions

from nodeguard.backoff import doubling
from nodeguard.coordination.settings import BrokerSettings
from nodeguard.coordination.topics import Malformed, decode_sync, encode_sync
from nodeguard.errors import NodeguardError
from nodeguard.log import RateLimiter, get_logger

log = get_logger("nodeguard.coordination.mqtt")

AUTH_CODES = {0x04, 0x05, 0x86, 0x87, 0x8C}  # v3 bad credentials / not authorised, v5 the same and bad method


class LinkDown(NodeguardError):
    """Not connected, or the connection broke during the call."""


@dataclass(frozen=True)
class WillSpec:
    topic: str
    payload: bytes
    delay: int  # seconds
    session_expiry: int  # seconds, >= delay


@dataclass(frozen=True)
class Incoming:
    topic: str
    payload: bytes
    retain: bool


class Handler(Protocol):
    async def before_connect(self) -> WillSpec: ...

    def on_connected(self, session_present: bool) -> None: ...

    def on_message(self, message: Incoming) -> None: ...

    def on_disconnected(self, reason: str) -> None: ...


@dataclass
class LinkStats:
    connects: int = 0
    disconnects: int = 0
    failed_attempts: int = 0
    refused: int = 0
    published: int = 0
    received: int = 0
    last_error: str = ""
    connected_since: float | None = None  # monotonic
    disconnected_since: float | None = field(default_factory=time.monotonic)


class _Client(aiomqtt.Client):
    """aiomqtt's client, keeping the CONNACK's session-present flag, and failing a connection closed
    before its CONNACK at once (aiomqtt 2.5 would wait for the whole connect timeout)."""

    session_present = False

    def _on_connect(
        self,
        client: paho.Client,
        userdata: Any,
        flags: paho.ConnectFlags,
        reason_code: ReasonCode,
        properties: Properties | None = None,
    ) -> None:
        self.session_present = bool(flags.session_present)
        super()._on_connect(client, userdata, flags, reason_code, properties)

    def _on_disconnect(
        self,
        client: paho.Client,
        userdata: Any,
        flags: paho.DisconnectFlags,
        reason_code: ReasonCode,
        properties: Properties | None = None,
    ) -> None:
        if not self._connected.done():
            self._connected.set_exception(aiomqtt.MqttError(f"connection closed before CONNACK ({reason_code})"))
            self._connected.exception()  # retrieved: nobody may be awaiting it any more
            return
        super()._on_disconnect(client, userdata, flags, reason_code, properties)


def _props(packet_type: int) -> Properties:
    return Properties(packet_type)  # type: ignore[no-untyped-call]  # paho leaves it untyped


def raise_if_cancelling() -> None:
    """Python 3.11's wait_for (used by aiomqtt) can swallow a cancellation that races a reply:
    long-running loops check for a pending cancel request themselves."""
    task = asyncio.current_task()
    if task is not None and task.cancelling():
        raise asyncio.CancelledError


def backoff(attempt: int, low: float, high: float, rng: random.Random) -> float:
    """Exponential with "equal jitter": half fixed, half random, capped (``attempt`` 0 is the first retry)."""
    ceiling = doubling(low, high, attempt + 1)
    return ceiling / 2 + rng.uniform(0.0, ceiling / 2)


class MqttLink:
    def __init__(
        self,
        settings: BrokerSettings,
        client_id: str,
        subscriptions: list[str],
        sync_topic: str,
        handler: Handler,
        *,
        password: str | None = None,
        tls: ssl.SSLContext | None = None,
        rng: random.Random | None = None,
    ) -> None:
        self.settings = settings
        self.client_id = client_id
        self.subscriptions = subscriptions
        self.sync_topic = sync_topic
        self.handler = handler
        self.password = password
        self.tls = tls
        self.rng = rng or random.Random()
        self.stats = LinkStats()
        self.conn = 0  # counts connections; a reply on an older one proves nothing about this one
        self.extra: list[str] = []  # subscriptions beyond the fixed ones (the bank's), kept across reconnects
        self._client: _Client | None = None
        self._nonces = itertools.count(1)
        self._barriers: dict[int, asyncio.Future[None]] = {}
        self._warn = RateLimiter(60.0)

    @property
    def connected(self) -> bool:
        return self._client is not None

    # --- the connection loop ------------------------------------------------------------

    async def run(self) -> None:
        attempt = 0
        while True:
            will = await self.handler.before_connect()
            client = self._new_client(will)
            try:
                await client.__aenter__()
            except aiomqtt.MqttError as exc:
                self._failed(exc)
            else:
                attempt = 0
                reason = await self._session(client)
                self.handler.on_disconnected(reason)
            raise_if_cancelling()
            delay = backoff(attempt, self.settings.reconnect_min_seconds, self.settings.reconnect_max_seconds, self.rng)
            attempt += 1
            await asyncio.sleep(delay)

    def _new_client(self, will: WillSpec) -> _Client:
        will_props = _props(PacketTypes.WILLMESSAGE)
        will_props.WillDelayInterval = will.delay
        connect_props = _props(PacketTypes.CONNECT)
        connect_props.SessionExpiryInterval = will.session_expiry
        return _Client(
            self.settings.host,
            self.settings.port,
            username=self.settings.username,
            password=self.password,
            identifier=self.client_id,
            protocol=aiomqtt.ProtocolVersion.V5,
            will=aiomqtt.Will(will.topic, will.payload, qos=1, retain=True, properties=will_props),
            clean_start=False,
            keepalive=self.settings.keepalive_seconds,
            timeout=self.settings.connect_timeout_seconds,
            properties=connect_props,
            tls_context=self.tls,
            # Small messages one after the other: Nagle would hold each behind the last one's ACK (40 ms).
            socket_options=[(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)],
        )

    def _failed(self, exc: Exception) -> None:
        self.stats.failed_attempts += 1
        self.stats.last_error = str(exc) or type(exc).__name__
        code = getattr(exc, "rc", None)
        value = code.value if isinstance(code, ReasonCode) else code
        if isinstance(exc, MqttConnectError) and value in AUTH_CODES:
            self.stats.refused += 1
            if self._warn.allow("refused"):
                log.error(
                    "broker refused the credentials; check coordination.broker.username and passwordFile/passwordEnv"
                    " (or the client certificate, coordination.broker.tls)",
                    broker=f"{self.settings.host}:{self.settings.port}",
                    error=self.stats.last_error,
                )
        elif self._warn.allow("connect"):
            log.warning(
                "cannot reach the MQTT broker; retrying",
                broker=f"{self.settings.host}:{self.settings.port}",
                error=self.stats.last_error,
            )

    async def _session(self, client: _Client) -> str:
        self.conn += 1
        self._client = client
        self.stats.connects += 1
        self.stats.connected_since, self.stats.disconnected_since = time.monotonic(), None
        reason = "closed"
        cancelled = False
        try:
            if self.subscriptions or self.extra:
                # QoS 0 on purpose: a QoS 1 subscription in a resumed session delivers a backlog queued while
                # offline, and mosquitto 2.0 can let newer messages (the barrier's echo) overtake it, so a node
                # could rejoin before reading its own will. QoS 0 keeps nothing offline and goes out in order.
                options = SubscribeOptions(qos=0)
                extra = SubscribeOptions(qos=0, noLocal=True)
                await client.subscribe(
                    [(topic, options) for topic in self.subscriptions] + [(topic, extra) for topic in self.extra]
                )
            log.info("connected to the MQTT broker", session_present=client.session_present, conn=self.conn)
            self.handler.on_connected(client.session_present)
            async for message in client.messages:
                self.stats.received += 1
                topic = message.topic.value
                payload = message.payload if isinstance(message.payload, bytes) else b""
                if topic == self.sync_topic:
                    self._barrier_reached(payload)
                else:
                    self.handler.on_message(Incoming(topic, payload, bool(message.retain)))
        except aiomqtt.MqttError as exc:
            reason = str(exc) or type(exc).__name__
        except asyncio.CancelledError:
            cancelled = True
            raise
        finally:
            self._client = None
            self.stats.disconnects += 1
            self.stats.connected_since, self.stats.disconnected_since = None, time.monotonic()
            for future in self._barriers.values():
                if not future.done():
                    future.set_exception(LinkDown(reason))
            await self._close(client, with_will=cancelled)
        log.warning("disconnected from the MQTT broker", reason=reason)
        return reason

    async def _close(self, client: _Client, *, with_will: bool) -> None:
        # Stopping: leave with the will, so the heir adopts our slots unless we are back in time.
        if with_will:
            code = ReasonCode(PacketTypes.DISCONNECT, "Disconnect with will message")
            with contextlib.suppress(Exception, asyncio.CancelledError):  # best effort: else the broker times us out
                client._client.disconnect(reasoncode=code)
                await asyncio.wait_for(asyncio.shield(client._disconnected), timeout=1.0)
        with contextlib.suppress(Exception, asyncio.CancelledError):
            await asyncio.wait_for(client.__aexit__(None, None, None), timeout=2.0)

    # --- operations -----------------------------------------------------------------------

    def reconnect(self) -> None:
        """Leave the current connection (a clean DISCONNECT); the connection loop makes a new one."""
        client = self._client
        if client is not None:
            client._client.disconnect()

    async def publish(self, topic: str, payload: bytes, *, retain: bool = False, expiry: int | None = None) -> int:
        """QoS 1; returns once the broker acknowledged it, with the connection it went on."""
        client, conn = self._client, self.conn
        if client is None:
            raise LinkDown("not connected")
        properties = None
        if expiry is not None:
            properties = _props(PacketTypes.PUBLISH)
            properties.MessageExpiryInterval = expiry
        try:
            await client.publish(topic, payload, qos=1, retain=retain, properties=properties)
        except aiomqtt.MqttError as exc:
            raise LinkDown(str(exc)) from None
        self.stats.published += 1
        return conn

    async def barrier(self, timeout: float) -> None:
        """Returns once everything the broker queued for us before now has been handled."""
        client = self._client
        if client is None:
            raise LinkDown("not connected")
        nonce = next(self._nonces)
        future: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._barriers[nonce] = future
        try:
            await self.publish(self.sync_topic, encode_sync(self.client_id, nonce))
            await asyncio.wait_for(future, timeout)
        except TimeoutError:
            raise LinkDown("barrier timed out") from None
        finally:
            self._barriers.pop(nonce, None)

    def _barrier_reached(self, payload: bytes) -> None:
        try:
            nonce = decode_sync(payload, self.client_id)
        except Malformed:
            return
        future = self._barriers.get(nonce)
        if future is not None and not future.done():
            future.set_result(None)

    async def set_extra(self, topics: list[str]) -> None:
        """Subscribe to ``topics`` beyond the fixed ones (and drop the extra ones not listed), now and on every
        later connection; with No Local (MQTT v5): this client's own messages on them are not sent back."""
        old, self.extra = self.extra, list(topics)
        client = self._client
        if client is None or old == self.extra:
            return
        try:
            gone = [t for t in old if t not in self.extra]
            new = [t for t in self.extra if t not in old]
            if gone:
                await client.unsubscribe(gone)
            if new:
                await client.subscribe([(topic, SubscribeOptions(qos=0, noLocal=True)) for topic in new])
        except aiomqtt.MqttError as exc:
            raise LinkDown(str(exc)) from None

    async def refresh(self, topic: str, timeout: float) -> None:
        """Have the broker send its retained message on ``topic`` again, and wait until it is handled."""
        client = self._client
        if client is None:
            raise LinkDown("not connected")
        try:
            await client.subscribe(topic, qos=0)
            await self.barrier(timeout)
            await client.unsubscribe(topic)
        except aiomqtt.MqttError as exc:
            raise LinkDown(str(exc)) from None
