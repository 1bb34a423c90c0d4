"""This node's name and labels, for selecting per-node config rules."""

from __future__ import annotations

import os
import socket
from collections.abc import Iterable

from nodeguard.errors import NodeguardError

HOSTNAME_LABEL = "kubernetes.io/hostname"


def node_name() -> str:
    """NODE_NAME (set from the downward API in the DaemonSet), else the hostname."""
    return os.environ.get("NODE_NAME") or socket.gethostname()


def node_labels(name: str | None = None, extra: Iterable[str] = ()) -> dict[str, str]:
    """The hostname label plus ``key=value`` pairs given on the command line."""
    labels = {HOSTNAME_LABEL: name or node_name()}
    for pair in extra:
        key, sep, value = pair.partition("=")
        if not sep or not key:
            raise NodeguardError(f"--node-label: expected key=value, got {pair!r}")
        labels[key] = value
    return labels
