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

    bind(0) hands out a port of the ephemeral range, which nothing reserves once its socket closes: a later
    bind(0) may hand it out again, and any outgoing connection (a daemon's MQTT client, say) may take it before
    the server the test starts binds it. Ten daemons starting side by side found one HTTP port taken once in CI.
    Ports below the range are bound only on purpose.
    """
    high = _ephemeral_low()
    if high <= 11000:  # a range reaching that low leaves no room below it: any port, then
        high = 65536
    rng = random.SystemRandom()
    for _ in range(1000):
        port = rng.randrange(10000, high)
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
