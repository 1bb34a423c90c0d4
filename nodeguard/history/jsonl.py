"""Strict JSON for the history's lines and answers: a number JSON cannot hold (NaN, infinity) is null."""

from __future__ import annotations

import json
import math
from collections.abc import Mapping

VERSION = 1  # of the lines' format: every line says it ("v"), and readers skip lines of another


def finite(value: object) -> object:
    """The value with every infinite or NaN float as None: JSON has no such numbers."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, Mapping):
        return {k: finite(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [finite(v) for v in value]
    return value


def json_text(value: object, separators: tuple[str, str] | None = (",", ":")) -> str:
    """Strict JSON (a non-finite number as null), values JSON does not know as their text."""
    try:
        return json.dumps(value, separators=separators, default=str, allow_nan=False)
    except ValueError:
        return json.dumps(finite(value), separators=separators, default=str, allow_nan=False)
