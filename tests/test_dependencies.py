"""The declared runtime dependencies are exactly the third-party modules nodeguard imports."""

from __future__ import annotations

import ast
import re
import sys
import tomllib
from importlib.metadata import packages_distributions
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def _normalise(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def declared() -> set[str]:
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    return {_normalise(re.split(r"[<>=~!;\[ ]", spec, maxsplit=1)[0]) for spec in project["dependencies"]}


def imported_modules() -> dict[str, set[str]]:
    """Top-level third-party module -> the files of nodeguard/ that import it."""
    found: dict[str, set[str]] = {}
    for path in (REPO / "nodeguard").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names: list[str] = []
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                names = [node.module]
            for name in names:
                top = name.split(".")[0]
                if top != "nodeguard" and top not in sys.stdlib_module_names and top != "__future__":
                    found.setdefault(top, set()).add(str(path.relative_to(REPO)))
    return found


def test_every_import_is_declared_and_every_declared_dependency_is_imported() -> None:
    """A third-party import without its distribution in pyproject.toml fails, and so does a declared runtime
    dependency that no module imports."""
    distributions = packages_distributions()
    imports = imported_modules()
    used: set[str] = set()
    undeclared = []
    for module, files in sorted(imports.items()):
        owners = {_normalise(d) for d in distributions.get(module, [module])}
        used |= owners
        if not owners & declared():
            undeclared.append(f"{module} (from {', '.join(sorted(owners))}) imported by {sorted(files)}")
    assert not undeclared, "imported but not declared in [project].dependencies: " + "; ".join(undeclared)
    unused = declared() - used
    assert not unused, f"declared in [project].dependencies but imported nowhere in nodeguard/: {sorted(unused)}"


def test_the_checker_sees_imports() -> None:
    """The check itself finds the imports it judges (a broken walk would pass vacuously)."""
    imports = imported_modules()
    assert {"pydantic", "structlog", "prometheus_client"} <= imports.keys()
    assert "os" not in imports and "nodeguard" not in imports
