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
import base64
import contextlib
import json
import os
import re
import signal
import subprocess
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from nodeguard.coordination.service import CoordinationService
from nodeguard.coordination.settings import CoordinationSettings
from tests.coordination.conftest import MOSQUITTO, wait_listening
from tests.packaging.kustomize import BASE, BROKER_PASSWORD, broker_copy, of_kind, render
from tests.ports import free_port

LISTENER = re.compile(r"^listener (\d+)$", re.MULTILINE)


class Volumes:
    """The pod volumes of a rendered object set, as directories under ``root``."""

    def __init__(self, root: Path, objects: list[dict[str, Any]], pod: dict[str, Any]) -> None:
        self.dirs: dict[str, Path] = {}  # volume name -> its directory
        self.secrets: dict[str, Path] = {}  # Secret name -> the directory of its volume
        for volume in pod["volumes"]:
            target = root / volume["name"]
            target.mkdir(parents=True)
            if "configMap" in volume:
                data = of_kind(objects, "ConfigMap", volume["configMap"]["name"])["data"]
                files = {key: value.encode() for key, value in data.items()}
            elif "secret" in volume:
                data = of_kind(objects, "Secret", volume["secret"]["secretName"])["data"]
                files = {key: base64.b64decode(value) for key, value in data.items()}
                self.secrets[volume["secret"]["secretName"]] = target
            else:
                assert "emptyDir" in volume, volume
                files = {}
            for key, content in files.items():
                (target / key).write_bytes(content)
            self.dirs[volume["name"]] = target

    def rewrite(self, container: dict[str, Any], text: str) -> str:
        """``text`` with every path below one of the container's mount paths moved to that volume's directory."""
        mounts = {m["mountPath"].rstrip("/"): self.dirs[m["name"]] for m in container["volumeMounts"]}
        alternatives = "|".join(re.escape(path) for path in sorted(mounts, key=len, reverse=True))
        # One pass, so that a directory put in is never rewritten again; a path starts after a space, quote or '='.
        below = re.compile(rf"(?<![^\s'\"=])({alternatives})(?=/)")
        return below.sub(lambda match: str(mounts[match.group(1)]), text)


class ShippedBroker:
    """The rendered broker pod, started here; ``secret`` is the directory of the Secret the DaemonSet mounts."""

    def __init__(self, tmp_path: Path) -> None:
        objects = render(broker_copy(tmp_path / "broker"))
        pod = of_kind(objects, "Deployment")["spec"]["template"]["spec"]
        self.volumes = Volumes(tmp_path / "volumes", objects, pod)
        self.secret_name = of_kind(objects, "Secret")["metadata"]["name"]
        self.secret = self.volumes.secrets[self.secret_name]
        [self.init] = pod["initContainers"]
        [self.mosquitto] = pod["containers"]
        self.log = tmp_path / "mosquitto.log"
        self.port = free_port()
        self.proc: subprocess.Popen[bytes] | None = None

    def run_init(self) -> subprocess.CompletedProcess[str]:
        command = self.init["command"]
        assert command[:2] == ["/bin/sh", "-c"], command
        env = {**os.environ, **{e["name"]: e["value"] for e in self.init.get("env", [])}}
        return subprocess.run(
            ["/bin/sh", "-c", self.volumes.rewrite(self.init, command[2])],
            env=env,
            capture_output=True,
            text=True,
            timeout=30,
        )

    def shipped_config(self) -> str:
        command = self.mosquitto["command"]
        assert command[0].endswith("/mosquitto") and command[1] == "-c", command
        return Path(self.volumes.rewrite(self.mosquitto, command[2])).read_text(encoding="utf-8")

    def password_file(self) -> Path:
        """Where mosquitto reads its password file (the init container's output, if the two agree)."""
        [path] = re.findall(r"^password_file (\S+)$", self.shipped_config(), re.MULTILINE)
        return Path(self.volumes.rewrite(self.mosquitto, path))

    def config(self) -> Path:
        """The rendered mosquitto.conf, its paths mapped, listening on a free loopback port instead of 1883."""
        shipped = self.shipped_config()
        [port] = LISTENER.findall(shipped)
        assert int(port) in {p["containerPort"] for p in self.mosquitto["ports"]}
        text = LISTENER.sub(f"listener {self.port} 127.0.0.1", self.volumes.rewrite(self.mosquitto, shipped))
        if os.geteuid() == 0:
            # Started as root, mosquitto drops to its own user, which may not read the test's files (the pod
            # runs it as that user from the start).
            text += "user root\n"
        path = self.log.parent / "mosquitto-test.conf"
        path.write_text(text, encoding="utf-8")
        return path

    def start(self) -> None:
        config = self.config()
        with self.log.open("wb") as out:
            self.proc = subprocess.Popen([MOSQUITTO, "-c", str(config)], stdout=out, stderr=subprocess.STDOUT)
        try:
            wait_listening(self.port)
        except AssertionError:
            raise AssertionError(f"mosquitto did not start on the rendered config:\n{self.log.read_text()}") from None

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        os.kill(self.proc.pid, signal.SIGTERM)
        try:
            self.proc.wait(5)
        except subprocess.TimeoutExpired:
            os.kill(self.proc.pid, signal.SIGKILL)
            self.proc.wait(5)


@contextlib.contextmanager
def started_broker(tmp_path: Path) -> Iterator[ShippedBroker]:
    """The shipped broker, its password file made by its init container, running until the block ends."""
    if not os.access(MOSQUITTO, os.X_OK):
        pytest.skip("mosquitto is not installed (Debian package mosquitto)")
    broker = ShippedBroker(tmp_path)
    made = broker.run_init()
    assert made.returncode == 0, made.stdout + made.stderr
    broker.start()
    try:
        yield broker
    finally:
        broker.stop()


@pytest.fixture
def shipped_broker(tmp_path: Path) -> Iterator[ShippedBroker]:
    with started_broker(tmp_path) as broker:
        yield broker


def node_settings(broker: ShippedBroker, tmp_path: Path, **override: Any) -> CoordinationSettings:
    """The ConfigMap's coordination section turned on, as an operator does, with the broker at this test's address
    and the password file where the DaemonSet mounts the broker's Secret."""
    return CoordinationSettings.model_validate(coordination_section(broker, tmp_path, **override))


def coordination_section(broker: ShippedBroker, tmp_path: Path, **override: Any) -> dict[str, Any]:
    """:func:`node_settings` as the JSON of a node's config (``override``: keys of its ``broker``)."""
    base = render(BASE)
    raw = json.loads(of_kind(base, "ConfigMap")["data"]["config.json"])["global"]["coordination"]
    daemonset = of_kind(base, "DaemonSet")["spec"]["template"]["spec"]
    [volume] = [v for v in daemonset["volumes"] if v.get("secret", {}).get("secretName") == broker.secret_name]
    [mount] = [m for m in daemonset["containers"][0]["volumeMounts"] if m["name"] == volume["name"]]
    password = Path(raw["broker"]["passwordFile"])
    assert password.parent == Path(mount["mountPath"])
    state = tmp_path / "state"
    state.mkdir(exist_ok=True)
    broker_settings = {
        **raw["broker"],
        "host": "127.0.0.1",
        "port": broker.port,
        "passwordFile": str(broker.secret / password.name),
        **override,
    }
    return {**raw, "enabled": True, "stateDir": str(state), "broker": broker_settings}


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
