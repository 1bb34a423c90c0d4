"""``HOST:PORT`` as written in configs and on command lines: the one parser of it."""

from __future__ import annotations

import ipaddress
import re

_HOST_LABEL = re.compile(r"^(?!-)[A-Za-z0-9-]{1,63}(?<!-)$")


def valid_host(host: str) -> bool:
    """An IPv4 or IPv6 address, or a DNS name; "999.1.1.1" is neither (a name cannot be all digits)."""
    try:
        ipaddress.ip_address(host)
        return True
    except ValueError:
        pass
    labels = host.removesuffix(".").split(".")
    if len(host) > 253 or not all(_HOST_LABEL.match(label) for label in labels):
        return False
    return not labels[-1].isdigit()


def split_host_port(address: str, *, any_port: bool = False) -> tuple[str, int]:
    """``host:port`` or ``[v6]:port`` -> (host, port); ValueError saying what was expected otherwise.

    ``any_port`` allows port 0 (a listener that takes a free port).
    """
    host, sep, port_text = address.rpartition(":")
    if not sep or not host or not port_text.isdigit():
        raise ValueError('expected HOST:PORT, e.g. "127.0.0.1:8080"')
    if host.startswith("[") and host.endswith("]"):
        host = host[1:-1]
    port = int(port_text)
    if not (0 if any_port else 1) <= port < 65536:
        raise ValueError(f"the port must be between {0 if any_port else 1} and 65535")
    if not valid_host(host):
        raise ValueError("expected an IP address or a host name before the port")
    return host, port
