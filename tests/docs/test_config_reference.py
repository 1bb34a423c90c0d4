"""docs/reference/configuration.md is what scripts/config_reference.py prints from the config models."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path
from types import ModuleType

import pytest

from nodeguard.config import json_schema
from nodeguard.policy.metrics import CAPABILITIES

REPO = Path(__file__).resolve().parents[2]
REFERENCE = REPO / "docs" / "reference" / "configuration.md"
GENERATOR = REPO / "scripts" / "config_reference.py"


def generator() -> ModuleType:
    spec = importlib.util.spec_from_file_location("config_reference", GENERATOR)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_committed_reference_is_what_the_generator_prints() -> None:
    """The committed configuration reference equals the generator's output, so it follows every change of the
    models."""
    module = generator()
    assert REFERENCE.read_text() == module.render(), (
        f"docs/reference/configuration.md is out of date; regenerate it: {module.COMMAND}"
    )


def test_every_key_of_the_schema_is_in_the_reference() -> None:
    """Each key of each object in `nodeguard schema`, and each objective metric, has a row in the reference."""
    text = REFERENCE.read_text()
    rows = set(re.findall(r"^\| \[?`([^`]+)`", text, re.MULTILINE))
    keys = {key for definition in json_schema()["$defs"].values() for key in definition.get("properties", {})}
    assert keys - rows == set(), f"keys missing from the reference: {keys - rows}"
    assert {str(metric) for metric in CAPABILITIES} <= rows


def test_an_undocumented_key_stops_the_generator(monkeypatch: pytest.MonkeyPatch) -> None:
    """A key with no description in the models and none in the generator's MEANINGS fails the generator, naming
    the key, rather than leaving an empty meaning."""
    module = generator()
    monkeypatch.delitem(module.MEANINGS, "sensing.tickSeconds")
    with pytest.raises(module.Undocumented, match=r"sensing\.tickSeconds"):
        module.render()
