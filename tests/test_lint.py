"""The code stays ruff-clean, ruff-formatted and mypy --strict clean (run as part of the suite, like CI)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", *args], capture_output=True, text=True, cwd=REPO, timeout=300)


def test_ruff_clean() -> None:
    """ruff reports nothing on the package, tests and benchmarks."""
    result = run("ruff", "check", "nodeguard", "tests", "bench")
    assert result.returncode == 0, result.stdout + result.stderr


def test_ruff_format_clean() -> None:
    """ruff format would change nothing in the package, tests and benchmarks."""
    result = run("ruff", "format", "--check", "nodeguard", "tests", "bench")
    assert result.returncode == 0, result.stdout + result.stderr


def test_mypy_strict_clean() -> None:
    """mypy --strict reports nothing on the package."""
    result = run("mypy", "--strict", "nodeguard")
    assert result.returncode == 0, result.stdout + result.stderr
