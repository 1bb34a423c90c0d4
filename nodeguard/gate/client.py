"""Gate clients on the command line (``nodeguard gate``, ``admit``, ``oci-hook``)."""

from __future__ import annotations

from typing import Any


def add_gate_commands(commands: Any) -> None:
    """Register the gate's client commands; each sets ``handler`` (args -> exit code)."""
    del commands  # the gate's clients land with the gate
