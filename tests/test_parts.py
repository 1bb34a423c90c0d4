"""The parts of nodeguard (each subpackage and top-level module) import one another in one direction only."""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "nodeguard"


def part_of(module: str) -> str | None:
    """``nodeguard.policy.planner`` -> ``policy``; ``nodeguard.daemon`` -> ``daemon``; the package itself: None."""
    names = module.split(".")
    return names[1] if len(names) > 1 and names[0] == "nodeguard" else None


def import_graph() -> dict[str, dict[str, set[str]]]:
    """part -> imported part -> the files that import it (type-checking-only imports count too)."""
    graph: dict[str, dict[str, set[str]]] = defaultdict(lambda: defaultdict(set))
    for path in PACKAGE.rglob("*.py"):
        relative = path.relative_to(PACKAGE.parent).with_suffix("")
        module = ".".join(relative.parts).removesuffix(".__init__")
        source = part_of(module)
        if source is None:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            targets: list[str] = []
            if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                targets = [f"{node.module}.{a.name}" if node.module == "nodeguard" else node.module for a in node.names]
            elif isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            for target in targets:
                part = part_of(target)
                if part is not None and part != source:
                    graph[source][part].add(str(path.relative_to(PACKAGE.parent)))
    return graph


def cycles(graph: dict[str, dict[str, set[str]]]) -> list[list[str]]:
    """The strongly connected components of more than one part (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(part: str) -> None:
        index[part] = low[part] = len(index)
        stack.append(part)
        on_stack.add(part)
        for other in graph.get(part, {}):
            if other not in index:
                visit(other)
                low[part] = min(low[part], low[other])
            elif other in on_stack:
                low[part] = min(low[part], index[other])
        if low[part] == index[part]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == part:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for part in sorted(set(graph) | {p for targets in graph.values() for p in targets}):
        if part not in index:
            visit(part)
    return found


def test_the_parts_form_a_dag() -> None:
    """No two parts import each other, directly or through others; a failure names the imports that close a cycle."""
    graph = import_graph()
    found = cycles(graph)
    details = [
        f"{a} -> {b} ({', '.join(sorted(graph[a][b]))})" for cycle in found for a in cycle for b in cycle if b in graph[a]
    ]
    assert not found, f"cycles between parts: {found}; imports: {details}"


def test_the_check_finds_a_cycle_when_there_is_one() -> None:
    """The cycle finder itself sees a cycle (so a passing check means something)."""
    graph: dict[str, dict[str, set[str]]] = {"a": {"b": {"x"}}, "b": {"c": {"y"}}, "c": {"a": {"z"}}, "d": {"a": {"w"}}}
    assert cycles(graph) == [["a", "b", "c"]]
    assert {"daemon", "policy", "sources"} <= import_graph().keys()


def test_surfaces_are_on_top_and_policy_reads_no_config() -> None:
    """The data flow: the daemon imports no surface, and the pure policy imports neither config, actuators nor sources."""
    graph = import_graph()
    assert "surfaces" not in graph["daemon"]
    assert not {"config", "actuators", "sources", "daemon"} & graph["policy"].keys()
