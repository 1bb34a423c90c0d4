"""The levers nodeguard holds workloads back with: one module each, one protocol (``base.Lever``).

Adding a lever means writing its module and adding its class to ``REGISTERED``:
the writer's allow-list, the ledger's validation, start (restore or adopt),
stop, ``restore --all``, drift re-assertion, status, metrics and Events all
iterate over this registry. A lever with no file on a cgroup version (memory.high
on v1) is not built there: ``available`` says which are.
"""

from __future__ import annotations

from nodeguard.actuators.levers.base import Lever, Writer
from nodeguard.actuators.levers.cpu_quota import QuotaLever
from nodeguard.actuators.levers.cpu_weight import WeightLever
from nodeguard.actuators.levers.memory_high import MemoryHighLever

REGISTERED: tuple[type[QuotaLever] | type[WeightLever] | type[MemoryHighLever], ...] = (
    QuotaLever,
    WeightLever,
    MemoryHighLever,
)
NAMES: tuple[str, ...] = tuple(kind.name for kind in REGISTERED)


def lever_files() -> frozenset[str]:
    """Every file any lever may write, on either cgroup version."""
    return frozenset().union(*(kind.files(v) for kind in REGISTERED for v in ("v1", "v2")))


def available(version: str) -> tuple[str, ...]:
    """The registered levers this cgroup version has files for, in registration order."""
    return tuple(kind.name for kind in REGISTERED if kind.files(version))


def build(writer: Writer, version: str) -> dict[str, Lever]:
    """One of each lever this hierarchy has, by name, in registration order."""
    return {kind.name: kind(writer, version) for kind in REGISTERED if kind.files(version)}
