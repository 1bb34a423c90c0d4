"""Kubernetes resource quantities ("250m", "1.5", "2Gi", "1e3") as numbers.

The grammar is apimachinery's ``resource.Quantity``: a signed decimal number
and one suffix, binary (Ki … Ei), decimal (n u m "" k M G T P E) or a decimal
exponent (``e3``, ``E-2``). Serialized objects always carry the canonical
form, but a hand-written manifest may use any of them.
"""

from __future__ import annotations

import re
from decimal import Decimal, InvalidOperation

_SUFFIXES: dict[str, Decimal] = {
    "n": Decimal("1e-9"),
    "u": Decimal("1e-6"),
    "m": Decimal("1e-3"),
    "": Decimal(1),
    "k": Decimal("1e3"),
    "M": Decimal("1e6"),
    "G": Decimal("1e9"),
    "T": Decimal("1e12"),
    "P": Decimal("1e15"),
    "E": Decimal("1e18"),
    "Ki": Decimal(2**10),
    "Mi": Decimal(2**20),
    "Gi": Decimal(2**30),
    "Ti": Decimal(2**40),
    "Pi": Decimal(2**50),
    "Ei": Decimal(2**60),
}
_QUANTITY = re.compile(
    r"(?P<number>[+-]?(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+))"
    r"(?:(?P<exp>[eE][+-]?[0-9]+)|(?P<suffix>Ki|Mi|Gi|Ti|Pi|Ei|[numkMGTPE])?)"
)


def parse_kube_quantity(raw: object) -> float:
    """A quantity's value in base units (cores for CPU, bytes for memory); ValueError if malformed."""
    if isinstance(raw, bool):
        raise ValueError(f"not a quantity: {raw!r}")
    if isinstance(raw, int | float):
        return float(raw)  # some clients send plain JSON numbers
    if not isinstance(raw, str):
        raise ValueError(f"not a quantity: {raw!r}")
    match = _QUANTITY.fullmatch(raw.strip())
    if match is None:
        raise ValueError(f"not a quantity: {raw!r}")
    try:
        number = Decimal(match.group("number"))
        if match.group("exp"):
            return float(number.scaleb(int(match.group("exp")[1:])))
        return float(number * _SUFFIXES[match.group("suffix") or ""])
    except (InvalidOperation, OverflowError):
        raise ValueError(f"not a quantity: {raw!r}") from None
