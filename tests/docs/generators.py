"""Loading the reference pages' generators (scripts/*_reference.py), which are scripts, not modules of a package."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

REPO = Path(__file__).resolve().parents[2]


def load(name: str) -> ModuleType:
    """scripts/<name>.py, executed afresh (a test may have patched the last copy)."""
    spec = importlib.util.spec_from_file_location(name, REPO / "scripts" / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # as an import would: dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


CONFIG_REFERENCE = REPO / "docs" / "reference" / "configuration.md"


def config_generator() -> ModuleType:
    """scripts/config_reference.py, loaded afresh."""
    return load("config_reference")
