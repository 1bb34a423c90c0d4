"""What-if: a snapshot with some node metrics set by hand, for ``nodeguard plan --what-if``.

Only the named metrics change; workloads keep their measured usage, so the
plan shows what the guard would do if the node read those values now.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable, Mapping

from nodeguard.errors import WhatIfError
from nodeguard.model.snapshot import Snapshot
from nodeguard.policy.metrics import CAPABILITIES, Metric
from nodeguard.quantity import parse_quantity


def _metric(name: str) -> Metric:
    try:
        return Metric(name.strip())
    except ValueError:
        known = ", ".join(Metric)
        raise WhatIfError(f"what-if: unknown metric {name!r}; known metrics: {known}") from None


def what_if(snapshot: Snapshot, overrides: Mapping[str, float | str]) -> Snapshot:
    """``snapshot`` with each named node metric set to its value.

    A value is in the metric's unit (cores, bytes, percent, load per core); a
    string may also be a quantity like ``"30Gi"`` or a percentage of capacity
    like ``"90%"``, as in a threshold. WhatIfError on an unknown metric or a
    value that is not a finite, non-negative amount.
    """
    node = snapshot.node
    for name, raw in overrides.items():
        metric = _metric(name)
        cap = CAPABILITIES[metric]
        try:
            value = parse_quantity(raw, cap.unit).resolve(cap.capacity(node))
            if not math.isfinite(value):
                raise ValueError("not a finite amount")
            node = cap.override(node, value)
        except ValueError as exc:
            raise WhatIfError(f"what-if: {metric}={raw!r}: {exc}") from None
    return dataclasses.replace(snapshot, node=node)


def parse_overrides(items: Iterable[str]) -> dict[str, float | str]:
    """``["cpu_total_usage=7.5", "memory_total_usage=30Gi"]`` -> overrides for what_if()."""
    overrides: dict[str, float | str] = {}
    for item in items:
        name, sep, raw = item.partition("=")
        if not sep or not raw.strip():
            raise WhatIfError(f"what-if: expected METRIC=VALUE, got {item!r}")
        _metric(name)
        try:
            overrides[name.strip()] = float(raw)
        except ValueError:
            overrides[name.strip()] = raw.strip()
    return overrides
