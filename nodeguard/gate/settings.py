"""The gate's section of the config (``gate``): the socket, who may use it, and the admission policy."""

from __future__ import annotations

import re
from typing import Annotated

from pydantic import Field, field_validator, model_validator

from nodeguard.config_base import Model, cross_field

_MODE = re.compile(r"^0?[0-7]{3}$")
_ACCOUNT = re.compile(r"^[A-Za-z_][A-Za-z0-9_.-]{0,31}\$?$")
MAX_ID = 2**32 - 2  # a uid or gid: (uid_t)-1 means "unchanged" to chown
Id = Annotated[int, Field(ge=0, le=MAX_ID)]


class GateSettings(Model):
    """Admission of starts: at most so many starting at once, and only while the node has room.

    A limit left out (null) does not apply. ``minRate`` overrides the load
    signals (load average, CPU) but never the counts (``maxStarting``,
    ``maxStartingPerCore``) nor ``maxRate``.
    """

    enabled: bool = Field(True, description="serve the gate socket")
    socket: str = Field("/run/nodeguard/gate.sock", description="the unix socket clients connect to")
    socket_mode: str = Field("0660", description='permissions of the socket, octal as a string, e.g. "0660"')
    socket_owner: Id | str | None = Field(None, description="user (name or uid) owning the socket; default: ours")
    socket_group: Id | str | None = Field(None, description="group (name or gid) of the socket; default: ours")
    allowed_uids: list[Id] = Field(
        [], description="peers with these uids may use the gate (root and the daemon's own user always may)"
    )
    allowed_gids: list[Id] = Field([], description="peers whose primary gid is one of these may use the gate")

    max_starting: int | None = Field(None, ge=1, le=100_000, description="loads starting at once on this node")
    max_starting_per_core: float | None = Field(
        1.0, gt=0, le=1000, description="loads starting at once per core (at least one)"
    )
    max_load_average_multiplier: float | None = Field(
        None, gt=0, le=1000, description="admit only while the 1-minute load average <= this x cores"
    )
    max_cpu: float | None = Field(
        None, alias="maxCPU", ge=0, le=100, description="admit only while CPU utilisation (% of all cores) <= this"
    )
    min_rate: float = Field(
        0.1, ge=0, le=10_000, description="starts per second admitted whatever the load signals say (0: none)"
    )
    max_rate: float | None = Field(None, gt=0, le=100_000, description="starts per second at most (a token bucket)")
    max_rate_burst: int = Field(1, ge=1, le=100_000, description="starts admitted back to back within maxRate")
    signal_window_seconds: float = Field(
        10.0, gt=0, le=3600, description="the load signals are averaged over this window"
    )
    start_timeout_seconds: float = Field(
        300.0, gt=0, le=86_400, description="a load not ready this long after admission fails and frees its slot"
    )
    keep_failed_seconds: float = Field(300.0, ge=0, le=86_400, description="how long failed loads stay in status")
    max_loads: int = Field(4096, ge=1, le=1_000_000, description="loads the gate tracks at once; more are refused")
    max_connections: int = Field(
        512,
        ge=1,
        le=65_536,
        description="client connections served at once; one more is answered 'busy' and closed"
        " (a client that does not read costs at most ~100 KiB: keep this x 100 KiB within the daemon's memory limit)",
    )

    @field_validator("socket")
    @classmethod
    def _absolute(cls, value: str) -> str:
        if not value.startswith("/"):
            raise ValueError("expected an absolute path")
        if value.endswith("/"):
            raise ValueError("expected the path of the socket, not of a directory")
        if len(value.encode()) > 107:
            raise ValueError("a unix socket path must be at most 107 bytes")
        return value

    @field_validator("socket_mode")
    @classmethod
    def _octal(cls, value: str) -> str:
        if not _MODE.match(value):
            raise ValueError('expected an octal mode like "0660"')
        return value

    @field_validator("socket_owner", "socket_group", mode="before")
    @classmethod
    def _account(cls, value: object) -> object:
        # Before the union is tried: an id out of range is one error, not one for each of its members.
        if isinstance(value, int) and not 0 <= value <= MAX_ID:
            raise ValueError(f"expected an id between 0 and {MAX_ID}")
        if isinstance(value, str) and not _ACCOUNT.match(value):
            raise ValueError("expected a user or group name, or a numeric id")
        return value

    @model_validator(mode="after")
    @cross_field("`minRate` ≤ `maxRate`", "minRate", "maxRate")
    def _rates_consistent(self) -> GateSettings:
        if self.max_rate is not None and self.min_rate > self.max_rate:
            raise ValueError(f"minRate ({self.min_rate}) must not exceed maxRate ({self.max_rate})")
        return self

    @property
    def mode(self) -> int:
        return int(self.socket_mode, 8)
