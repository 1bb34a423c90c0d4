"""The per-node JSON config: typed model, validation errors with paths, node selection.

A document has a ``global`` section and a ``perNode`` list of rules. Each rule
has a ``nodeSelector`` (a Kubernetes label selector: nodeguard.selectors) and
any sections of ``global``; the settings of the
node are ``global`` with every matching rule laid over it in list order
(objects merge key by key, lists and scalars are replaced, later rules win).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from pydantic import (
    BaseModel,
    Field,
    ValidationError,
    field_validator,
)

from nodeguard.actuators.settings import ActuationSettings
from nodeguard.atomic_file import UnsafeFile, read_regular_file
from nodeguard.bounded_json import bounded_json
from nodeguard.config_base import Model, format_errors
from nodeguard.coordination.settings import CoordinationSettings
from nodeguard.errors import ConfigError, ConfigUnreadable
from nodeguard.gate.settings import GateSettings
from nodeguard.history.settings import HistorySettings
from nodeguard.kubernetes.settings import KubernetesSettings
from nodeguard.netaddr import split_host_port
from nodeguard.policy.settings import GuardSettings
from nodeguard.selectors import LabelSelector
from nodeguard.sources.settings import SensingSettings, WorkloadSettings


class HttpSettings(Model):
    """The daemon's HTTP endpoints: /metrics, /healthz, /readyz, /status, /history."""

    enabled: bool = True
    listen: str = Field("127.0.0.1:9466", description="HOST:PORT; loopback by default")

    @field_validator("listen")
    @classmethod
    def _host_port(cls, value: str) -> str:
        split_host_port(value, any_port=True)
        return value


class Settings(Model):
    """The effective settings of one node."""

    sensing: SensingSettings = SensingSettings()
    workloads: WorkloadSettings = WorkloadSettings()
    guard: GuardSettings = GuardSettings()
    actuation: ActuationSettings = ActuationSettings()
    history: HistorySettings = HistorySettings()
    http: HttpSettings = HttpSettings()
    gate: GateSettings = GateSettings()
    coordination: CoordinationSettings = CoordinationSettings()
    kubernetes: KubernetesSettings = KubernetesSettings()


class NodeRule(Settings):
    node_selector: LabelSelector


class Document(Model):
    """A whole config file."""

    schema_: str | None = Field(None, alias="$schema")
    global_: Settings = Field(Settings(), alias="global")
    per_node: list[NodeRule] = []

    def settings_for(self, labels: Mapping[str, str], source: str = "config") -> Settings:
        """Merge ``global`` with the rules whose selector matches ``labels``."""
        merged = _dump_set(self.global_)
        for rule in self.per_node:
            if rule.node_selector.matches(labels):
                override = _dump_set(rule)
                override.pop("nodeSelector", None)
                merged = deep_merge(merged, override)
        try:
            return Settings.model_validate(merged)
        except ValidationError as exc:
            raise ConfigError(format_errors(exc), f"{source} (merged for this node)") from None

    def matching_rules(self, labels: Mapping[str, str]) -> list[int]:
        return [i for i, rule in enumerate(self.per_node) if rule.node_selector.matches(labels)]


def _dump_set(model: BaseModel) -> dict[str, Any]:
    return model.model_dump(by_alias=True, exclude_unset=True, mode="json")


def deep_merge(base: Mapping[str, Any], override: Mapping[str, Any]) -> dict[str, Any]:
    """Objects merge key by key; lists and scalars in ``override`` replace."""
    merged = dict(base)
    for key, value in override.items():
        old = merged.get(key)
        if isinstance(old, Mapping) and isinstance(value, Mapping):
            merged[key] = deep_merge(old, value)
        else:
            merged[key] = value
    return merged


# --- errors ----------------------------------------------------------------------


def _render_input(value: object) -> str:
    return bounded_json(value, 80)  # bounded: the value may nest a thousand levels deep


# --- loading ---------------------------------------------------------------------


def parse_document(data: object, source: str = "config") -> Document:
    if not isinstance(data, dict):
        raise ConfigError([f"(document): expected a JSON object, got {_render_input(data)}"], source)
    try:
        return Document.model_validate(data)
    except ValidationError as exc:
        raise ConfigError(format_errors(exc), source) from None
    except (ValueError, TypeError, RecursionError) as exc:  # defensive: never a traceback
        raise ConfigError([f"(document): {exc}"], source) from None


def _reject_constant(name: str) -> float:
    raise ValueError(f"{name} is not valid JSON")


def parse_text(text: str, source: str = "config") -> Document:
    try:
        data = json.loads(text, parse_constant=_reject_constant)
    except json.JSONDecodeError as exc:
        raise ConfigError([f"line {exc.lineno} column {exc.colno}: not valid JSON: {exc.msg}"], source) from None
    except (ValueError, RecursionError) as exc:
        raise ConfigError([f"(document): {exc}"], source) from None
    return parse_document(data, source)


MAX_CONFIG_BYTES = 4 << 20  # far above any real config; reading and checking one this size takes about a second


def load_document(path: str | Path) -> Document:
    """Read and validate a config file: ConfigUnreadable or ConfigError on failure.

    Only a regular file is read (a symlink to one is fine: config maps mount
    those), opened so that a FIFO or a device never blocks, and at most
    ``MAX_CONFIG_BYTES`` of it.
    """
    try:
        text = read_regular_file(str(path), MAX_CONFIG_BYTES).decode("utf-8")
    except UnsafeFile as exc:
        raise ConfigUnreadable(f"{path}: cannot read config: {exc.reason}") from None
    except (OSError, UnicodeDecodeError, ValueError) as exc:  # ValueError: a NUL byte in the path
        raise ConfigUnreadable(f"{path}: cannot read config: {exc}") from None
    return parse_text(text, str(path))


def json_schema() -> dict[str, Any]:
    schema = Document.model_json_schema(by_alias=True)
    schema["$schema"] = "https://json-schema.org/draft/2020-12/schema"
    schema["title"] = "nodeguard config"
    return schema
