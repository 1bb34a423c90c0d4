"""The guard's config section: objectives (waterlines), candidates, and how far and how fast to act."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import (
    AfterValidator,
    Discriminator,
    Field,
    GetJsonSchemaHandler,
    PlainSerializer,
    Tag,
    ValidationInfo,
    WithJsonSchema,
    field_validator,
    model_validator,
)
from pydantic.json_schema import JsonSchemaValue
from pydantic_core import CoreSchema, PydanticCustomError

from nodeguard.config_base import BRANCH, Model, cross_field
from nodeguard.model.workloads import QosClass
from nodeguard.policy.metrics import CAPABILITIES, Metric
from nodeguard.policy.ranking import COMPARATORS
from nodeguard.quantity import Quantity, Unit, parse_quantity
from nodeguard.selectors import LabelSelector, Namespace, PodSelector

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


def _known_comparator(name: str) -> str:
    if name not in COMPARATORS:
        raise ValueError(f"unknown comparator; expected one of {', '.join(COMPARATORS)}")
    return name


ComparatorName = Annotated[
    str, AfterValidator(_known_comparator), WithJsonSchema({"type": "string", "enum": list(COMPARATORS)})
]


def _protect_branch(raw: object) -> str | None:
    if isinstance(raw, str):
        return f"{BRANCH}glob"
    return f"{BRANCH}selector" if isinstance(raw, dict | PodSelector) else None


# A glob on a workload's name or cgroup path, or a pod selector; errors name neither branch (config_base.BRANCH).
ProtectEntry = Annotated[
    Annotated[str, Tag(f"{BRANCH}glob")] | Annotated[PodSelector, Tag(f"{BRANCH}selector")],
    Discriminator(
        _protect_branch,
        custom_error_type="protect_entry",
        custom_error_message="expected a glob (a string) or a pod selector (an object)",
    ),
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
    @cross_field("`threshold` in the unit of `metric`; as a percentage ≤ 100 (any for `load_average`)", "threshold")
    def _threshold(cls, raw: object, info: ValidationInfo) -> Quantity:
        return parse_quantity(raw, _unit(info))

    protect: list[ProtectEntry] | None = Field(
        None,
        min_length=1,
        description="protected_cpu_stall and protected_memory_stall only: the workloads it protects, each a glob "
        'on the name (a pod\'s is "namespace/name") or the cgroup path, or a pod selector (`namespaces`, '
        "`labelSelector`); default: Guaranteed pods and workloads protected otherwise",
    )

    @field_validator("action")
    @classmethod
    @cross_field("`action` one that `metric` takes (see [Objective metrics](#objective-metrics))", "action")
    def _action_possible(cls, action: str, info: ValidationInfo) -> str:
        metric = info.data.get("metric")
        if metric is not None and action == "evict" and not CAPABILITIES[metric].evictable:
            raise ValueError(f"{metric} cannot drive evictions; use throttle")
        if metric is not None and action == "throttle" and not CAPABILITIES[metric].throttleable:
            raise ValueError(f"{metric} cannot be throttled (its resource is incompressible); use evict")
        if metric is not None and action == "throttle" and CAPABILITIES[metric].raised_by_throttling:
            raise ValueError(f"a throttle objective on {metric} would feed on itself: {_SELF_INFLICTED}")
        return action

    @field_validator("restore_below", mode="before")
    @classmethod
    @cross_field("`restoreBelow` required with `action` `throttle`, not allowed with `evict`", "restoreBelow")
    @cross_field("`restoreBelow` < `threshold`, both percentages or neither", "restoreBelow")
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

    @model_validator(mode="after")
    @cross_field("`protect` only with `metric` `protected_cpu_stall` or `protected_memory_stall`", "protect")
    def _protect_needs_stall(self) -> Objective:
        if self.protect is not None and not CAPABILITIES[self.metric].protected:
            raise PydanticCustomError(
                "protect_without_stall",
                "protect selects the workloads a protected_cpu_stall or protected_memory_stall objective protects; "
                "{metric} is a node metric",
                {"metric": str(self.metric)},
            )
        return self


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
    namespaces: list[Namespace] | None = Field(
        None, min_length=1, description="only pods in these namespaces (configured groups are no pods); default: any"
    )
    label_selector: LabelSelector | None = Field(
        None, description="only pods whose labels it matches (configured groups are no pods); default: any"
    )
    pods_without_metadata: bool = Field(
        False,
        description="pods whose metadata nodeguard does not have (the Kubernetes integration off, or a pod the API "
        "has not listed yet) may be candidates, by their cgroup's QoS class alone; risky: system-critical pods, "
        "the nodeguard.io annotations and guard.exempt cannot be told apart without metadata, so a CNI agent or "
        "CoreDNS is throttled like batch work",
    )


class Exempt(Model):
    """Pods the guard never acts on, whatever else selects them (they may still be protected)."""

    namespaces: list[Namespace] = Field(["kube-system"], description="pods in these namespaces")
    own_namespace: bool = Field(True, description="pods in the namespace of nodeguard's own pod")
    pods: list[PodSelector] = Field([], description="pods any of these selects")


class EvictionBudget(Model):
    max_per_tick: int = Field(1, ge=0, le=1000, description="evictions in one round (one tick)")
    min_interval_seconds: float = Field(30.0, ge=0, le=86_400, description="between two rounds of evictions")
    termination_timeout_seconds: float = Field(
        300.0, gt=0, le=86_400, description="an evicted workload still present after this no longer counts as releasing"
    )


class ProtectSettings(Model):
    """The tuning of protected_cpu_stall's phases (nodeguard.policy.protect): weights first, then quotas on trial."""

    weight_hold_seconds: float = Field(
        300.0,
        ge=0,
        le=86_400,
        description="a lowered weight is put back once no protected workload has been harmed for this long "
        "(and the work under it no longer waits for CPU the node does not have)",
    )
    drain_share: float = Field(
        0.5,
        ge=0,
        le=1,
        description="after weights come down, quotas wait while the stall is at most this share of what it was: "
        "the weights work, and what is left drains",
    )
    drain_patience_ticks: int = Field(
        20, ge=0, le=1000, description="how many ticks after the last weights came down that draining may last"
    )
    streak_ticks: int = Field(
        4,
        ge=1,
        le=1000,
        description="with the weights down, quotas wait for the stall to stay over target this many ticks in a row",
    )
    trial_ticks: int = Field(
        10, ge=1, le=1000, description="quotas set for the stall after the weights are judged after this many ticks"
    )
    futile_share: float = Field(
        0.7,
        gt=0,
        le=1,
        description="quotas whose mean stall over their trial is above this share of the stall that brought them "
        "buy nothing: they all go back",
    )
    quota_off_seconds: float = Field(
        300.0, ge=0, le=86_400, description="how long the quota lever stays off after quotas judged futile"
    )
    quiet_ticks: int = Field(
        3,
        ge=1,
        le=1000,
        description="a lowered weight goes back only after the work under it has not waited for CPU the node "
        "lacks (or its demand was unknown) this many ticks in a row",
    )


def _bytes(raw: object) -> int:
    """Bytes given as a number or like "64Mi" (no percentage: these are per workload)."""
    if isinstance(raw, str) and raw.strip().endswith("%"):
        raise ValueError('expected bytes (a number, or like "64Mi"), not a percentage')
    return round(parse_quantity(raw, Unit.BYTES).value)


class _BytesSchema:
    """The JSON Schema of bytes given as a number or like "64Mi": the number with the field's own bounds."""

    def __get_pydantic_json_schema__(self, schema: CoreSchema, handler: GetJsonSchemaHandler) -> JsonSchemaValue:
        return {
            "anyOf": [handler(schema), {"type": "string", "pattern": r"^\s*[0-9.]+\s*([KMGTP]i?B?|k)?\s*$"}],
            "description": 'bytes: a number, or like "64Mi", "1G"',
        }


ByteAmount = Annotated[int, _BytesSchema()]


class MemorySettings(Model):
    """How throttle objectives on memory metrics move memory.high (nodeguard.policy.memory; cgroup v2 only)."""

    min_high: ByteAmount = Field(
        64 << 20,
        ge=1 << 20,
        description="a workload's memory.high is never lowered below this (nor below its memory request): "
        "above memory.high the kernel slows its allocations and reclaims, it does not kill",
    )
    step_percent: float = Field(
        20.0,
        gt=0,
        le=100,
        description="the most a memory.high comes down in one tick, % of what the workload uses: the kernel "
        "reclaims inside the write, and a workload meets the limit a step at a time",
    )
    restore_step_percent: float = Field(
        5.0, gt=0, le=100, description="largest memory.high increase per tick, in all, % of node memory"
    )

    @field_validator("min_high", mode="before")
    @classmethod
    def _min_high(cls, raw: object) -> int:
        return _bytes(raw)


class GuardSettings(Model):
    objectives: list[Objective] = []
    candidates: Candidates = Candidates()
    exempt: Exempt = Field(
        Exempt(), description="pods never acted on: kube-system's and nodeguard's own namespace unless changed"
    )
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
    throttle_period_us: int | None = Field(
        None,
        ge=1000,
        le=1_000_000,
        description="the CFS period a throttle writes, in microseconds (a short one spreads a throttled "
        "workload's bursts); default: the workload's own; restores write the original back",
    )
    protect_lever: Literal["weight", "quota"] = Field(
        "weight",
        description="protected_cpu_stall acts first by lowering the CPU weight of the groups that compete with the "
        "harmed workload (work-conserving; bench/protect.py), then by quota; 'quota': by quota only",
    )
    protect: ProtectSettings = Field(
        ProtectSettings(), description="how protected_cpu_stall moves from the weight lever to quotas and back"
    )
    weight_hold_seconds: float | None = Field(
        None,
        ge=0,
        le=86_400,
        description="deprecated, use protect.weightHoldSeconds: sets it, and protect.quotaOffSeconds unless that "
        "is given (they were one timer)",
        json_schema_extra={"deprecated": True},
    )
    failed_write_backoff_seconds: float = Field(
        30.0,
        gt=0,
        le=3600,
        description="a workload whose quota write the kernel refused is no candidate for this long, "
        "doubling with each refusal in a row up to 20 times as long",
    )
    evictions: EvictionBudget = EvictionBudget()
    memory: MemorySettings = Field(
        MemorySettings(),
        description="how throttle objectives on memory_total_utilization and memory_total_usage lower memory.high",
    )
    dry_run: bool = False

    @model_validator(mode="after")
    @cross_field("`weightHoldSeconds` equal to `protect.weightHoldSeconds` when both are given", "weightHoldSeconds")
    def _weight_hold_alias(self) -> GuardSettings:
        # The deprecated top-level key drove both timers; it fills what protect does not set itself.
        hold = self.weight_hold_seconds
        if hold is None:
            return self
        given = self.protect.model_fields_set
        if "weight_hold_seconds" in given and self.protect.weight_hold_seconds != hold:
            raise PydanticCustomError(
                "weight_hold_twice",
                "weightHoldSeconds ({hold}) and protect.weightHoldSeconds ({inner}) disagree; keep "
                "protect.weightHoldSeconds",
                {"hold": hold, "inner": self.protect.weight_hold_seconds},
            )
        update = {"weight_hold_seconds": hold}
        if "quota_off_seconds" not in given:
            update["quota_off_seconds"] = hold
        protect = self.protect.model_copy(update=update)
        object.__setattr__(self, "protect", protect)  # frozen: set once, while validating
        return self

    @model_validator(mode="after")
    @cross_field("no `evict` objective on `cpu_pressure` beside a `throttle` objective", "objectives")
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
