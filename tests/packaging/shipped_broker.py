"""The shipped broker pod (packaging/kubernetes/broker/) as rendered by `kubectl kustomize`, run here: its volumes as
directories, its init container's script, the real mosquitto on its rendered config; and a node's coordination
section as the shipped ConfigMap has it, pointed at this broker."""

from __future__ import annotations

import base64
import contextlib
import json
import os
import re
import signal
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.packaging.kustomize import BASE, broker_copy, of_kind, render
from tests.support.broker import MOSQUITTO, wait_listening
from tests.support.ports import free_port

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
