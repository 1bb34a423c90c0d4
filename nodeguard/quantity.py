"""Thresholds as written in the config: an absolute amount or a percentage."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass
from enum import StrEnum


class Unit(StrEnum):
    """What a metric is measured in."""

    CORES = "cores"
    BYTES = "bytes"
    PERCENT = "percent"
    LOAD_PER_CORE = "load per core"


_BYTE_SUFFIXES = {
    "": 1,
    "k": 10**3,
    "K": 10**3,
    "M": 10**6,
    "G": 10**9,
    "T": 10**12,
    "P": 10**15,
    "Ki": 2**10,
    "Mi": 2**20,
    "Gi": 2**30,
    "Ti": 2**40,
    "Pi": 2**50,
}
_NUMBER = r"[0-9]+(?:\.[0-9]*)?|\.[0-9]+"
_PERCENT_RE = re.compile(rf"\s*({_NUMBER})\s*%\s*")
_BYTES_RE = re.compile(rf"\s*({_NUMBER})\s*(Ki|Mi|Gi|Ti|Pi|k|K|M|G|T|P)?B?\s*")
_CORES_RE = re.compile(rf"\s*({_NUMBER})\s*(m)?\s*")

EXPECTED = {
    Unit.CORES: 'expected a number of cores or a percentage like "80%"',
    Unit.BYTES: 'expected bytes (a number, or like "512Mi", "8G") or a percentage like "80%"',
    Unit.PERCENT: 'expected a percentage like "80%" or a number from 0 to 100',
    Unit.LOAD_PER_CORE: 'expected a load average per core like 1.5, or a percentage like "150%"',
}


@dataclass(frozen=True, slots=True)
class Quantity:
    """A non-negative amount in the metric's unit, or a percentage of capacity."""

    value: float
    percent: bool
    raw: float | str

    def resolve(self, capacity: float) -> float:
        """The amount in the metric's unit; ``capacity`` is what 100 % means."""
        return self.value * capacity / 100.0 if self.percent else self.value

    def same_kind(self, other: Quantity) -> bool:
        return self.percent == other.percent

    def dump(self) -> float | str:
        return self.raw if isinstance(self.raw, str) else float(self.raw)


def parse_quantity(raw: object, unit: Unit) -> Quantity:
    """Parse a threshold for a metric measured in ``unit``; ValueError says what was expected."""
    expected = EXPECTED[unit]
    if isinstance(raw, bool) or not isinstance(raw, int | float | str):
        raise ValueError(expected)
    if isinstance(raw, int | float):
        value, percent = float(raw), unit is Unit.PERCENT
    elif match := _PERCENT_RE.fullmatch(raw):
        value, percent = float(match.group(1)), True
    elif unit is Unit.BYTES and (match := _BYTES_RE.fullmatch(raw)):
        value, percent = float(match.group(1)) * _BYTE_SUFFIXES[match.group(2) or ""], False
    elif unit is Unit.CORES and (match := _CORES_RE.fullmatch(raw)):
        value = float(match.group(1)) / (1000 if match.group(2) else 1)
        percent = False
    elif unit in (Unit.PERCENT, Unit.LOAD_PER_CORE) and (match := _CORES_RE.fullmatch(raw)):
        if match.group(2):
            raise ValueError(expected)
        value, percent = float(match.group(1)), unit is Unit.PERCENT
    else:
        raise ValueError(expected)
    if not math.isfinite(value) or value < 0:
        raise ValueError(f"{expected}; it must be a finite number, not negative")
    if percent and value > 100 and unit is not Unit.LOAD_PER_CORE:
        raise ValueError("a percentage cannot be over 100")
    return Quantity(value, percent, raw)
