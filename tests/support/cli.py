"""The ``nodeguard`` command line run as a user runs it, in a child process."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def nodeguard(*args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    """``nodeguard ARGS`` from the checkout, its output captured as text."""
    return subprocess.run(
        [sys.executable, "-m", "nodeguard", *args], capture_output=True, text=True, timeout=timeout, cwd=REPO
    )
