"""The gate's section of the config (``gate``)."""

from __future__ import annotations

from nodeguard.config_base import Model


class GateSettings(Model):
    """Placeholder until the gate lands: no keys yet."""
