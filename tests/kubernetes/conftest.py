"""A local HTTPS stand-in for the API server and the kubelet, with a test CA.

The server speaks their wire format (PodList, Node, Status, Eviction, Event),
checks the bearer token, records every request, and can be told to answer a
path with a given status, garbage, or not at all (hang until the test ends).
"""

from __future__ import annotations

import datetime as dt
import ipaddress
import json
import re
import ssl
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlsplit

import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

from nodeguard.kubernetes.settings import KubernetesSettings
from tests.kubernetes.objects import NODE, node, pod_list, status

TOKEN = "eyJhbGciOiJSUzI1NiJ9.test-service-account-token"


# --- PKI -------------------------------------------------------------------------


def _name(common: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common)])


def _ca(common: str) -> tuple[ec.EllipticCurvePrivateKey, x509.Certificate]:
    key = ec.generate_private_key(ec.SECP256R1())
    now = dt.datetime.now(dt.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(_name(common))
        .issuer_name(_name(common))
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(days=1))
        .not_valid_after(now + dt.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                key_cert_sign=True,
                crl_sign=True,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
        .sign(key, hashes.SHA256())
    )
    return key, cert


def _leaf(
    ca_key: ec.EllipticCurvePrivateKey, ca: x509.Certificate
) -> tuple[ec.EllipticCurvePrivateKey, x509.Certificate]:
    key = ec.generate_private_key(ec.SECP256R1())
    now = dt.datetime.now(dt.UTC)
    cert = (
        x509.CertificateBuilder()
        .subject_name(_name("kube-apiserver"))
        .issuer_name(ca.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - dt.timedelta(days=1))
        .not_valid_after(now + dt.timedelta(days=1))
        .add_extension(
            x509.SubjectAlternativeName([x509.DNSName("localhost"), x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
            critical=False,
        )
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH]), critical=False)
        .add_extension(
            x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_key.public_key()),
            critical=False,
        )
        .sign(ca_key, hashes.SHA256())
    )
    return key, cert


@dataclass(frozen=True)
class Pki:
    ca_path: Path  # the cluster CA nodeguard trusts
    server_cert: Path
    server_key: Path
    rogue_cert: Path  # a server certificate signed by another CA
    rogue_key: Path


def _write(directory: Path, name: str, key: ec.EllipticCurvePrivateKey, cert: x509.Certificate) -> tuple[Path, Path]:
    cert_path, key_path = directory / f"{name}.crt", directory / f"{name}.key"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(
        key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
    )
    return cert_path, key_path


@pytest.fixture(scope="session")
def pki(tmp_path_factory: pytest.TempPathFactory) -> Pki:
    directory = tmp_path_factory.mktemp("pki")
    ca_key, ca = _ca("kubernetes")
    ca_path = directory / "ca.crt"
    ca_path.write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    server_cert, server_key = _write(directory, "apiserver", *_leaf(ca_key, ca))
    other_key, other = _ca("some-other-ca")
    rogue_cert, rogue_key = _write(directory, "rogue", *_leaf(other_key, other))
    return Pki(ca_path, server_cert, server_key, rogue_cert, rogue_key)


# --- the server ------------------------------------------------------------------


@dataclass
class Seen:
    method: str
    path: str
    query: dict[str, list[str]]
    headers: dict[str, str]
    body: Any


@dataclass
class Canned:
    status: int = 200
    body: Any = None
    raw: bytes | None = None  # sent as is (garbage)
    hang: bool = False  # never answer (until the test ends)


@dataclass
class FakeKube:
    """State of the fake API server / kubelet; tests change it while it serves."""

    token: str = TOKEN
    pods: list[dict[str, Any]] = field(default_factory=list)
    nodes: dict[str, dict[str, Any]] = field(default_factory=lambda: {NODE: node()})
    # (method, path regex) -> answer, checked before the built-in routes
    overrides: dict[tuple[str, str], Canned] = field(default_factory=dict)
    # "namespace/name" -> answer to its eviction; default 201 Success
    evictions: dict[str, Canned] = field(default_factory=dict)
    seen: list[Seen] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)
    release: threading.Event = field(default_factory=threading.Event)
    url: str = ""

    def requests(self, method: str | None = None, path: str | None = None) -> list[Seen]:
        with self.lock:
            return [s for s in self.seen if (method is None or s.method == method) and (path is None or s.path == path)]

    def answer(self, method: str, path: str, query: dict[str, list[str]], body: Any) -> Canned:
        for (m, pattern), canned in self.overrides.items():
            if m == method and re.fullmatch(pattern, path):
                return canned
        if method == "GET" and path == "/api/v1/pods":
            selector = query.get("fieldSelector", [""])[0]
            wanted = selector.removeprefix("spec.nodeName=") if selector.startswith("spec.nodeName=") else None
            items = [p for p in self.pods if wanted is None or p["spec"].get("nodeName") == wanted]
            return Canned(200, pod_list(items))
        if method == "GET" and path == "/pods":
            return Canned(200, pod_list(list(self.pods)))
        if method == "GET" and (m := re.fullmatch(r"/api/v1/nodes/([^/]+)", path)):
            found = self.nodes.get(m.group(1))
            if found is None:
                return Canned(404, status(404, "NotFound", f'nodes "{m.group(1)}" not found'))
            return Canned(200, found)
        if method == "POST" and (m := re.fullmatch(r"/api/v1/namespaces/([^/]+)/pods/([^/]+)/eviction", path)):
            key = f"{m.group(1)}/{m.group(2)}"
            return self.evictions.get(key) or Canned(201, {**status(201, "", ""), "status": "Success"})
        if method == "POST" and (m := re.fullmatch(r"/api/v1/namespaces/([^/]+)/events", path)):
            created = dict(body) if isinstance(body, dict) else {}
            created.setdefault("metadata", {})["uid"] = "e0e0e0e0-0000-4000-8000-000000000001"
            return Canned(201, created)
        return Canned(404, status(404, "NotFound", "the server could not find the requested resource"))


class _Handler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    server: _Server

    def log_message(self, format: str, *args: Any) -> None:  # quiet
        pass

    def _serve(self) -> None:
        fake = self.server.fake
        length = int(self.headers.get("Content-Length") or 0)
        raw = self.rfile.read(length) if length else b""
        try:
            body = json.loads(raw) if raw else None
        except ValueError:
            body = raw
        split = urlsplit(self.path)
        query = parse_qs(split.query)
        with fake.lock:
            fake.seen.append(Seen(self.command, split.path, query, dict(self.headers.items()), body))
        if self.headers.get("Authorization") != f"Bearer {fake.token}":
            canned = Canned(401, status(401, "Unauthorized", "Unauthorized"))
        else:
            canned = fake.answer(self.command, split.path, query, body)
        if canned.hang:
            fake.release.wait(30)
            return
        data = canned.raw if canned.raw is not None else json.dumps(canned.body).encode()
        self.send_response(canned.status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    do_GET = _serve
    do_POST = _serve


class _Server(ThreadingHTTPServer):
    daemon_threads = True
    fake: FakeKube


def _start(fake: FakeKube, cert: Path, key: Path) -> Iterator[FakeKube]:
    server = _Server(("127.0.0.1", 0), _Handler)
    server.fake = fake
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.load_cert_chain(cert, key)
    server.socket = context.wrap_socket(server.socket, server_side=True)
    fake.url = f"https://127.0.0.1:{server.server_address[1]}"
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    try:
        yield fake
    finally:
        fake.release.set()
        server.shutdown()
        server.server_close()
        thread.join(5)


@pytest.fixture
def kube(pki: Pki) -> Iterator[FakeKube]:
    """The fake API server (and kubelet: it serves /pods too), with a certificate from the cluster CA."""
    yield from _start(FakeKube(), pki.server_cert, pki.server_key)


@pytest.fixture
def rogue(pki: Pki) -> Iterator[FakeKube]:
    """The same server with a certificate from another CA."""
    yield from _start(FakeKube(), pki.rogue_cert, pki.rogue_key)


class FakeCgroupEvictor:
    """Stands in for the cgroup evictor: records which workloads it was asked to kill."""

    def __init__(self, gone: bool = True) -> None:
        self.gone = gone
        self.calls: list[str] = []

    async def evict(self, workload_id: str, **context: object) -> bool:
        self.calls.append(workload_id)
        return self.gone


@pytest.fixture
def token_file(tmp_path: Path) -> Path:
    path = tmp_path / "token"
    path.write_text(TOKEN + "\n")
    return path


def settings_for(fake: FakeKube, pki: Pki, token: Path, **extra: Any) -> KubernetesSettings:
    return KubernetesSettings.model_validate(
        {
            "enabled": True,
            "apiServerUrl": fake.url,
            "kubeletUrl": fake.url,
            "tokenPath": str(token),
            "caPath": str(pki.ca_path),
            "timeoutSeconds": 2,
            "refreshSeconds": 60,
            **extra,
        }
    )


@pytest.fixture
def settings(kube: FakeKube, pki: Pki, token_file: Path) -> KubernetesSettings:
    return settings_for(kube, pki, token_file)
