"""Kubernetes quantities as the API serializes them and as manifests may write them."""

from __future__ import annotations

import pytest

from nodeguard.kubernetes.quantities import parse_kube_quantity


@pytest.mark.parametrize(
    ("raw", "value"),
    [
        ("250m", 0.25),
        ("1", 1.0),
        ("1.5", 1.5),
        ("0.1", 0.1),
        (".5", 0.5),
        ("100n", 1e-7),
        ("500u", 5e-4),
        ("2k", 2000.0),
        ("64Mi", 64 * 2**20),
        ("1Gi", 2**30),
        ("1.5Gi", 1.5 * 2**30),
        ("1e3", 1000.0),
        ("1E-3", 0.001),
        ("5M", 5e6),
        ("+2", 2.0),
        (2, 2.0),
        (0.5, 0.5),
    ],
)
def test_parses_every_suffix_form(raw: object, value: float) -> None:
    """Decimal, binary and exponent suffixes give the value in base units."""
    assert parse_kube_quantity(raw) == pytest.approx(value)


@pytest.mark.parametrize("raw", ["", "m", "abc", "1.5.2", "1mi", "1 Gi x", "1KiB", None, True, [], "1e"])
def test_rejects_malformed(raw: object) -> None:
    """Anything outside the grammar is a ValueError, never a guess."""
    with pytest.raises(ValueError, match="not a quantity"):
        parse_kube_quantity(raw)
