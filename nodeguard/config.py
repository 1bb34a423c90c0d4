"""The per-node JSON config: typed model, validation errors with paths, node selection.

A document has a ``global`` section and a ``perNode`` list of rules. Each rule
has a ``nodeSelector`` and any sections of ``global``; the settings of the
node are ``global`` with every matching rule laid over it in list order
(objects merge key by key, lists and scalars are replaced, later rules win).
"""

from __future__ import annotations

import ipaddress
import json
import re
from collections.abc import Mapping, Sequence
from pathlib import Path, PurePosixPath
from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator,
    BaseModel,
    Field,
    PlainSerializer,
    ValidationError,
    ValidationInfo,
    WithJsonSchema,
    field_validator,
    model_validator,
)
from pydantic_core import PydanticCustomError

from nodeguard.atomic_file import UnsafeFile, read_regular_file
from nodeguard.config_base import Model
from nodeguard.coordination.settings import CoordinationSettings
from nodeguard.errors import ConfigError, ConfigUnreadable
from nodeguard.gate.settings import GateSettings
from nodeguard.kubernetes.settings import KubernetesSettings
from nodeguard.model.workloads import QosClass, is_kubepods_top
from nodeguard.policy.metrics import CAPABILITIES, Metric, Unit
from nodeguard.policy.ranking import COMPARATORS
from nodeguard.preview import json_preview
from nodeguard.quantity import Quantity, parse_quantity

ThresholdValue = Annotated[
    Quantity,
    PlainSerializer(Quantity.dump),
    WithJsonSchema(
        {
            "anyOf": [
                {"type": "number", "minimum": 0},
                {"type": "string", "pattern": r"^\s*[0-9.]+\s*(%|m|[KMGTP]i?B?|k)?\s*$"},
            ],
            "description": 'an amount in the metric\'s unit (cores, bytes like "8Gi", '
            'percent, load per core) or a percentage of node capacity like "80%"',
        }
    ),
]


def _kubepods_path(value: str) -> str:
    path = value.strip("/")
    parts = path.split("/")
    if not path or ".." in parts or "." in parts or "" in parts:
        raise ValueError("expected a cgroup path below the root, without '..'")
    if not is_kubepods_top(parts[-1]):
        raise ValueError("expected kubelet's kubepods cgroup itself: a path ending in kubepods or kubepods.slice")
    return path


KubepodsPath = Annotated[
    str,
    AfterValidator(_kubepods_path),
    WithJsonSchema({"type": "string", "pattern": r"(^|/)(kubepods|kubepods\.slice|[^/]*-kubepods\.slice)/?$"}),
]


class SensingSettings(Model):
    cgroup_root: str = Field("/sys/fs/cgroup", description="cgroup mount (/host/sys/fs/cgroup in a pod)")
    proc_root: str = Field("/proc", description="proc mount (/host/proc in a pod without hostPID)")
    cgroup_version: Literal["auto", "v1", "v2"] = "auto"
    tick_seconds: float = Field(1.0, gt=0.01, le=3600)
    discovery_seconds: float = Field(5.0, gt=0, le=3600, description="how often to look for new workloads")
    kubepods: bool = Field(True, description="discover Kubernetes pod cgroups")
    kubepods_paths: list[KubepodsPath] = Field(
        [],
        description="kubelet's kubepods cgroups below the cgroup root, e.g. kubepods.slice or "
        "kubelet.slice/kubelet-kubepods.slice; empty: found by searching",
    )

    @field_validator("cgroup_root", "proc_root")
    @classmethod
    def _absolute(cls, value: str) -> str:
        if not value.startswith("/"):
            raise ValueError("expected an absolute path")
        return value


class WorkloadGroup(Model):
    """Cgroups of a plain host that nodeguard treats as workloads."""

    match: str = Field(description="glob of cgroup paths below the root, e.g. system.slice/batch-*.service")
    class_: QosClass = Field(QosClass.BEST_EFFORT, alias="class")
    priority: int = Field(0, ge=-(2**31), le=2**31 - 1)
    protected: bool = False

    @field_validator("match")
    @classmethod
    def _relative_glob(cls, value: str) -> str:
        parts = PurePosixPath(value).parts
        if not parts or value.startswith("/") or ".." in parts:
            raise ValueError("expected a relative cgroup path pattern without '..'")
        return value


class WorkloadSettings(Model):
    groups: list[WorkloadGroup] = []


class HttpSettings(Model):
    """The daemon's HTTP endpoints: /metrics, /healthz, /readyz, /status."""

    enabled: bool = True
    listen: str = Field("127.0.0.1:9466", description="HOST:PORT; loopback by default")

    @field_validator("listen")
    @classmethod
    def _host_port(cls, value: str) -> str:
        host, sep, port = value.rpartition(":")
        if not sep or not host or not port.isdigit() or not 0 <= int(port) < 65536:
            raise ValueError('expected HOST:PORT like "127.0.0.1:9466"')
        if not _valid_host(host.removeprefix("[").removesuffix("]") if host.startswith("[") else host):
            raise ValueError("expected an IP address or a host name before the port")
        return value


_HOST_LABEL = re.compile(r"^(?!-)[A-Za-z0-9-]{1,63}(?<!-)$")


def _valid_host(host: str) -> bool:
    """An IPv4 or IPv6 address, or a DNS name; "999.1.1.1" is neither (a name cannot be all digits)."""
    try:
        ipaddress.ip_address(host)
        return True
    except ValueError:
        pass
    labels = host.removesuffix(".").split(".")
    if len(host) > 253 or not all(_HOST_LABEL.match(label) for label in labels):
        return False
    return not labels[-1].isdigit()


def _file_path(value: str) -> str:
    """An absolute path naming a file: not a directory ("/", "/run/"), no "." or ".." at its end."""
    if not value.startswith("/"):
        raise ValueError("expected an absolute path")
    if value.endswith("/") or PurePosixPath(value).name in ("", ".", ".."):
        raise ValueError("expected the path of a file, not of a directory")
    return value


class ActuationSettings(Model):
    """How nodeguard changes the system, and how it undoes it."""

    dry_run: bool = Field(False, description="log every write and eviction instead of making it")
    ledger_path: str = Field("/run/nodeguard/ledger.json", description="the ledger of original quotas")
    on_start: Literal["restore", "adopt"] = Field(
        "restore", description="throttles found in the ledger at start: restore them, or keep holding them"
    )
    on_exit: Literal["restore", "keep"] = Field("restore", description="throttles held when the daemon stops")
    eviction_grace_seconds: float = Field(10.0, ge=0, le=3600)
    freeze_before_eviction: bool = True

    @field_validator("ledger_path")
    @classmethod
    def _file(cls, value: str) -> str:
        return _file_path(value)


def _known_comparator(name: str) -> str:
    if name not in COMPARATORS:
        raise ValueError(f"unknown comparator; expected one of {', '.join(COMPARATORS)}")
    return name


ComparatorName = Annotated[
    str, AfterValidator(_known_comparator), WithJsonSchema({"type": "string", "enum": list(COMPARATORS)})
]


class Objective(Model):
    """One waterline: act on workloads while a node metric is past a threshold."""

    name: str | None = None
    metric: Metric
    threshold: ThresholdValue
    action: Literal["throttle", "evict"]
    trigger_after: int = Field(2, ge=1, le=1000)
    restore_below: ThresholdValue | None = Field(None, validate_default=True)
    restore_after: int = Field(3, ge=1, le=1000)
    dry_run: bool = False
    sort_by: list[ComparatorName] | None = Field(
        None,
        min_length=1,
        description="comparators that order the candidates, least important first; default: the metric's own",
    )

    @field_validator("threshold", mode="before")
    @classmethod
    def _threshold(cls, raw: object, info: ValidationInfo) -> Quantity:
        return parse_quantity(raw, _unit(info))

    @field_validator("action")
    @classmethod
    def _action_possible(cls, action: str, info: ValidationInfo) -> str:
        metric = info.data.get("metric")
        if metric is not None and action == "throttle" and not CAPABILITIES[metric].throttleable:
            raise ValueError(f"{metric} cannot be throttled (its resource is incompressible); use evict")
        if metric is not None and action == "throttle" and CAPABILITIES[metric].raised_by_throttling:
            raise ValueError(f"a throttle objective on {metric} would feed on itself: {_SELF_INFLICTED}")
        return action

    @field_validator("restore_below", mode="before")
    @classmethod
    def _restore_below(cls, raw: object, info: ValidationInfo) -> Quantity | None:
        action = info.data.get("action")
        if action == "evict":
            if raw is not None:
                raise ValueError("restoreBelow applies to throttle objectives only")
            return None
        if raw is None:
            if action == "throttle":
                raise ValueError("a throttle objective needs restoreBelow, strictly below threshold")
            return None
        restore = parse_quantity(raw, _unit(info))
        threshold = info.data.get("threshold")
        if threshold is not None:
            if not restore.same_kind(threshold):
                raise ValueError("must be given in the same unit as threshold (both percentages or neither)")
            if restore.value >= threshold.value:
                raise ValueError(f"must be strictly below threshold ({threshold.raw!r}): that gap is the dead-band")
        return restore


_SELF_INFLICTED = (
    "a CFS-throttled task stays runnable, so nodeguard's own throttles raise node CPU pressure (one busy "
    "workload throttled to 20 % of a core on an idle node reads 79 % 'some'); throttle on cpu_total_utilization "
    "or cpu_total_usage"
)


def _unit(info: ValidationInfo) -> Unit:
    metric = info.data.get("metric")
    # An invalid metric is reported on its own; parse the threshold as cores then.
    return CAPABILITIES[metric].unit if metric is not None else Unit.CORES


class Candidates(Model):
    """Which workloads the guard may act on."""

    classes: list[QosClass] = [QosClass.BEST_EFFORT, QosClass.BURSTABLE]
    below_priority: int | None = Field(None, description="only workloads with a lower priority")


class EvictionBudget(Model):
    max_per_tick: int = Field(1, ge=0, le=1000, description="evictions in one round (one tick)")
    min_interval_seconds: float = Field(30.0, ge=0, le=86_400, description="between two rounds of evictions")
    termination_timeout_seconds: float = Field(
        300.0, gt=0, le=86_400, description="an evicted workload still present after this no longer counts as releasing"
    )


class GuardSettings(Model):
    objectives: list[Objective] = []
    candidates: Candidates = Candidates()
    min_quota_cores: float = Field(0.05, gt=0, le=100_000, description="a throttle never goes below this")
    restore_step_percent: float = Field(10.0, gt=0, le=100, description="largest quota increase per tick, % of node")
    target_margin_percent: float = Field(
        1.0, ge=0, le=50, description="a throttle aims this far under the waterline, % of node CPU"
    )
    min_change_percent: float = Field(1.0, ge=0, le=100, description="skip quota changes smaller than this, % of node")
    cooldown_ticks: int = Field(3, ge=1, le=1000, description="wait after acting on a non-quantified metric")
    closed_loop_step_percent: float = Field(
        50.0, gt=0, le=100, description="a non-quantified metric lowers one workload's CPU by this % of its usage"
    )
    failed_write_backoff_seconds: float = Field(
        30.0,
        gt=0,
        le=3600,
        description="a workload whose quota write the kernel refused is no candidate for this long, "
        "doubling with each refusal in a row up to 20 times as long",
    )
    evictions: EvictionBudget = EvictionBudget()
    dry_run: bool = False

    @model_validator(mode="after")
    def _no_self_inflicted_evictions(self) -> GuardSettings:
        if not any(o.action == "throttle" for o in self.objectives):
            return self
        for index, objective in enumerate(self.objectives):
            if objective.action == "evict" and CAPABILITIES[objective.metric].raised_by_throttling:
                raise PydanticCustomError(
                    "self_inflicted",
                    "objectives[{index}].metric is {metric}: an evict objective on it beside throttle objectives "
                    "would evict for the pressure the throttles cause: {why}",
                    {"index": index, "metric": str(objective.metric), "why": _SELF_INFLICTED},
                )
        return self


class Settings(Model):
    """The effective settings of one node."""

    sensing: SensingSettings = SensingSettings()
    workloads: WorkloadSettings = WorkloadSettings()
    guard: GuardSettings = GuardSettings()
    actuation: ActuationSettings = ActuationSettings()
    http: HttpSettings = HttpSettings()
    gate: GateSettings = GateSettings()
    coordination: CoordinationSettings = CoordinationSettings()
    kubernetes: KubernetesSettings = KubernetesSettings()


class LabelExpression(Model):
    key: str
    operator: Literal["In", "NotIn", "Exists", "DoesNotExist"]
    values: list[str] = []

    @model_validator(mode="after")
    def _values_fit_operator(self) -> LabelExpression:
        if self.operator in ("In", "NotIn") and not self.values:
            raise ValueError(f"operator {self.operator} needs values")
        if self.operator in ("Exists", "DoesNotExist") and self.values:
            raise ValueError(f"operator {self.operator} takes no values")
        return self

    def matches(self, labels: Mapping[str, str]) -> bool:
        if self.operator == "Exists":
            return self.key in labels
        if self.operator == "DoesNotExist":
            return self.key not in labels
        inside = labels.get(self.key) in self.values
        return inside if self.operator == "In" else self.key in labels and not inside


class NodeSelector(Model):
    """Kubernetes label-selector semantics: every term must match; empty matches all."""

    match_labels: dict[str, str] = {}
    match_expressions: list[LabelExpression] = []

    def matches(self, labels: Mapping[str, str]) -> bool:
        return all(labels.get(k) == v for k, v in self.match_labels.items()) and all(
            expr.matches(labels) for expr in self.match_expressions
        )


class NodeRule(Settings):
    node_selector: NodeSelector


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


def _aliases() -> dict[str, str]:
    """Field name -> JSON key, for every config model."""
    aliases: dict[str, str] = {}
    pending: list[type[BaseModel]] = [Model]
    while pending:
        cls = pending.pop()
        pending += cls.__subclasses__()
        for name, field in cls.model_fields.items():
            aliases[name] = field.alias or name
    return aliases


def format_location(loc: Sequence[int | str]) -> str:
    # Pydantic reports a validated default by its Python name, not its JSON key.
    aliases = _aliases()
    path = ""
    for part in loc:
        if isinstance(part, int):
            path += f"[{part}]"
        else:
            key = aliases.get(part, part) if "_" in part else part
            path += f".{key}" if path else key
    return path or "(document)"


def _render_input(value: object) -> str:
    return json_preview(value, 80)  # bounded: the value may nest a thousand levels deep


def _message(error: Mapping[str, Any]) -> str:
    kind = error["type"]
    if kind == "extra_forbidden":
        return "unknown key"
    if kind == "missing":
        return "required key missing"
    message = str(error["msg"])
    for prefix in ("Value error, ", "Assertion failed, "):
        message = message.removeprefix(prefix)
    return message


def format_errors(exc: ValidationError) -> list[str]:
    """One line per problem: ``path: what was expected, got value``."""
    lines = []
    for error in exc.errors(include_url=False):
        # Pydantic appends the failing branch of a union or a validator's name to
        # the location; they are not keys of the document.
        loc = [p for p in error["loc"] if isinstance(p, int) or not p.startswith(("function-", "union["))]
        line = f"{format_location(loc)}: {_message(error)}"
        if error["type"] != "missing" and error["input"] is not None:
            line += f", got {_render_input(error['input'])}"
        lines.append(line)
    return lines


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

