"""Label and pod selectors with Kubernetes semantics, for every place the config chooses nodes or pods.

``LabelSelector`` is Kubernetes' ``metav1.LabelSelector``: every ``matchLabels``
pair and every ``matchExpressions`` requirement must hold, and an empty
selector matches everything. The operators are the API's: ``In`` (the label is
set to one of ``values``), ``NotIn`` (it is not: a missing label matches),
``Exists`` and ``DoesNotExist``. ``perNode``'s ``nodeSelector`` matches a
node's labels with it; ``PodSelector`` adds the namespaces, for the pods
nodeguard may act on, protects, or leaves alone.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from typing import Annotated, Literal

from pydantic import AfterValidator, Field, WithJsonSchema, model_validator

from nodeguard.config_base import Model, cross_field

# Kubernetes' validation (apimachinery's validation.IsQualifiedName, IsValidLabelValue, IsDNS1123Label).
_NAME = r"([A-Za-z0-9][-A-Za-z0-9_.]*)?[A-Za-z0-9]"
_PREFIX = r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*"
_LABEL_KEY = re.compile(rf"(?:{_PREFIX}/)?{_NAME}")
_LABEL_VALUE = re.compile(rf"(?:{_NAME})?")
_NAMESPACE = re.compile(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?")


def label_key(key: str) -> str:
    prefix, _, name = key.rpartition("/")
    if not _LABEL_KEY.fullmatch(key) or len(name) > 63 or len(prefix) > 253:
        raise ValueError(
            "expected a label key: an optional DNS subdomain prefix and '/', then a name of at most 63 letters, "
            "digits, '-', '_' or '.', beginning and ending with a letter or digit"
        )
    return key


def label_value(value: str) -> str:
    if len(value) > 63 or not _LABEL_VALUE.fullmatch(value):
        raise ValueError(
            "expected a label value: empty, or at most 63 letters, digits, '-', '_' or '.', beginning and ending "
            "with a letter or digit"
        )
    return value


def namespace_name(name: str) -> str:
    if len(name) > 63 or not _NAMESPACE.fullmatch(name):
        raise ValueError("expected a namespace name: at most 63 lower-case letters, digits or '-', not at either end")
    return name


LabelKey = Annotated[
    str, AfterValidator(label_key), WithJsonSchema({"type": "string", "pattern": f"^{_LABEL_KEY.pattern}$"})
]
LabelValue = Annotated[
    str,
    AfterValidator(label_value),
    WithJsonSchema({"type": "string", "maxLength": 63, "pattern": f"^{_LABEL_VALUE.pattern}$"}),
]
Namespace = Annotated[
    str,
    AfterValidator(namespace_name),
    WithJsonSchema({"type": "string", "maxLength": 63, "pattern": f"^{_NAMESPACE.pattern}$"}),
]


class LabelRequirement(Model):
    """A requirement of `matchExpressions`: a label compared with values."""

    key: LabelKey = Field(description="the label")
    operator: Literal["In", "NotIn", "Exists", "DoesNotExist"] = Field(
        description="In: the label is one of `values`; NotIn: it is not (a missing label matches); Exists; DoesNotExist"
    )
    values: list[LabelValue] = Field([], description="the values `In` and `NotIn` compare with")

    @model_validator(mode="after")
    @cross_field("`In` and `NotIn` need `values`; `Exists` and `DoesNotExist` take none", "operator", "values")
    def _values_fit_operator(self) -> LabelRequirement:
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
        value = labels.get(self.key)
        inside = value is not None and value in self.values
        return inside if self.operator == "In" else not inside


class LabelSelector(Model):
    """Kubernetes label-selector semantics: every term must hold; an empty selector matches everything."""

    match_labels: dict[LabelKey, LabelValue] = Field({}, description="labels that must each have this value")
    match_expressions: list[LabelRequirement] = Field([], description="requirements that must all hold")

    def matches(self, labels: Mapping[str, str]) -> bool:
        return all(labels.get(k) == v for k, v in self.match_labels.items()) and all(
            requirement.matches(labels) for requirement in self.match_expressions
        )

    def shown(self) -> str:
        """The selector as ``kubectl get -l`` takes it, e.g. ``app=web,tier notin (gold),!gpu``."""
        terms = [f"{k}={v}" for k, v in self.match_labels.items()]
        for r in self.match_expressions:
            if r.operator == "Exists":
                terms.append(r.key)
            elif r.operator == "DoesNotExist":
                terms.append(f"!{r.key}")
            else:
                terms.append(f"{r.key} {r.operator.lower()} ({','.join(r.values)})")
        return ",".join(terms) or "(every label set)"


class PodSelector(Model):
    """Pods by namespace and labels: both must hold where both are given. Configured groups are no pods."""

    namespaces: list[Namespace] | None = Field(None, min_length=1, description="pods in one of these namespaces")
    label_selector: LabelSelector | None = Field(None, description="pods whose labels it matches")

    @model_validator(mode="after")
    @cross_field("at least one of `namespaces` and `labelSelector`", "namespaces", "labelSelector")
    def _selects_something(self) -> PodSelector:
        if self.namespaces is None and self.label_selector is None:
            raise ValueError("select by namespaces, labelSelector or both (an empty selector would take every pod)")
        return self

    def matches(self, namespace: str | None, labels: Mapping[str, str]) -> bool:
        """Whether a pod in ``namespace`` (None: unknown) with ``labels`` is selected."""
        if self.namespaces is not None and namespace not in self.namespaces:
            return False
        return self.label_selector is None or self.label_selector.matches(labels)

    def shown(self) -> str:
        parts = []
        if self.namespaces is not None:
            parts.append("namespaces " + ",".join(self.namespaces))
        if self.label_selector is not None:
            parts.append("labels " + self.label_selector.shown())
        return "; ".join(parts)
