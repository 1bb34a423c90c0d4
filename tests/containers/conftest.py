"""Session fixtures for the real-runtime tests: podman on this repository's storage, and images built once."""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest

from tests.containers import runtime
from tests.containers.runtime import Podman


def _timed(what: str, build, *args):  # type: ignore[no-untyped-def]
    start = time.monotonic()
    value = build(*args)
    print(f"\n{what}: {value} ({time.monotonic() - start:.1f} s)")
    return value


@pytest.fixture(scope="session")
def podman() -> Iterator[Podman]:
    """podman with runc, or a skip saying why this machine cannot run containers (a missing package fails)."""
    reason = runtime.why_no_containers()
    if reason:
        pytest.skip(reason)
    runtime.require("podman")
    runtime.require("runc")
    runtime.fresh_run_state()
    podman = Podman()
    if orphans := runtime.sweep(podman):
        print(f"\nremoved containers of test sessions that are gone: {' '.join(orphans)}")
    yield podman
    left = runtime.release_storage(podman)
    assert not left, f"still mounted in this checkout after the session, so it cannot be deleted: {left}"


@pytest.fixture(scope="session")
def busybox_image(podman: Podman) -> str:
    return str(_timed("busybox image", runtime.busybox_image, podman))


@pytest.fixture(scope="session")
def nodeguard_image(podman: Podman) -> str:
    base = _timed("base image", runtime.debian_base_image, podman)
    return str(_timed("nodeguard image", runtime.nodeguard_image, podman, base))
