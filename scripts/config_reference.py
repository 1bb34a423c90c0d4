"""Print the configuration reference (docs/reference/configuration.md) from the config's JSON Schema.

    .venv/bin/python scripts/config_reference.py > docs/reference/configuration.md

Every key of every section comes from ``nodeguard.config.json_schema()`` (what
``nodeguard schema`` prints): its type, default, bounds and description; the
bounds are the ones the models validate (tests/docs/test_config_bounds.py probes
each), and the rules across keys come from the validators that check them
(``nodeguard.config_base.cross_field``). The objective metrics and actions
come from the capability registry (``nodeguard.policy.metrics.CAPABILITIES``)
and the comparators from ``nodeguard.policy.ranking``. A key without a description in the models takes
its meaning from ``MEANINGS`` below; a key with neither stops the generator, so
a new key cannot go undocumented. Not imported by the daemon.
"""

from __future__ import annotations

import json
import re
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel

from nodeguard.config import Document, json_schema
from nodeguard.config_base import Model, rules_of
from nodeguard.policy.metrics import CAPABILITIES, Metric
from nodeguard.policy.ranking import COMPARATORS

COMMAND = ".venv/bin/python scripts/config_reference.py > docs/reference/configuration.md"

# Meanings of the keys whose models carry no description (taken from the README and the code that reads them),
# by section path: "guard.objectives[].metric" is a key of each item of guard.objectives.
MEANINGS = {
    "$schema": "the JSON Schema the file follows (`packaging/nodeguard.schema.json`); ignored by nodeguard",
    "global": "the settings of every node",
    "perNode": "rules laid over `global` on the nodes their `nodeSelector` matches, in list order",
    "perNode[].nodeSelector": "which nodes the rule applies to: a [label selector](#labelselector) on the node's "
    "labels",
    "labelSelector": "Kubernetes label-selector semantics, the same for a rule's `nodeSelector` (the node's labels) "
    "and for pods (`guard.candidates.labelSelector`, a [pod selector](#podselector)'s): every term must hold; an "
    "empty selector matches everything",
    "podSelector": "pods by namespace and labels: an entry of `guard.exempt.pods`, or an object in an objective's "
    "`protect`; where both are given both must hold. Configured groups have neither: a pod selector never takes "
    "one",
    "sensing": "where and how often nodeguard reads the node",
    "sensing.cgroupVersion": "the cgroup hierarchy to read and write; `auto` detects it",
    "sensing.tickSeconds": "one tick (sense, plan, act, record) every this long: on a fixed grid, each tick up to 10 % "
    "of a period late at random, so that the ticks do not land on the same phase of a periodic workload every time",
    "workloads": "which cgroups are workloads on a plain host",
    "workloads.groups": "cgroups that are workloads, with their class, priority and protection",
    "workloads.groups[].class": "the QoS class the group is ranked as",
    "workloads.groups[].priority": "higher is more important (ranked later as a candidate)",
    "workloads.groups[].protected": "never acted on; protected by `protected_cpu_stall` and `protected_memory_stall` "
    "objectives",
    "guard": "the waterlines and how far and how fast the guard acts",
    "guard.objectives": "the waterlines; several on the same metric and action: the lowest threshold wins",
    "guard.objectives[].name": "a name for the waterline in plans, logs and status (default: `objectives[N]`)",
    "guard.objectives[].metric": "the node metric it watches (see [Objective metrics](#objective-metrics))",
    "guard.objectives[].action": "what the guard does past the threshold (see [Actions](#actions))",
    "guard.objectives[].threshold": "the waterline",
    "guard.objectives[].triggerAfter": "ticks past the threshold in a row before acting",
    "guard.objectives[].restoreBelow": "throttles are released below this (the dead-band between it and "
    "`threshold` keeps them from flapping)",
    "guard.objectives[].restoreAfter": "ticks below `restoreBelow` in a row before restoring",
    "guard.objectives[].dryRun": "log what this objective would do instead of doing it",
    "guard.candidates": "which workloads the guard may act on",
    "guard.candidates.classes": "QoS classes that may be throttled or evicted; protected workloads never are",
    "guard.evictions": "the eviction budget",
    "guard.dryRun": "log every action of the guard instead of making it",
    "actuation": "how nodeguard changes the system, and how it undoes it",
    "actuation.ledgerPath": "the ledger of originals: every lever's change (CPU quota, CPU weight, memory.high) is "
    "recorded there before it is written",
    "actuation.evictionGraceSeconds": "cgroup evictions: time between SIGTERM and killing what is left",
    "actuation.freezeBeforeEviction": "cgroup v2: freeze the group while signalling it (no new forks meanwhile)",
    "history": "the decision history: what nodeguard did to which pod, when and why (`nodeguard why`, `/history`)",
    "http": "the daemon's HTTP endpoints: /metrics, /healthz, /readyz, /status, /history",
    "http.enabled": "serve the HTTP endpoints",
    "gate": "the start gate: admission of process and container starts",
    "coordination": "cluster-wide caps shared over MQTT; the same on every node of the cluster",
    "coordination.enabled": "join the cluster's coordination (needs a broker)",
    "coordination.broker": "the MQTT v5 broker",
    "coordination.broker.host": "the broker's host name or address",
    "coordination.broker.port": "the broker's port",
    "coordination.broker.tls": "connect with TLS (an empty object: system CAs)",
    "coordination.broker.username": "user name for the broker",
    "coordination.broker.keepaliveSeconds": "MQTT keep-alive interval",
    "coordination.broker.connectTimeoutSeconds": "for each connection attempt",
    "coordination.broker.reconnectMaxSeconds": "the longest reconnect delay",
    "kubernetes": "pod metadata, evictions, Events and node labels from the Kubernetes API",
}

# Models used in several places, each shown once in a section of its own (by its JSON Schema title), and linked.
SHARED = {"LabelSelector": "labelSelector", "PodSelector": "podSelector"}

# Units by the end of a key's name, and of the keys whose name does not say.
UNIT_SUFFIXES = (
    ("Seconds", "seconds"),
    ("Ticks", "ticks"),
    ("Percent", "% of the node"),
    ("Us", "µs"),
    ("Cores", "cores"),
    ("Share", "fraction (0–1)"),
    ("After", "ticks"),
)
UNITS = {
    "maxCPU": "% of all cores",
    "closedLoopStepPercent": "% of its usage",
    "maxLoadAverageMultiplier": "× cores",
    "threshold": "the metric's",
    "restoreBelow": "the metric's",
    "minRate": "starts per second",
    "maxRate": "starts per second",
    "minHigh": "bytes",
    "maxBytes": "bytes",
    "stepPercent": "% of its usage",
}

METRIC_MEANINGS = {
    Metric.CPU_TOTAL_USAGE: "CPU the node uses",
    Metric.CPU_TOTAL_UTILIZATION: "CPU the node uses, as a share of all its cores",
    Metric.MEMORY_TOTAL_USAGE: "memory in use (`/proc/meminfo`)",
    Metric.MEMORY_TOTAL_UTILIZATION: "memory in use, as a share of the node's",
    Metric.CPU_PRESSURE: 'node CPU pressure: PSI "some" avg10 of `/proc/pressure/cpu`',
    Metric.LOAD_AVERAGE: "the 1-minute load average per core",
    Metric.PROTECTED_CPU_STALL: "the protected workloads' own CPU stall (runnable, not running; their own CFS "
    "throttling taken off); the worst one drives it. See [Protecting important workloads](../protect.md)",
    Metric.PROTECTED_MEMORY_STALL: 'the protected workloads\' own memory stall (`memory.pressure` "some": their '
    "refaults and reclaim waits, cgroup v2); the worst one drives it. See [Memory](../memory.md)",
}
METRIC_NOTES = {
    Metric.MEMORY_TOTAL_USAGE: "throttle lowers `memory.high` (cgroup v2 only; on v1 the objective is blocked "
    "`needs-cgroup-v2` and only evict acts)",
    Metric.MEMORY_TOTAL_UTILIZATION: "throttle lowers `memory.high` (cgroup v2 only; on v1 the objective is "
    "blocked `needs-cgroup-v2` and only evict acts)",
    Metric.PROTECTED_MEMORY_STALL: "throttle only, cgroup v2 only: every candidate's `memory.high` comes down one "
    "`guard.memory.stepPercent` step, then `cooldownTicks`; takes `protect` patterns",
    Metric.CPU_PRESSURE: "never throttled: a CFS-throttled task stays runnable, so nodeguard's own throttles "
    "raise it; `check-config` refuses an evict on it beside any throttle objective",
    Metric.PROTECTED_CPU_STALL: "throttle only: it lowers the competing groups' CPU weight first, "
    "then quotas (`guard.protectLever`, `guard.protect`); takes `protect` patterns",
}
COMPARATOR_MEANINGS = {
    "class_and_priority": "BestEffort before Burstable before Guaranteed, then lower priority first",
    "qos_class": "the class half of `class_and_priority` on its own",
    "priority": "the priority half of `class_and_priority` on its own: lower first",
    "cpu_usage": "more cores used first (throttling it releases most)",
    "ext_cpu_usage": "more CPU used beyond the workload's request first (a missing request counts as 0)",
    "memory_usage": "more memory first",
    "running_time": "the most recently started first; an unknown start time counts as the longest running",
}


class Undocumented(Exception):
    pass


@dataclass(frozen=True)
class Bounds:
    """The bounds of a number (of each value of an object, or item of a list, when ``each``); None: unbounded."""

    integer: bool
    minimum: float | None
    exclusive_minimum: float | None
    maximum: float | None
    each: bool

    def texts(self) -> list[str]:
        parts = []
        if self.minimum is not None:
            parts.append(f"≥ {_number(self.minimum)}")
        if self.exclusive_minimum is not None:
            parts.append(f"> {_number(self.exclusive_minimum)}")
        if self.maximum is not None:
            parts.append(f"≤ {_number(self.maximum)}")
        if self.each and parts:
            parts[0] = f"each {parts[0]}"
        return parts


def _models() -> dict[str, type[BaseModel]]:
    """Every config model by its name, the name its schema has in ``$defs``."""
    found: dict[str, type[BaseModel]] = {}
    pending: list[type[BaseModel]] = [Model]
    while pending:
        cls = pending.pop()
        pending += cls.__subclasses__()
        found[cls.__name__] = cls
    return found


def _bounds(schema: dict[str, Any], *, each: bool) -> Bounds:
    return Bounds(
        schema["type"] == "integer", schema.get("minimum"), schema.get("exclusiveMinimum"), schema.get("maximum"), each
    )


class Reference:
    def __init__(self) -> None:
        self.schema = json_schema()
        self.defs: dict[str, Any] = self.schema["$defs"]
        self.models = _models()

    def rules(self, path: str, schema: dict[str, Any]) -> dict[str, list[str]]:
        """Key -> the rules across keys that the section's model checks (declared on its validators)."""
        model = Document if path == "" else self.models.get(schema.get("title", ""))
        return {} if model is None else rules_of(model)

    def resolve(self, node: dict[str, Any]) -> dict[str, Any]:
        while "$ref" in node:
            node = {**self.defs[node["$ref"].rsplit("/", 1)[-1]], **{k: v for k, v in node.items() if k != "$ref"}}
        return node

    def object_of(self, node: dict[str, Any]) -> tuple[str, dict[str, Any]] | None:
        """(suffix, object schema) when the key holds an object with properties, or a list of them (or of
        either an object or something else)."""
        node = self.resolve(node)
        for each in node.get("anyOf", [node]):
            member = self.resolve(each)
            if "properties" in member:
                return "", member
            if member.get("type") == "array":
                items = self.resolve(member.get("items", {}))
                for item in (self.resolve(i) for i in items.get("oneOf", [items])):
                    if "properties" in item:
                        return "[]", item
        return None

    def shared_of(self, node: dict[str, Any]) -> str | None:
        """The section of a model shown once (``SHARED``) that the key holds, or None."""
        found = self.object_of(node)
        return None if found is None else SHARED.get(found[1].get("title", ""))

    def type_of(self, node: dict[str, Any]) -> str:
        node = self.resolve(node)
        if "anyOf" in node or "oneOf" in node:
            members = [self.type_of(m) for m in node.get("anyOf", node.get("oneOf", []))]
            optional = "null" in members
            text = " or ".join(dict.fromkeys(m for m in members if m != "null"))
            return f"{text} or null" if optional else text
        if "enum" in node:
            return " | ".join(f"`{json.dumps(v)}`" for v in node["enum"])
        kind = node.get("type")
        if kind == "array":
            item = self.resolve(node.get("items", {}))
            if "properties" in item:
                return "list of objects"
            return f"list of {self.type_of(item)}"
        if kind == "object":
            values = node.get("additionalProperties")
            if not isinstance(values, dict) and len(node.get("patternProperties", {})) == 1:
                [values] = node["patternProperties"].values()
            return f"object of {self.type_of(values)}" if isinstance(values, dict) else "object"
        if kind is None and "properties" in node:
            return "object"
        return {"integer": "integer", "number": "number", "string": "string", "boolean": "boolean"}.get(
            str(kind), str(kind)
        )

    def number_of(self, node: dict[str, Any]) -> Bounds | None:
        """The bounds of the number a key takes (or of each value or item of it), as validation applies them."""
        node = self.resolve(node)
        for each in node.get("anyOf", [node]):
            member = self.resolve(each)
            inner = member.get("additionalProperties") if member.get("type") == "object" else member.get("items")
            if isinstance(inner, dict) and self.resolve(inner).get("type") in ("integer", "number"):
                return _bounds(self.resolve(inner), each=True)
            if member.get("type") in ("integer", "number"):
                return _bounds(member, each=False)
        return None

    def bounds(self, node: dict[str, Any]) -> str:
        node = self.resolve(node)
        parts = []
        number = self.number_of(node)
        if number is not None:
            parts += number.texts()
        for each in node.get("anyOf", [node]):
            if "minItems" in (member := self.resolve(each)):
                parts.append(f"at least {member['minItems']} item(s)")
        return ", ".join(parts)

    def sections(self) -> Iterator[tuple[str, str, dict[str, Any]]]:
        """(path, heading suffix, object schema) of every object in the document, depth first, in key order."""
        document = {k: v for k, v in self.schema.items() if k != "$defs"}
        yield "", "", document
        settings = self.resolve({"$ref": "#/$defs/Settings"})
        yield "global", "", settings
        rule = self.resolve({"$ref": "#/$defs/NodeRule"})
        yield "perNode", "[]", {"properties": {"nodeSelector": rule["properties"]["nodeSelector"]},
                                "required": ["nodeSelector"]}  # fmt: skip
        for name, node in settings["properties"].items():
            yield from self._walk(name, node)
        for title, path in SHARED.items():
            yield from self._walk(path, {"$ref": f"#/$defs/{title}"}, shared=False)

    def _walk(
        self, path: str, node: dict[str, Any], *, shared: bool = True
    ) -> Iterator[tuple[str, str, dict[str, Any]]]:
        found = self.object_of(node)
        if found is None or (shared and self.shared_of(node) is not None):
            return
        suffix, schema = found
        yield path, suffix, schema
        for key, child in schema.get("properties", {}).items():
            yield from self._walk(f"{path}{suffix}.{key}", child)

    def meaning(self, path: str, node: dict[str, Any]) -> str:
        text = MEANINGS.get(path) or node.get("description")
        node = self.resolve(node)
        text = text or node.get("description")
        if text is None:
            for member in node.get("anyOf", []):
                text = text or self.resolve(member).get("description")
        if text is None:
            raise Undocumented(f"{path}: no description in the model, none in scripts/config_reference.py's MEANINGS")
        return text


def _number(value: float) -> str:
    return f"{value:,}".replace(",", " ") if isinstance(value, int) and abs(value) >= 10_000 else str(value)


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def _default(node: dict[str, Any], required: bool) -> str:
    if required:
        return "*required*"
    if "default" not in node:
        return ""
    value = node["default"]
    if isinstance(value, dict) and value:
        return "see below"
    return f"`{json.dumps(value, ensure_ascii=False)}`"


def unit_of(key: str) -> str:
    if key in UNITS:
        return UNITS[key]
    return next((unit for suffix, unit in UNIT_SUFFIXES if key.endswith(suffix)), "")


def anchor(path: str) -> str:
    """The heading id mkdocs gives a section heading ``path`` (toc's slugify: lower case, punctuation dropped)."""
    return re.sub(r"[^\w\- ]", "", path.lower()).strip().replace(" ", "-")


def heading(path: str, suffix: str) -> str:
    return f"{path}{suffix}" if path else "The document"


def render() -> str:
    ref = Reference()
    out = [
        "# Configuration reference",
        "",
        "<!-- Generated by scripts/config_reference.py from nodeguard's config models: do not edit by hand. -->",
        f"<!-- Regenerate: {COMMAND} -->",
        "",
        "One JSON file for the whole fleet, validated by `nodeguard check-config FILE` (its JSON Schema: "
        "`nodeguard schema`, also `packaging/nodeguard.schema.json`). Every object rejects unknown keys. "
        "Bounds are inclusive unless marked `>`; a rule across keys is shown beside each key it binds. Amounts "
        "such as thresholds take a number in the metric's "
        'unit, a string with a suffix (`"1500m"` cores, `"8Gi"` bytes) or a percentage of the node (`"80%"`).',
        "",
        "A node's settings are `global` with every matching `perNode` rule laid over it, in list order: objects "
        "merge key by key, lists (such as `objectives`) and scalars are replaced whole, and a later rule wins over "
        "an earlier one. A `perNode` rule has a `nodeSelector` and any of the sections of `global`.",
        "",
        "Sections: " + ", ".join(f"[`{p}{s}`](#{anchor(p + s)})" for p, s, _ in ref.sections() if p),
        "",
    ]
    for path, suffix, schema in ref.sections():
        title = heading(path, suffix)
        out += [f"## {title}" if path.count(".") == 0 else f"### {title}", ""]
        description = MEANINGS.get(path) if path else None
        description = description or schema.get("description")
        if path == "":
            description = "The top level of a config file."
        if description:
            out += [description[0].upper() + description[1:].rstrip(".") + ".", ""]
        required = set(schema.get("required", []))
        rules = ref.rules(path, schema)
        out += ["| key | type | default | unit | bounds and rules | meaning |", "|---|---|---|---|---|---|"]
        for key, node in schema.get("properties", {}).items():
            key_path = f"{path}{suffix}.{key}" if path and path != "global" else key
            meaning = ref.meaning(key_path, node)
            nested = ref.object_of(node)
            name = f"`{key}`"
            if nested is not None:
                target = ref.shared_of(node) or key_path + nested[0]
                name = f"[`{key}`](#{anchor(target)})"
            out.append(
                f"| {name} | {_cell(ref.type_of(node))} | {_cell(_default(ref.resolve(node), key in required))} "
                f"| {unit_of(key)} | {_cell('; '.join(filter(None, [ref.bounds(node), *rules.get(key, [])])))} "
                f"| {_cell(meaning)} |"
            )
        if path == "perNode":
            out.append("| any key of [`global`](#global) | | | | | laid over `global` where the selector matches |")
        out.append("")
        if path == "guard.objectives":
            out += objective_tables()
        if path == "guard.memory":
            out += MEMORY_EXAMPLE
    out += [
        "## Comparators",
        "",
        "Names for an objective's `sortBy`; the first sorts first, and first means "
        "*least important*: the first to be throttled or evicted. Ties go to the next comparator, the last "
        "tie to the workload id.",
        "",
        "| comparator | orders |",
        "|---|---|",
    ]
    for name in COMPARATORS:
        out.append(f"| `{name}` | {COMPARATOR_MEANINGS[name]} |")
    out.append("")
    return "\n".join(out)


MEMORY_EXAMPLE = [
    "#### Worked example: memory",
    "",
    "```json",
    '{"global": {"guard": {',
    '  "objectives": [',
    '    {"name": "memory-high-water", "metric": "memory_total_utilization", "action": "throttle",',
    '     "threshold": "85%", "restoreBelow": "75%"},',
    '    {"name": "memory-last-resort", "metric": "memory_total_utilization", "action": "evict", "threshold": "95%"},',
    '    {"name": "cache-reader", "metric": "protected_memory_stall", "action": "throttle",',
    '     "threshold": 10, "restoreBelow": 2, "protect": ["*cache-reader*"]}',
    "  ],",
    '  "memory": {"minHigh": "128Mi", "stepPercent": 20, "restoreStepPercent": 5}',
    "}}}",
    "```",
    "",
    "On a cgroup v2 node with 64 GiB, 57 GiB in use (89.1 %), two BestEffort pods `batch-a` (12 GiB) and "
    "`batch-b` (6 GiB) and a Guaranteed pod (20 GiB): `memory-high-water` is 4.06 % (2.6 GiB) past its waterline, "
    "and the guard aims `targetMarginPercent` (1 %, 0.64 GiB) below it: 3.24 GiB to hold back. The memory order "
    "puts `batch-a` first; `stepPercent` 20 lets its `memory.high` come down 2.4 GiB this tick, to 9.6 GiB; "
    "`batch-b` takes the remaining 0.84 GiB, to 5.16 GiB (values are whole 64 KiB units). The Guaranteed pod is "
    "no candidate. `nodeguard plan` shows both as `memory_throttle` with `memory.high max -> 9830Mi` and "
    "`-> 5284Mi`.",
    "",
    "Above `memory.high` the kernel reclaims the pods' page cache and makes their allocations wait; it does not "
    "kill them. Anonymous memory without swap cannot be reclaimed, so a pod that keeps allocating is held "
    "where it is rather than shrunk: if the node still reaches 95 %, `memory-last-resort` evicts. Once memory "
    "is below 75 % for `restoreAfter` ticks, the values rise by at most 5 % of node memory (3.2 GiB) a tick in "
    "all, most important first, and each goes back to its exact original (`max`, or kubelet's Memory QoS "
    "value) when the step reaches it or what the pod used when first throttled.",
    "",
    "`cache-reader` watches the pods matching `*cache-reader*` (no candidates then, whatever their class): when "
    'their own `memory.pressure` "some" is over 10 % of a tick, every candidate\'s `memory.high` comes down one '
    "20 % step and the line waits `cooldownTicks` before measuring again, so the streaming pods' page cache is "
    "reclaimed before the reader's. On cgroup v1 both throttle objectives are blocked `needs-cgroup-v2` "
    "(`nodeguard plan` says so, and the daemon says it once at start) and `memory-last-resort` still evicts.",
    "",
]


def objective_tables() -> list[str]:
    out = [
        "#### Objective metrics",
        "",
        "*Quantified*: the release of acting on one workload is predicted from its own usage, so the guard acts "
        "on the least prefix of candidates that closes the gap in one tick; otherwise it acts on one workload at a "
        "time (by `closedLoopStepPercent`), waits `cooldownTicks` and measures again.",
        "",
        "| metric | unit | what it reads | throttle | evict | default `sortBy` | notes |",
        "|---|---|---|---|---|---|---|",
    ]
    for metric, cap in CAPABILITIES.items():
        throttle = ("quantified" if cap.throttle_quantified else "closed loop") if cap.throttleable else "no"
        if cap.raised_by_throttling:
            throttle = "no"
        evict = ("quantified" if cap.evict_quantified else "closed loop") if cap.evictable else "no"
        out.append(
            f"| `{metric}` | {cap.unit} | {_cell(METRIC_MEANINGS[metric])} | {throttle} | {evict} "
            f"| {', '.join(f'`{c}`' for c in cap.sort_by)} | {_cell(METRIC_NOTES.get(metric, ''))} |"
        )
    out += [
        "",
        "#### Actions",
        "",
        "| action | what it does | metrics |",
        "|---|---|---|",
        "| `throttle` | lowers the CPU quota (`cpu.max`, v1 `cpu.cfs_quota_us`) of the least important candidates, "
        "only as many and as far as needed, never below `minQuotaCores`; restores them below `restoreBelow` "
        "(for `protected_cpu_stall`: lowers competing groups' CPU weight first); on memory metrics it lowers "
        "`memory.high` instead (cgroup v2), never below the request or `guard.memory.minHigh` "
        f"| {', '.join(f'`{m}`' for m, c in CAPABILITIES.items() if c.throttleable and not c.raised_by_throttling)} |",
        "| `evict` | makes the least important candidates leave (the Eviction API on Kubernetes, or the cgroup: "
        "SIGTERM, grace, kill), within `guard.evictions` "
        f"| {', '.join(f'`{m}`' for m, c in CAPABILITIES.items() if c.evictable)} |",
        "",
    ]
    return out


def main() -> int:
    try:
        sys.stdout.write(render())
    except Undocumented as exc:
        print(f"config_reference: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
