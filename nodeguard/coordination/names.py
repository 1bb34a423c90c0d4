"""Node, cluster and semaphore names: one MQTT topic level, no wildcards.

Apart from topics.py so that the config (coordination.settings) checks names
without importing the protocol's records: every daemon reads the config,
only a coordinating one speaks the protocol.
"""

from __future__ import annotations

import re

NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:-]{0,252}$")


def valid_name(name: str) -> bool:
    """Node, cluster and semaphore names: one topic level, no wildcards."""
    return bool(NAME.match(name))
