"""Loopback ports for the servers a test starts."""

from __future__ import annotations

import random
import socket
from pathlib import Path

_handed_out: set[int] = set()


def _ephemeral_low() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 32768


def free_port() -> int:
    """A port free now, below the kernel's ephemeral range, not handed out before in this run.

    A port the kernel picked for bind(0) lies in the ephemeral range, where any outgoing connection
    (a daemon's MQTT client, say) may take it before the server the test starts binds it: ten daemons
    starting side by side lost that race once in CI. Ports below the range are only ever bound on purpose.
    """
    low = min(_ephemeral_low(), 65536)
    rng = random.SystemRandom()
    for _ in range(1000):
        port = rng.randrange(10000, low if low > 11000 else 65536)
        if port in _handed_out:
            continue
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
        _handed_out.add(port)
        return port
    raise RuntimeError("no free loopback port below the ephemeral range")
