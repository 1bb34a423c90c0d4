"""`nodeguard demo` runs to completion on a real kernel and leaves nothing behind."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support import cgroups as rc
from tests.support.node import SLOW


def leftovers() -> list[Path]:
    return [p for p in rc.CGROUP_ROOT.glob("**/nodeguard-demo-*") if p.is_dir()]


@pytest.mark.parametrize("where", ["host", pytest.param("v2", marks=pytest.mark.kernel)])
def test_demo_completes_and_cleans_up(where: str) -> None:
    """The demo acts on its burners (weights, then quotas), prints a summary, restores everything and removes its
    cgroups."""
    if where == "host" and (reason := rc.why_no_v1_cpu()):
        pytest.skip(reason)
    before = leftovers()
    result = subprocess.run(
        [sys.executable, "-m", "nodeguard", "demo", "--seconds", "8"],
        capture_output=True,
        text=True,
        timeout=120 * SLOW,
        env={**os.environ, "COLUMNS": "100"},
    )
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    assert "summary" in result.stdout
    assert "first action" in result.stdout, result.stdout[-2000:]
    assert "Traceback" not in result.stderr
    assert leftovers() == before == []
