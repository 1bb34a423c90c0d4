"""The shipped broker (packaging/kubernetes/broker/) run for real, as rendered by `kubectl kustomize`: its init
container's script makes the password file from the Secret, the real mosquitto loads the rendered mosquitto.conf,
a nodeguard node with the shipped ConfigMap's coordination settings joins through it and takes a cluster slot, and
other credentials are refused.

The pod's volumes are directories here: a ConfigMap's or a Secret's keys become files in its directory (as kubelet
mounts them) and an emptyDir an empty one; each container's paths are mapped onto them by its volumeMounts. Only
what cannot be the same outside a cluster is changed: the listener is a free loopback port instead of the pod's
1883, and the broker's and the node's addresses are 127.0.0.1.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from nodeguard.coordination.service import CoordinationService
from nodeguard.coordination.settings import CoordinationSettings
from tests.packaging.kustomize import BROKER_PASSWORD
from tests.packaging.shipped_broker import ShippedBroker, coordination_section, started_broker


@pytest.fixture
def shipped_broker(tmp_path: Path) -> Iterator[ShippedBroker]:
    with started_broker(tmp_path) as broker:
        yield broker


def node_settings(broker: ShippedBroker, tmp_path: Path, **override: Any) -> CoordinationSettings:
    """The ConfigMap's coordination section turned on, as an operator does, with the broker at this test's address
    and the password file where the DaemonSet mounts the broker's Secret."""
    return CoordinationSettings.model_validate(coordination_section(broker, tmp_path, **override))


@contextlib.asynccontextmanager
async def running(service: CoordinationService) -> AsyncIterator[CoordinationService]:
    task = asyncio.create_task(service.run())
    try:
        yield service
    finally:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task


async def wait_for(predicate: Callable[[], bool], timeout: float) -> bool:
    deadline = asyncio.get_running_loop().time() + timeout
    while asyncio.get_running_loop().time() < deadline:
        if predicate():
            return True
        await asyncio.sleep(0.05)
    return bool(predicate())


async def test_a_node_with_the_configmaps_settings_joins_through_the_shipped_broker(
    shipped_broker: ShippedBroker, tmp_path: Path
) -> None:
    """The init container's password file is hashed for the nodes' user, mosquitto starts on the rendered config,
    and the ConfigMap's seed node logs in with the Secret's password and admits a load on its cluster semaphore."""
    user, _, hashed = shipped_broker.password_file().read_text(encoding="utf-8").strip().partition(":")
    assert user == "nodeguard" and hashed.startswith("$") and BROKER_PASSWORD not in hashed
    settings = node_settings(shipped_broker, tmp_path)
    assert settings.broker.username == user
    [seed, *_] = settings.genesis_seeds
    semaphore = next(iter(settings.semaphores))
    async with running(CoordinationService(settings, seed)) as service:
        assert await wait_for(lambda: service.status()["admitting"], 15), service.status()
        await asyncio.wait_for(service.acquire(semaphore, "load-1"), 10)
        assert service.status()["semaphores"][semaphore]["held"] == 1
        service.release(semaphore, "load-1")
    assert shipped_broker.proc is not None and shipped_broker.proc.poll() is None
    assert "Error" not in shipped_broker.log.read_text(encoding="utf-8")


@pytest.mark.parametrize("login", ["anonymous", "wrong-password"])
async def test_the_shipped_broker_refuses_other_credentials(
    shipped_broker: ShippedBroker, tmp_path: Path, login: str
) -> None:
    """A node without credentials, or with a password other than the Secret's, is refused and never admits."""
    if login == "anonymous":
        settings = node_settings(shipped_broker, tmp_path, username=None, passwordFile=None)
    else:
        wrong = tmp_path / "wrong-password"
        wrong.write_text("not-the-secret\n", encoding="utf-8")
        settings = node_settings(shipped_broker, tmp_path, passwordFile=str(wrong))
    async with running(CoordinationService(settings, settings.genesis_seeds[0])) as service:
        assert await wait_for(lambda: service.status()["broker"]["refused"] >= 1, 15), service.status()
        assert not service.status()["admitting"]


def test_the_init_container_refuses_an_empty_password(tmp_path: Path) -> None:
    """A Secret whose password is empty stops the init container with a message, so mosquitto never starts
    with a password file nobody can log in with."""
    broker = ShippedBroker(tmp_path)
    (broker.secret / "password").write_text("\n", encoding="utf-8")
    made = broker.run_init()
    assert made.returncode != 0
    assert "no password" in made.stderr
