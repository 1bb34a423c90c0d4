"""The parts of nodeguard (each subpackage and top-level module), and its modules, import one another in one direction only."""

from __future__ import annotations

import ast
from collections import defaultdict
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "nodeguard"


def part_of(module: str) -> str | None:
    """``nodeguard.policy.planner`` -> ``policy``; ``nodeguard.daemon`` -> ``daemon``; the package itself: None."""
    names = module.split(".")
    return names[1] if len(names) > 1 and names[0] == "nodeguard" else None


def module_graph(package: Path = PACKAGE) -> dict[str, dict[str, set[str]]]:
    """module -> imported module of the same package -> the lines that import it.

    Every import counts: at the top, inside functions (imported when used) and
    under ``TYPE_CHECKING``. ``from a.b import c`` imports the module ``a.b.c``
    when there is one, else ``a.b``; importing a module is not counted as
    importing the packages above it.
    """
    files = {
        ".".join(path.relative_to(package.parent).with_suffix("").parts).removesuffix(".__init__"): path
        for path in package.rglob("*.py")
    }
    graph: dict[str, dict[str, set[str]]] = defaultdict(lambda: defaultdict(set))
    for module, path in files.items():
        for node in ast.walk(ast.parse(path.read_text())):
            targets: list[str] = []
            if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                targets = [
                    f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in files else node.module for a in node.names
                ]
            elif isinstance(node, ast.Import):
                targets = [alias.name for alias in node.names]
            for target in targets:
                if target in files and target != module:
                    graph[module][target].add(f"{path.relative_to(package.parent)}:{node.lineno}")
    return graph


def import_graph() -> dict[str, dict[str, set[str]]]:
    """part -> imported part -> the files that import it (every import counts, as in ``module_graph``)."""
    graph: dict[str, dict[str, set[str]]] = defaultdict(lambda: defaultdict(set))
    for module, imported in module_graph().items():
        for target, lines in imported.items():
            source, part = part_of(module), part_of(target)
            if source is not None and part is not None and part != source:
                graph[source][part] |= {line.split(":")[0] for line in lines}
    return graph


def cycles(graph: dict[str, dict[str, set[str]]]) -> list[list[str]]:
    """The strongly connected components of more than one node (Tarjan)."""
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


def closing_imports(graph: dict[str, dict[str, set[str]]], found: list[list[str]]) -> list[str]:
    """The imports inside the cycles found: ``a -> b (where)``."""
    return [
        f"{a} -> {b} ({', '.join(sorted(graph[a][b]))})"
        for cycle in found
        for a in cycle
        for b in cycle
        if b in graph[a]
    ]


def test_the_parts_form_a_dag() -> None:
    """No two parts import each other, directly or through others; a failure names the imports that close a cycle."""
    graph = import_graph()
    found = cycles(graph)
    assert not found, f"cycles between parts: {found}; imports: {closing_imports(graph, found)}"


def test_the_modules_form_a_dag() -> None:
    """No two modules import each other, directly or through others, lazy and TYPE_CHECKING imports included."""
    graph = module_graph()
    found = cycles(graph)
    assert not found, f"cycles between modules: {found}; imports: {closing_imports(graph, found)}"


def test_a_cycle_through_lazy_and_type_checking_imports_is_found(tmp_path: Path) -> None:
    """Modules that import each other only inside a function and under TYPE_CHECKING are a cycle; a package's
    ``__init__`` importing its own modules is not."""
    package = tmp_path / "pkg"
    (package / "sub").mkdir(parents=True)
    (package / "__init__.py").write_text("")
    (package / "sub" / "__init__.py").write_text("from pkg.sub import low\n")
    (package / "sub" / "low.py").write_text("def late() -> None:\n    from pkg import top\n")
    (package / "top.py").write_text("TYPE_CHECKING = False\nif TYPE_CHECKING:\n    from pkg.sub.low import late\n")
    graph = module_graph(package)
    assert cycles(graph) == [["pkg.sub.low", "pkg.top"]]
    assert graph["pkg.sub.low"]["pkg.top"] == {"pkg/sub/low.py:2"}


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
