"""The bounds the configuration reference gives each number are the ones validation applies: probed just inside and
just outside each bound, through the real config validation."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import pytest

from nodeguard.config import json_schema, parse_document
from nodeguard.errors import ConfigError
from tests.docs.generators import CONFIG_REFERENCE as REFERENCE
from tests.docs.generators import config_generator as generator

MODULE = generator()
REF = MODULE.Reference()

# List items need their required keys around the key probed.
ITEMS: dict[str, dict[str, Any]] = {
    "guard.objectives[]": {"metric": "cpu_total_usage", "action": "evict", "threshold": 1},
    "workloads.groups[]": {"match": "batch.slice"},
}
# Other keys set beside a probed key, so that a rule across keys (documented beside them) keeps out of the probe.
BESIDE: dict[str, dict[str, Any]] = {
    "guard.objectives[].restoreBelow": {"action": "throttle", "threshold": 1000},
    "coordination.willDelaySeconds": {"leaseSeconds": 0.5},
    "gate.maxRate": {"minRate": 0},
}
FAR = 10**15  # beyond any sensible value of any key: what "no bound" is probed with


@dataclass(frozen=True)
class NumberKey:
    model: str  # the name of its model, as in the schema's $defs
    section: str  # path and suffix of its section, e.g. guard.objectives[]
    key: str
    bounds: Any  # the generator's Bounds
    container: str  # "object" or "list" when the bounds are of each value or item, else ""
    rules: tuple[str, ...]  # rules across keys documented beside it

    @property
    def path(self) -> str:
        return f"{self.section}.{self.key}"

    def document(self, value: float) -> dict[str, Any]:
        assert "[]" not in self.section.removesuffix("[]"), f"{self.path}: a list inside a list: extend document()"
        wrapped = {"object": {"name": value}, "list": [value], "": value}[self.container]
        item: Any = {**ITEMS.get(self.section, {}), **BESIDE.get(self.path, {}), self.key: wrapped}
        if self.section.endswith("[]"):
            item = [item]
        for part in reversed(self.section.removesuffix("[]").split(".")):
            item = {part: item}
        return {"global": item}

    def problems(self, value: float) -> list[str]:
        """What validation says of ``value`` at this key: nothing when it is accepted."""
        try:
            parse_document(self.document(value))
        except ConfigError as exc:
            return exc.problems
        return []


def number_keys() -> list[NumberKey]:
    found = []
    for path, suffix, schema in REF.sections():
        if path in ("", "perNode"):
            continue  # the document's own keys and perNode's nodeSelector: no numbers; perNode repeats global
        rules = REF.rules(path, schema)
        for key, node in schema.get("properties", {}).items():
            bounds = REF.number_of(node)
            if bounds is None:
                continue
            kind = REF.type_of(node)
            container = ("object" if kind.startswith("object") else "list") if bounds.each else ""
            found.append(
                NumberKey(schema["title"], f"{path}{suffix}", key, bounds, container, tuple(rules.get(key, ())))
            )
    return found


KEYS = number_keys()


def reference_row(section: str, key: str) -> str:
    """The row of ``key`` in the table of ``section`` in the committed reference."""
    heading = ""
    for line in REFERENCE.read_text().splitlines():
        if line.startswith("#"):
            heading = line.lstrip("#").strip()
        elif heading == section and line.startswith(f"| `{key}` |"):
            return line
    raise AssertionError(f"no row for {key} under the heading {section} in {REFERENCE.name}")


def test_every_number_of_the_models_is_probed() -> None:
    """Each key of the config's models that takes a number (or numbers) is among the keys probed below."""
    numbers = {
        (name, key)
        for name, definition in json_schema()["$defs"].items()
        for key, node in definition.get("properties", {}).items()
        if REF.number_of(node) is not None and name != "NodeRule"  # NodeRule: global's keys again
    }
    assert len(numbers) > 40
    assert {(key.model, key.key) for key in KEYS} == numbers


@pytest.mark.parametrize("number", KEYS, ids=[key.path for key in KEYS])
def test_the_documented_bounds_are_what_validation_accepts(number: NumberKey) -> None:
    """Just inside each documented bound is accepted and just outside refused; a number without a documented bound
    (and no rule across keys beside it) is accepted however large or small."""
    bounds = number.bounds
    row = reference_row(number.section, number.key)
    wrong = [f"the reference's row does not show {part!r}: {row}" for part in bounds.texts() if part not in row]

    def step(at: float) -> float:
        return 1 if bounds.integer else max(abs(at), 1.0) * 1e-9

    inside: list[float] = []
    outside: list[float] = []
    if bounds.minimum is not None:
        inside.append(bounds.minimum)
        outside.append(bounds.minimum - step(bounds.minimum))
    if bounds.exclusive_minimum is not None:
        inside.append(bounds.exclusive_minimum + step(bounds.exclusive_minimum))
        outside.append(bounds.exclusive_minimum)
    if bounds.maximum is not None:
        inside.append(bounds.maximum)
        outside.append(bounds.maximum + step(bounds.maximum))
    if not number.rules:
        if bounds.minimum is None and bounds.exclusive_minimum is None:
            inside.append(-FAR)
        if bounds.maximum is None:
            inside.append(FAR)
    for value in (round(v) if bounds.integer else v for v in inside):
        if problems := number.problems(value):
            wrong.append(f"{value!r} refused, documented as allowed: {problems}")
    for value in (round(v) if bounds.integer else v for v in outside):
        if not number.problems(value):
            wrong.append(f"{value!r} accepted, documented as out of bounds")
    assert not wrong, f"{number.path} ({', '.join(bounds.texts()) or 'no bounds'}): " + "; ".join(wrong)
