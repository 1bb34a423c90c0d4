"""The client: bearer token, TLS against the cluster CA only, deadlines, garbage."""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest

from nodeguard.backoff import Backoff
from nodeguard.kubernetes.client import KubeClient, KubeError
from nodeguard.kubernetes.nodes import fetch_node_labels
from tests.kubernetes.conftest import TOKEN, Canned, FakeKube, Pki
from tests.kubernetes.objects import NODE


def client(fake: FakeKube, pki: Pki, token: Path, timeout: float = 2.0) -> KubeClient:
    return KubeClient(fake.url, token_path=str(token), ca_path=str(pki.ca_path), timeout_seconds=timeout)


async def test_requests_carry_the_token_and_verify_tls(kube: FakeKube, pki: Pki, token_file: Path) -> None:
    """A GET reaches the server over TLS verified by the cluster CA, with the service account's bearer token."""
    c = client(kube, pki, token_file)
    try:
        labels = await fetch_node_labels(c, NODE)
    finally:
        await c.aclose()
    assert labels["kubernetes.io/hostname"] == NODE
    (seen,) = kube.requests("GET", f"/api/v1/nodes/{NODE}")
    assert seen.headers["Authorization"] == f"Bearer {TOKEN}"
    assert seen.headers["User-Agent"].startswith("nodeguard/")


async def test_server_with_a_certificate_from_another_ca_is_refused(
    rogue: FakeKube, pki: Pki, token_file: Path
) -> None:
    """TLS verification fails against a server whose certificate another CA signed, and no request is made."""
    c = client(rogue, pki, token_file)
    try:
        with pytest.raises(KubeError, match=r"CERTIFICATE_VERIFY_FAILED|certificate verify failed"):
            await fetch_node_labels(c, NODE)
    finally:
        await c.aclose()
    assert rogue.requests() == []


async def test_wrong_token_is_an_error_with_the_status(kube: FakeKube, pki: Pki, token_file: Path) -> None:
    """A 401 Status from the server becomes a KubeError carrying the code and reason."""
    kube.token = "another-token"
    c = client(kube, pki, token_file)
    try:
        with pytest.raises(KubeError) as caught:
            await fetch_node_labels(c, NODE)
    finally:
        await c.aclose()
    assert caught.value.status == 401
    assert caught.value.reason == "Unauthorized"


async def test_rotated_token_is_read_again(kube: FakeKube, pki: Pki, token_file: Path) -> None:
    """When the kubelet rotates the token file, the next request uses the new token."""
    c = client(kube, pki, token_file)
    try:
        await fetch_node_labels(c, NODE)
        kube.token = "rotated-token"
        token_file.write_text("rotated-token")
        await fetch_node_labels(c, NODE)
    finally:
        await c.aclose()
    assert [s.headers["Authorization"] for s in kube.requests()] == [f"Bearer {TOKEN}", "Bearer rotated-token"]


async def test_missing_token_or_ca_sends_nothing(kube: FakeKube, pki: Pki, tmp_path: Path) -> None:
    """An unreadable token file or CA is a KubeError before anything is sent."""
    no_token = KubeClient(kube.url, token_path=str(tmp_path / "nope"), ca_path=str(pki.ca_path), timeout_seconds=1)
    with pytest.raises(KubeError, match="cannot read the token"):
        await no_token.get_json("/api/v1/pods")
    (tmp_path / "token").write_text(TOKEN)
    bad_ca = tmp_path / "ca.crt"
    bad_ca.write_text("not a certificate")
    for ca in (tmp_path / "missing.crt", bad_ca):
        c = KubeClient(kube.url, token_path=str(tmp_path / "token"), ca_path=str(ca), timeout_seconds=1)
        with pytest.raises(KubeError, match="CA"):
            await c.get_json("/api/v1/pods")
        await c.aclose()
    assert kube.requests() == []


async def test_garbage_answer_is_an_error(kube: FakeKube, pki: Pki, token_file: Path) -> None:
    """A 200 whose body is not JSON is a KubeError, not a crash."""
    kube.overrides[("GET", "/api/v1/pods")] = Canned(200, raw=b"<html>proxy error</html>")
    c = client(kube, pki, token_file)
    try:
        with pytest.raises(KubeError, match="not JSON"):
            await c.get_json("/api/v1/pods")
    finally:
        await c.aclose()


async def test_a_hanging_server_is_cut_at_the_deadline(kube: FakeKube, pki: Pki, token_file: Path) -> None:
    """A server that never answers costs one timeoutSeconds, then a KubeError; the loop keeps running meanwhile."""
    kube.overrides[("GET", "/api/v1/pods")] = Canned(hang=True)
    c = client(kube, pki, token_file, timeout=0.5)
    ticks = 0

    async def ticker() -> None:
        nonlocal ticks
        while True:
            await asyncio.sleep(0.02)  # the scenario: a tick every 20 ms while the request hangs
            ticks += 1

    task = asyncio.create_task(ticker())
    started = time.monotonic()
    try:
        with pytest.raises(KubeError, match="no answer within"):
            await c.get_json("/api/v1/pods")
    finally:
        task.cancel()
        await c.aclose()
    assert 0.4 < time.monotonic() - started < 2.0
    assert ticks >= 10  # the event loop ran throughout


def test_backoff_doubles_up_to_the_cap_and_resets() -> None:
    """Delays double per failure within the jitter, stop at the cap, and start over after a success."""
    now = [100.0]
    backoff = Backoff(1.0, 8.0, jitter=0.0, clock=lambda: now[0])
    assert [backoff.failed() for _ in range(5)] == [1.0, 2.0, 4.0, 8.0, 8.0]
    assert backoff.remaining() == 8.0
    now[0] += 3
    assert backoff.remaining() == 5.0
    backoff.succeeded()
    assert backoff.remaining() == 0.0
    assert backoff.failed() == 1.0
