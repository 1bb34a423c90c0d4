"""The ``coordination`` section of the config, and loading its secrets and TLS files."""

from __future__ import annotations

import os
import ssl
from pathlib import Path
from typing import Annotated

from pydantic import Field, ValidationInfo, field_validator, model_validator

from nodeguard.config_base import Model, cross_field
from nodeguard.coordination.names import valid_name
from nodeguard.errors import NodeguardError


class CoordinationError(NodeguardError):
    """Coordination cannot start: names the setting at fault."""


def will_margin(will_delay: float) -> float:
    # mosquitto times will delays with a one-second clock; clocks also drift a little.
    return max(1.0, 0.1 * will_delay)


class TlsSettings(Model):
    ca_file: str | None = Field(None, description="CA bundle that signed the broker's certificate (PEM)")
    cert_file: str | None = Field(None, description="client certificate (PEM), with keyFile")
    key_file: str | None = Field(None, description="client private key (PEM)")

    @model_validator(mode="after")
    @cross_field("`certFile` and `keyFile` go together", "certFile", "keyFile")
    def _pair(self) -> TlsSettings:
        if (self.key_file is None) != (self.cert_file is None):
            raise ValueError("certFile and keyFile go together")
        return self


class BrokerSettings(Model):
    host: str = "localhost"
    port: int = Field(1883, ge=1, le=65535)
    tls: TlsSettings | None = Field(None, description="connect with TLS (an empty object: system CAs)")
    username: str | None = None
    password_file: str | None = Field(None, description="file holding the password (first line)")
    password_env: str | None = Field(None, description="environment variable holding the password")
    keepalive_seconds: int = Field(5, ge=1, le=3600)
    connect_timeout_seconds: float = Field(5.0, gt=0, le=300)
    reconnect_min_seconds: float = Field(0.2, gt=0, le=60, description="first reconnect delay (jittered, doubling)")
    reconnect_max_seconds: float = Field(10.0, gt=0, le=3600)

    @field_validator("password_env")
    @classmethod
    @cross_field("`passwordFile` or `passwordEnv`, not both", "passwordFile", "passwordEnv")
    def _one_password(cls, value: str | None, info: ValidationInfo) -> str | None:
        if value is not None and info.data.get("password_file") is not None:
            raise ValueError("give passwordFile or passwordEnv, not both")
        return value


Cap = Annotated[int, Field(ge=0, le=1_000_000)]


class CoordinationSettings(Model):
    """Cluster-wide caps shared over MQTT; the same on every node of the cluster."""

    enabled: bool = False
    cluster: str = Field("default", description="topics live under nodeguard/<cluster>/")
    node_name: str | None = Field(None, description="this node's name (default: NODE_NAME, else the hostname)")
    seeds: list[str] = Field(
        [],
        description="nodes that hold the caps when the cluster starts (default: nodes); any other node joins with "
        "no slots and gets them by grants",
    )
    nodes: list[str] = Field(
        [], description="optional: the nodes known at the start; without seeds, they are the seeds (older configs)"
    )
    semaphores: dict[str, Cap] = Field({}, description='cluster-wide caps by name, e.g. {"prepare": 8}')
    will_delay_seconds: int = Field(
        30, ge=2, le=86_400, description="a node silent this long is declared gone and its slots adopted"
    )
    lease_seconds: float = Field(
        20.0, gt=0, description="admission continues this long without the broker; must end before the will"
    )
    heartbeat_seconds: float | None = Field(None, gt=0, description="status publication period (default lease/4)")
    state_dir: str = Field(
        "/run/nodeguard",
        description="where the node's allotments persist: it must outlive the process, not a reboot (tmpfs is best)",
    )
    broker: BrokerSettings = BrokerSettings()

    @field_validator("cluster")
    @classmethod
    def _cluster(cls, value: str) -> str:
        if not valid_name(value):
            raise ValueError("expected a name of letters, digits, '.', '_', ':' or '-'")
        return value

    drain_seconds: float = Field(
        3.0, ge=0, le=60, description="on stop, how long to wait for the heir or bank to take the free slots"
    )

    @field_validator("nodes", "seeds")
    @classmethod
    def _nodes(cls, value: list[str]) -> list[str]:
        for name in value:
            if not valid_name(name):
                raise ValueError(f"invalid node name {name!r}")
        if len(set(value)) != len(value):
            raise ValueError("node names must be distinct")
        return value

    @field_validator("semaphores")
    @classmethod
    def _semaphores(cls, value: dict[str, int]) -> dict[str, int]:
        for name in value:
            if not valid_name(name):
                raise ValueError(f"invalid semaphore name {name!r}")
        return value

    @field_validator("lease_seconds")
    @classmethod
    @cross_field(
        "`leaseSeconds` ≤ `willDelaySeconds` − max(1, `willDelaySeconds` / 10): the lease ends before the will fires",
        "leaseSeconds",
        "willDelaySeconds",
    )
    def _lease(cls, value: float, info: ValidationInfo) -> float:
        will = info.data.get("will_delay_seconds")
        if will is not None and value > will - will_margin(will):
            raise ValueError(
                f"must end before the will can fire: at most willDelaySeconds - {will_margin(will):g} "
                f"= {will - will_margin(will):g}"
            )
        return value

    @field_validator("state_dir")
    @classmethod
    def _absolute(cls, value: str) -> str:
        if not value.startswith("/"):
            raise ValueError("expected an absolute path")
        return value

    @model_validator(mode="after")
    @cross_field("`heartbeatSeconds` ≤ `leaseSeconds` / 2", "heartbeatSeconds", "leaseSeconds")
    @cross_field("`enabled` needs `seeds` (or `nodes`) and `semaphores`", "enabled")
    def _complete(self) -> CoordinationSettings:
        if self.heartbeat_seconds is not None and self.heartbeat_seconds > self.lease_seconds / 2:
            raise ValueError("heartbeatSeconds must be at most half of leaseSeconds")
        if self.enabled and (not self.genesis_seeds or not self.semaphores):
            raise ValueError("enabled coordination needs seeds (or nodes) and semaphores")
        return self

    @property
    def genesis_seeds(self) -> list[str]:
        return self.seeds or self.nodes

    @property
    def heartbeat(self) -> float:
        return self.heartbeat_seconds if self.heartbeat_seconds is not None else self.lease_seconds / 4

    def state_path(self) -> Path:
        return Path(self.state_dir) / f"coordination-{self.cluster}.json"


# --- secrets and TLS, checked at start --------------------------------------------------------

PATH = "coordination.broker"


def load_password(broker: BrokerSettings) -> str | None:
    if broker.password_file is not None:
        try:
            text = Path(broker.password_file).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as exc:
            raise CoordinationError(f"{PATH}.passwordFile: cannot read {broker.password_file}: {exc}") from None
        lines = text.splitlines()
        if not lines or not lines[0]:
            raise CoordinationError(f"{PATH}.passwordFile: {broker.password_file} is empty")
        return lines[0]
    if broker.password_env is not None:
        value = os.environ.get(broker.password_env)
        if not value:
            raise CoordinationError(f"{PATH}.passwordEnv: environment variable {broker.password_env} is not set")
        return value
    return None


def tls_context(broker: BrokerSettings) -> ssl.SSLContext | None:
    """The TLS context, built now so that a bad file stops the start with its setting named."""
    tls = broker.tls
    if tls is None:
        return None
    try:
        context = ssl.create_default_context(cafile=tls.ca_file)
    except (OSError, ssl.SSLError) as exc:
        raise CoordinationError(f"{PATH}.tls.caFile: cannot load {tls.ca_file}: {exc}") from None
    if tls.cert_file is not None and tls.key_file is not None:
        try:
            context.load_cert_chain(tls.cert_file, tls.key_file)
        except (OSError, ssl.SSLError) as exc:
            raise CoordinationError(
                f"{PATH}.tls.certFile/keyFile: cannot load {tls.cert_file} with {tls.key_file}: {exc}"
            ) from None
    return context
