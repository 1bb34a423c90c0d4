"""Test modules share helpers through support modules, never by importing one another; bench/ imports the tests
through its one common module."""

from __future__ import annotations

import ast
import sys
from pathlib import Path

TESTS = Path(__file__).resolve().parent


def is_test_module(dotted: str) -> bool:
    """``tests.gate.test_loads`` and ``test_loads`` are test modules; ``tests.support.poll`` is not."""
    return dotted.rsplit(".", 1)[-1].startswith("test_")


def imported_test_modules(source: str) -> list[str]:
    """The test modules a module's source imports, at any level (a function's lazy import included)."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [alias.name for alias in node.names if is_test_module(alias.name)]
        elif isinstance(node, ast.ImportFrom):
            module = "." * node.level + (node.module or "")
            if is_test_module(module):
                found.append(module)
            found += [f"{module}.{alias.name}" for alias in node.names if is_test_module(alias.name)]
    return found


def test_no_test_module_imports_another() -> None:
    """No tests/**/test_*.py imports from another test_* module: what two of them share lives in a support module."""
    offenders = {
        str(path.relative_to(TESTS.parent)): imported
        for path in sorted(TESTS.rglob("test_*.py"))
        if (imported := imported_test_modules(path.read_text()))
    }
    assert len(list(TESTS.rglob("test_*.py"))) > 50, "the test modules were not found"
    assert offenders == {}


def test_the_check_sees_every_form_of_import() -> None:
    """Absolute, relative, lazy and module-as-name imports of a test module are each found; support modules are not."""
    source = (
        "from tests.gate.test_loads import table\n"
        "from .test_elastic import predicted_node\n"
        "from tests.policy import test_memory\n"
        "import tests.integration.test_operating\n"
        "def f():\n    from tests.containers.test_image import get\n"
        "from tests.support.poll import wait_until\n"
        "from tests.policy.builders import guard\n"
    )
    assert imported_test_modules(source) == [
        "tests.gate.test_loads",
        ".test_elastic",
        "tests.policy.test_memory",
        "tests.integration.test_operating",
        "tests.containers.test_image",
    ]


def test_no_support_module_takes_a_standard_module_s_name() -> None:
    """tests/support/slow_server.py runs as a script, its directory first on sys.path: a support module named like a
    standard one (http.py) would be imported in its place."""
    names = {path.stem for path in (TESTS / "support").glob("*.py")}
    assert len(names) > 5, "tests/support was not found"
    assert names & set(sys.stdlib_module_names) == set()


BENCH = TESTS.parent / "bench"


def imports_of(source: str) -> list[str]:
    """Every module a source imports by absolute name, at any level."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.append(node.module)
    return found


def test_bench_imports_the_tests_only_through_its_common_module() -> None:
    """Of bench/, only common.py imports from tests/: what the benchmarks share comes from one module."""
    importing = {
        path.name
        for path in BENCH.glob("*.py")
        if any(name == "tests" or name.startswith("tests.") for name in imports_of(path.read_text()))
    }
    assert importing == {"common.py"}


def test_no_import_cycle_between_bench_modules() -> None:
    """No two bench modules import each other, directly or through others, a function's lazy import included."""
    graph = {
        path.stem: {name.split(".")[1] for name in imports_of(path.read_text()) if name.startswith("bench.")}
        for path in BENCH.glob("*.py")
    }
    assert len(graph) > 10, "bench/ was not found"

    def reaches(start: str, goal: str, seen: set[str]) -> bool:
        return any(
            nxt == goal or (nxt not in seen and reaches(nxt, goal, seen | {nxt})) for nxt in graph.get(start, ())
        )

    assert [name for name in sorted(graph) if reaches(name, name, {name})] == []
