"""The exceptions nodeguard raises on purpose; anything else is a bug."""

from __future__ import annotations


class NodeguardError(Exception):
    """Base class: an error with a message fit for an operator."""


class ConfigError(NodeguardError):
    """A config document that cannot be used; carries every problem found."""

    def __init__(self, problems: list[str], source: str = "config") -> None:
        self.problems = problems
        self.source = source
        super().__init__(f"{source}: " + "; ".join(problems))

    def render(self) -> str:
        lines = [f"{self.source}: {len(self.problems)} error(s)"]
        lines += [f"  {problem}" for problem in self.problems]
        return "\n".join(lines)


class ConfigUnreadable(NodeguardError):
    """The config file could not be read or is not JSON at all."""


class CgroupGone(NodeguardError):
    """The cgroup vanished while it was read: its workload left."""


class ActuationRefused(NodeguardError):
    """A write nodeguard will not make (outside the cgroup root, or malformed)."""


class ParseError(NodeguardError, ValueError):
    """Kernel file text that does not have the expected format."""


class WhatIfError(NodeguardError, ValueError):
    """A what-if override that cannot be applied: an unknown metric or an impossible value."""
