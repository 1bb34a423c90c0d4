"""The package stays readable in pieces: no class and no module of nodeguard/ grows past the sizes issue 21 set."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "nodeguard"
MAX_CLASS_LINES = 400
MAX_MODULE_LINES = 600


def sizes(root: Path) -> tuple[dict[str, int], dict[str, int]]:
    """Lines of every module and every class (by ``path:Class``) under ``root``."""
    modules, classes = {}, {}
    for path in sorted(root.rglob("*.py")):
        text = path.read_text()
        name = str(path.relative_to(root.parent))
        modules[name] = len(text.splitlines())
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.ClassDef):
                assert node.end_lineno is not None
                classes[f"{name}:{node.name}"] = node.end_lineno - node.lineno + 1
    return modules, classes


def test_no_class_over_400_lines_and_no_module_over_600() -> None:
    """Every class of nodeguard/ is at most 400 lines long and every module at most 600."""
    modules, classes = sizes(PACKAGE)
    assert len(modules) > 50 and classes, "the package was not found"
    assert {k: v for k, v in classes.items() if v > MAX_CLASS_LINES} == {}
    assert {k: v for k, v in modules.items() if v > MAX_MODULE_LINES} == {}


def test_the_size_check_sees_an_oversized_class(tmp_path: Path) -> None:
    """A class of 401 lines and a module of 601 are counted as such."""
    package = tmp_path / "pkg"
    package.mkdir()
    (package / "big.py").write_text("class Big:\n" + "    x = 1\n" * 400 + "\n" * 200)
    modules, classes = sizes(package)
    assert classes == {"pkg/big.py:Big": 401} and modules == {"pkg/big.py": 601}
