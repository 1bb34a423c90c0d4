"""The ``history`` config section: where the decision history is kept and how large it may grow."""

from __future__ import annotations

from typing import Annotated

from pydantic import Field, GetJsonSchemaHandler, field_validator, model_validator
from pydantic.json_schema import JsonSchemaValue
from pydantic_core import CoreSchema

from nodeguard.config_base import AbsolutePath, Model, cross_field
from nodeguard.quantity import Unit, parse_quantity

# The smallest share of maxBytes one file may have: a group change lists the workloads under it, and each line must
# fit in one file (history.entries.MAX_LINE_BYTES).
MIN_FILE_BYTES = 64 << 10


class _Bytes:
    """The JSON Schema of a size given as a number of bytes or like "32Mi": the number with the field's bounds."""

    def __get_pydantic_json_schema__(self, schema: CoreSchema, handler: GetJsonSchemaHandler) -> JsonSchemaValue:
        return {
            "anyOf": [handler(schema), {"type": "string", "pattern": r"^\s*[0-9.]+\s*([KMGTP]i?B?|k)?\s*$"}],
            "description": 'bytes: a number, or like "32Mi", "1G"',
        }


class HistorySettings(Model):
    """The decision history: each lever change and eviction with why it was made, kept across restarts."""

    enabled: bool = Field(
        True, description="record what nodeguard does and why (`nodeguard why`, `/history`); a dry run records nothing"
    )
    path: AbsolutePath = Field(
        "/var/lib/nodeguard/history",
        description="the directory of the history's files; on persistent storage, so that it outlives restarts and "
        "reboots (a tmpfs such as /run would also cost the node memory)",
    )
    max_bytes: Annotated[int, _Bytes()] = Field(
        32 << 20,
        ge=256 << 10,
        le=1 << 34,
        description="the most the history's files take together; the oldest file is deleted to make room",
    )
    files: int = Field(
        4, ge=2, le=64, description="how many files maxBytes is shared between: the oldest is deleted a file at a time"
    )

    @field_validator("max_bytes", mode="before")
    @classmethod
    def _max_bytes(cls, raw: object) -> int:
        if isinstance(raw, str) and raw.strip().endswith("%"):
            raise ValueError('expected bytes (a number, or like "32Mi"), not a percentage')
        return round(parse_quantity(raw, Unit.BYTES).value)

    @model_validator(mode="after")
    @cross_field(f"`maxBytes` / `files` ≥ {MIN_FILE_BYTES >> 10} KiB", "maxBytes", "files")
    def _file_size(self) -> HistorySettings:
        if self.max_bytes // self.files < MIN_FILE_BYTES:
            raise ValueError(
                f"maxBytes {self.max_bytes} shared between {self.files} files leaves each less than "
                f"{MIN_FILE_BYTES >> 10} KiB; raise maxBytes or lower files"
            )
        return self

    @property
    def file_bytes(self) -> int:
        """The most one file takes."""
        return self.max_bytes // self.files
