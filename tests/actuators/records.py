"""Ledger records as the executor writes them, for tests that set up a ledger by hand."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Literal

from nodeguard.actuators.ledger import HeldValue, LeverRecord
from nodeguard.model.samples import CpuMax


def quota_record(
    group: str,
    version: str,
    original: CpuMax,
    applied: CpuMax,
    reason: str = "test",
    *,
    pending: CpuMax | None = None,
    children: Mapping[str, HeldValue] | None = None,
) -> LeverRecord:
    return LeverRecord(
        lever="cpu.max", group=group, cgroup_version=_version(version), original=original.render_v2(),
        applied=applied.render_v2(), pending=None if pending is None else pending.render_v2(), reason=reason,
        children=dict(children or {}),
    )  # fmt: skip


def weight_record(group: str, version: str, original: int, applied: int, *, pending: int | None = None) -> LeverRecord:
    return LeverRecord(
        lever="cpu.weight", group=group, cgroup_version=_version(version), original=str(original),
        applied=str(applied), pending=None if pending is None else str(pending), reason="protected_cpu_stall",
    )  # fmt: skip


def _version(version: str) -> Literal["v1", "v2"]:
    return "v2" if version == "v2" else "v1"
