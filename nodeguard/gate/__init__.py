"""The start gate: admitting container and process starts through a composite policy."""
