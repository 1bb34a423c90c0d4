"""docs/reference/configuration.md is what scripts/config_reference.py prints from the config models."""

from __future__ import annotations

import inspect
import re
from pathlib import Path
from types import ModuleType

import pytest
from pydantic import BaseModel

from nodeguard.config import json_schema
from nodeguard.config_base import declared_rules, rules_of
from nodeguard.policy.metrics import CAPABILITIES
from tests.docs.generators import CONFIG_REFERENCE, config_generator

REPO = Path(__file__).resolve().parents[2]
REFERENCE = CONFIG_REFERENCE


def generator() -> ModuleType:
    return config_generator()


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


def config_models() -> dict[str, type[BaseModel]]:
    """The models of the config (not the gate's requests, which are Models too), by name."""
    names = set(json_schema()["$defs"])
    return {name: model for name, model in generator()._models().items() if name in names or name == "Document"}


def test_every_validator_across_keys_declares_its_rule() -> None:
    """A validator of a config model that reads other keys (a model validator run after the fields, or a field
    validator given the values validated so far) declares the rule it checks, so the reference shows it."""
    undeclared = []
    for name, model in config_models().items():
        decorators = model.__pydantic_decorators__
        across = [d for d in decorators.model_validators.values() if d.info.mode != "before"]
        across += [d for d in decorators.field_validators.values() if "info" in inspect.signature(d.func).parameters]
        undeclared += [f"{name}.{d.cls_var_name}" for d in across if not declared_rules(d.func)]
    assert undeclared == [], f"validators across keys without @cross_field: {undeclared}"


def test_each_rule_is_shown_beside_keys_of_its_model() -> None:
    """Every key a rule is declared on is a JSON key of the model that checks it, and its row shows the rule."""
    text = REFERENCE.read_text()
    shown = 0
    for name, model in config_models().items():
        keys = {field.alias or key for key, field in model.model_fields.items()}
        for key, rules in rules_of(model).items():
            assert key in keys, f"{name}: a rule on {key}, which is not one of its keys {sorted(keys)}"
            rows = [line for line in text.splitlines() if line.startswith((f"| `{key}` |", f"| [`{key}`]("))]
            for rule in rules:
                cell = rule.replace("|", "\\|")
                assert any(cell in row for row in rows), f"{name}.{key}: the reference does not show {rule!r}"
                shown += 1
    assert shown >= 15, shown
