"""CPU weights: cgroup v1 ``cpu.shares`` and v2 ``cpu.weight``, through the single writer.

The protected_cpu_stall objective's first lever (bench/protect.py): a group's
weight lowered to the kernel's least keeps it from delaying a protected
workload's wake-ups, and still gives it every cycle nobody else wants.
kubelet sets the QoS tiers' weights itself (and rewrites them as pods come
and go): a value found in place of nodeguard's is taken as the new original
and nodeguard's is asserted again.
"""

from __future__ import annotations

from dataclasses import dataclass

from nodeguard.actuators.cgroup_writer import CgroupWriter
from nodeguard.errors import ParseError


@dataclass(frozen=True, slots=True)
class WeightFile:
    name: str
    least: int
    most: int


V1_SHARES = WeightFile("cpu.shares", 2, 262144)
V2_WEIGHT = WeightFile("cpu.weight", 1, 10000)


class WeightWriter:
    def __init__(self, writer: CgroupWriter, version: str) -> None:
        self.writer = writer
        self.version = version
        self.file = V2_WEIGHT if version == "v2" else V1_SHARES

    @property
    def least(self) -> int:
        return self.file.least

    def read(self, group: str) -> int:
        text = self.writer.read(group, self.file.name)
        try:
            value = int(text)
        except ValueError:
            raise ParseError(f"{self.file.name} of {group}: not a number: {text!r}") from None
        if not self.file.least <= value <= self.file.most:
            raise ParseError(f"{self.file.name} of {group}: {value} out of range")
        return value

    def write(self, group: str, value: int, **context: object) -> None:
        self.writer.write(group, self.file.name, str(value), **context)
