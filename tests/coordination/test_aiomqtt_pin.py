"""mqtt_link.py reaches into aiomqtt's private callbacks: the installed aiomqtt is within the pin, and has them."""

from __future__ import annotations

import re
import tomllib
from importlib.metadata import version
from pathlib import Path

import aiomqtt

REPO = Path(__file__).resolve().parents[2]
# What nodeguard.coordination.mqtt_link touches of aiomqtt.Client that is not public API.
PRIVATE = ("_on_connect", "_on_disconnect", "_connected")


def _pin() -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(lowest allowed, first not allowed) from pyproject.toml's ``aiomqtt>=A,<B``."""
    [spec] = [d for d in tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["dependencies"]
              if d.startswith("aiomqtt")]  # fmt: skip
    low = re.search(r">=\s*([0-9.]+)", spec)
    high = re.search(r"<\s*([0-9.]+)", spec)
    assert low and high, f"aiomqtt must be pinned to a range (>=A,<B): {spec!r}"
    return tuple(map(int, low.group(1).split("."))), tuple(map(int, high.group(1).split(".")))


async def test_installed_aiomqtt_is_within_the_pin_and_has_the_internals_used() -> None:
    """An aiomqtt outside the pinned range, or one without the private attributes mqtt_link.py uses, fails here
    (and not in production, when a reconnect first needs them)."""
    low, high = _pin()
    installed = tuple(int(part) for part in re.findall(r"\d+", version("aiomqtt"))[:3])
    assert low <= installed < high, (installed, low, high)
    client = aiomqtt.Client("127.0.0.1", port=1)
    missing = [name for name in PRIVATE if not hasattr(client, name)]
    assert not missing, f"aiomqtt {version('aiomqtt')} lacks {missing}"


def test_mqtt_link_still_uses_each_internal_listed() -> None:
    """The list above is what the module uses: a name dropped from mqtt_link.py must be dropped here too."""
    source = (REPO / "nodeguard" / "coordination" / "mqtt_link.py").read_text()
    assert all(f"{name}" in source for name in PRIVATE)
    assert "class _Client(aiomqtt.Client)" in source, "the subclass that reaches the internals is still there"
