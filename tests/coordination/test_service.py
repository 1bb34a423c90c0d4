"""The CoordinationService in-process against a real mosquitto: acquire/release, cancellation, bad settings."""

from __future__ import annotations

import asyncio
import contextlib
import json
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from structlog.testing import capture_logs

from nodeguard.coordination.service import CoordinationService
from nodeguard.coordination.settings import CoordinationError, CoordinationSettings
from tests.coordination.harness import REPO
from tests.support.broker import Broker
from tests.support.cluster import coordination_config
from tests.support.poll import wait_until_async

SEM = "prepare"


def settings(port: int, tmp_path: Path, **broker: Any) -> CoordinationSettings:
    """A one-seed cluster ("solo" holds the cap at genesis)."""
    config = coordination_config(port, ["solo"], {SEM: 1}, tmp_path / "state")
    config["broker"].update(broker)
    return CoordinationSettings.model_validate(config)


def waiters(service: CoordinationService) -> int:
    """How many acquires wait on the semaphore now."""
    return int(service.status()["semaphores"][SEM]["waiting"])


@contextlib.asynccontextmanager
async def running(service: CoordinationService) -> AsyncIterator[CoordinationService]:
    task = asyncio.create_task(service.run())
    try:
        await wait_until_async(lambda: service.status()["admitting"], 10, "the service admitting")
        yield service
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


async def test_cancelled_waiter_never_keeps_a_slot(broker: Broker, tmp_path: Path) -> None:
    """A waiter cancelled while waiting, or right after being admitted, gives its slot back."""
    async with running(CoordinationService(settings(broker.port, tmp_path), "solo")) as service:
        await asyncio.wait_for(service.acquire(SEM, "first"), 5)
        waiting = asyncio.create_task(service.acquire(SEM, "cancelled-waiting"))
        await wait_until_async(lambda: waiters(service) == 1, 5, "the waiter queued")
        waiting.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await waiting
        admitted = asyncio.create_task(service.acquire(SEM, "cancelled-admitted"))
        await wait_until_async(lambda: waiters(service) == 1, 5, "the second waiter queued")
        service.release(SEM, "first")  # admits the waiter ...
        admitted.cancel()  # ... which is cancelled before it runs again
        with contextlib.suppress(asyncio.CancelledError):
            await admitted
        assert service.status()["semaphores"][SEM]["held"] == 0
        await asyncio.wait_for(service.acquire(SEM, "last"), 2)  # the only slot is free again
        assert service.status()["semaphores"][SEM] | {"held": 1, "waiting": 0} == service.status()["semaphores"][SEM]


async def test_unknown_semaphore_is_an_error(broker: Broker, tmp_path: Path) -> None:
    """Acquiring a semaphore that is not configured fails at once, naming the configured ones."""
    async with running(CoordinationService(settings(broker.port, tmp_path), "solo")) as service:
        with pytest.raises(CoordinationError, match=r"unknown cluster semaphore 'nope'.*prepare"):
            await service.acquire("nope", "x")


async def test_refused_credentials_are_logged_naming_the_settings(tmp_path: Path) -> None:
    """A broker that refuses the login leaves the node fenced, counted and logging which settings to check."""
    broker = Broker(tmp_path, anonymous=False)
    broker.start()
    try:
        secret = tmp_path / "password"
        secret.write_text("wrong\n")
        service = CoordinationService(
            settings(broker.port, tmp_path, username="nodeguard", passwordFile=str(secret)), "solo"
        )
        with capture_logs() as logs:
            task = asyncio.create_task(service.run())
            await wait_until_async(lambda: service.status()["broker"]["refused"], 5, "the login refused")
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        assert service.status()["broker"]["refused"] >= 1
        assert not service.status()["admitting"]
        assert any("coordination.broker.username" in entry["event"] for entry in logs)
    finally:
        broker.stop()


@pytest.mark.parametrize(
    ("broker", "setting"),
    [
        ({"tls": {"caFile": "/nonexistent/ca.pem"}}, "coordination.broker.tls.caFile"),
        (
            {"tls": {"certFile": "/nonexistent/c.pem", "keyFile": "/nonexistent/k.pem"}},
            "coordination.broker.tls.certFile",
        ),
        ({"passwordFile": "/nonexistent/password"}, "coordination.broker.passwordFile"),
        ({"passwordEnv": "NODEGUARD_TEST_UNSET_VARIABLE"}, "coordination.broker.passwordEnv"),
    ],
)
def test_bad_tls_files_and_credentials_stop_the_start(tmp_path: Path, broker: dict[str, Any], setting: str) -> None:
    """Unreadable TLS files or password sources fail at construction with the setting named."""
    with pytest.raises(CoordinationError, match=setting.replace(".", r"\.")):
        CoordinationService(settings(1883, tmp_path, **broker), "solo")


def test_runner_exits_with_the_setting_named(tmp_path: Path) -> None:
    """The standalone runner reports a bad TLS file on stderr and exits 2 before connecting."""
    config = coordination_config(1883, ["solo"], {SEM: 1}, tmp_path / "state")
    config["broker"]["tls"] = {"caFile": str(tmp_path / "missing.pem")}
    path = tmp_path / "c.json"
    path.write_text(json.dumps(config))
    result = subprocess.run(
        [sys.executable, "-m", "tests.coordination.node_process", "--config", str(path), "--node", "solo"],
        capture_output=True,
        text=True,
        cwd=REPO,
        timeout=30,
    )
    assert result.returncode == 2
    assert "coordination.broker.tls.caFile" in result.stderr


async def test_a_node_not_in_any_list_joins_and_is_served(broker: Broker, tmp_path: Path) -> None:
    """A node named nowhere in the config joins a running cluster with no slots and gets one from the seed's bank."""
    seed = CoordinationService(settings(broker.port, tmp_path / "seed"), "solo")
    async with running(seed):
        stranger = CoordinationService(settings(broker.port, tmp_path / "stranger"), "stranger")
        async with running(stranger):
            assert stranger.status()["semaphores"][SEM]["allotment"] == 0
            await asyncio.wait_for(stranger.acquire(SEM, "x"), 10)
            status = stranger.status()
            assert status["semaphores"][SEM] | {"allotment": 1, "held": 1} == status["semaphores"][SEM]
            assert status["bank"] == "solo"
            stranger.release(SEM, "x")


async def test_caps_change_live_on_reload(broker: Broker, tmp_path: Path) -> None:
    """A reload that raises the cap adds slots at once; one that lowers it retires them without revoking a holder."""
    async with running(CoordinationService(settings(broker.port, tmp_path), "solo")) as service:
        await asyncio.wait_for(service.acquire(SEM, "first"), 5)
        raised = settings(broker.port, tmp_path).model_copy(update={"semaphores": {SEM: 3}})
        service.reconfigure(raised)
        await asyncio.wait_for(asyncio.gather(service.acquire(SEM, "second"), service.acquire(SEM, "third")), 5)
        assert service.status()["semaphores"][SEM]["held"] == 3
        service.reconfigure(raised.model_copy(update={"semaphores": {SEM: 1}}))
        assert service.status()["semaphores"][SEM]["held"] == 3  # nothing revoked
        waiting = asyncio.create_task(service.acquire(SEM, "fourth"))
        await wait_until_async(lambda: waiters(service) == 1, 5, "the fourth waiting")
        service.release(SEM, "first")
        service.release(SEM, "second")  # releases settle at once (this node is the bank)
        status = service.status()["semaphores"][SEM]
        assert (status["held"], status["waiting"], status["allotment"]) == (1, 1, 1)  # two retired, none admitted
        service.release(SEM, "third")
        await asyncio.wait_for(waiting, 5)
        status = service.status()["semaphores"][SEM]
        assert status["held"] == 1 and status["allotment"] == 1 and status["appliedCap"] == 1


def test_a_connection_closed_before_connack_fails_at_once_not_after_the_connect_timeout() -> None:
    """A listener that accepts and closes (a broker going down, a proxy with no upstream) is a failed attempt
    right away, so reconnecting does not stall for the connect timeout."""
    import socket
    import threading

    import aiomqtt

    from nodeguard.coordination.mqtt_link import _Client

    server = socket.create_server(("127.0.0.1", 0))

    def accept_and_close() -> None:
        with contextlib.suppress(OSError):
            while True:
                conn, _ = server.accept()
                conn.close()

    threading.Thread(target=accept_and_close, daemon=True).start()

    async def attempt() -> str:
        client = _Client("127.0.0.1", server.getsockname()[1], timeout=600, protocol=aiomqtt.ProtocolVersion.V5)
        with pytest.raises(aiomqtt.MqttError) as caught:
            # Far below the 600 s connect timeout: only a failure on the closed socket ends it in time.
            await asyncio.wait_for(client.__aenter__(), 30)
        return str(caught.value)

    try:
        assert "closed before CONNACK" in asyncio.run(attempt())
    finally:
        server.close()
