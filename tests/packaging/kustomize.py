"""The kustomizations of packaging/, rendered by `kubectl kustomize` as `kubectl apply -k` applies them."""

from __future__ import annotations

import functools
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

REPO = Path(__file__).resolve().parents[2]
BASE = REPO / "packaging" / "kubernetes"
CANARY = REPO / "packaging" / "kubernetes-overlays" / "canary"
DRY_RUN = REPO / "packaging" / "kubernetes-overlays" / "dry-run"
BROKER = BASE / "broker"
# The broker's password is the operator's file, kept out of git; a test renders a copy of the directory with its own.
BROKER_PASSWORD = "broker-password"


def kubectl() -> str:
    found = shutil.which("kubectl")
    if found is None:
        pytest.skip("kubectl is not installed (Debian package kubernetes-client; scripts/setup installs it)")
    return found


def run_kustomize(directory: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([kubectl(), "kustomize", str(directory)], capture_output=True, text=True, timeout=120)


@functools.cache
def _render(directory: Path) -> str:
    result = run_kustomize(directory)
    assert result.returncode == 0, f"kubectl kustomize {directory} failed:\n{result.stderr}"
    return result.stdout


def render(directory: Path) -> list[dict[str, Any]]:
    """The objects the kustomization in ``directory`` builds, in the order kubectl applies them (a fresh copy)."""
    return [doc for doc in yaml.safe_load_all(_render(directory)) if doc is not None]


def broker_copy(target: Path, password: str | None = BROKER_PASSWORD) -> Path:
    """packaging/kubernetes/broker/ copied to ``target`` without any password file of the checkout's, and this one."""
    shutil.copytree(BROKER, target, ignore=shutil.ignore_patterns("password"))
    if password is not None:
        (target / "password").write_text(password + "\n", encoding="utf-8")
    return target


def of_kind(objects: list[dict[str, Any]], kind: str, name: str | None = None) -> dict[str, Any]:
    found = [o for o in objects if o["kind"] == kind and name in (None, o["metadata"]["name"])]
    assert len(found) == 1, f"expected one {kind} {name or ''}, found {len(found)}"
    return found[0]
