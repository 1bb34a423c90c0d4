"""The memory lever: cgroup v2 ``memory.high``, through the single writer.

Above ``memory.high`` the kernel reclaims from the group and makes its
allocating tasks sleep; it never calls the OOM killer (``memory.max`` does).
So a lowered ``memory.high`` holds a growing workload back and shrinks its page
cache first, and the worst it does to the workload is slow it down.

Kernel facts this module is built on (checked in the VM by
tests/kernel/test_memory_high_kernel.py):

- The value is bytes or the word "max"; the kernel keeps whole pages and reads
  back the value rounded down to its page size. A target that is not a whole
  number of pages would read back as another value, which the ledger would
  then take for someone else's: ``plan`` refuses it (the policy writes
  multiples of ``GRANULE``, a whole number of pages on 4 KiB and 64 KiB pages).
- A child's ``memory.high`` may be above its parent's: the kernel never
  refuses it (unlike cgroup v1's quota), and the tightest limit on the path
  is the one that holds. So where kubelet's Memory QoS gave the pod's
  containers a ``memory.high`` of their own, lowering the pod's holds them
  all; the containers are not written, and restore writes the pod's original
  back alone.
- Writing a value below the group's usage makes the kernel reclaim inside the
  write: the policy lowers it in bounded steps.
- cgroup v1 has no ``memory.high`` (its soft limit acts only under global
  pressure, its hard limit invokes the OOM killer): this lever exists on v2
  only (``files("v1")`` is empty, and ``levers.build`` leaves it out there).

kubelet's own ``memory.high`` (Memory QoS), when set, is the original, like
any value found before nodeguard's first write. Its canonical text is the
kernel's: bytes as a decimal number, or "max".
"""

from __future__ import annotations

import mmap
from collections.abc import Mapping, Sequence

from nodeguard.actuators.levers.base import Version, Write, Writer, refusal, writes_back
from nodeguard.errors import ActuationRefused, ParseError
from nodeguard.model.levers import MEMORY_HIGH
from nodeguard.model.snapshot import WorkloadUsage

FILE = "memory.high"
UNLIMITED = "max"


def high_bytes(value: str) -> int | None:
    """A canonical value as bytes; None for "max" (no limit)."""
    return None if value == UNLIMITED else int(value)


def high_text(value: int | None) -> str:
    """Bytes (None: no limit) as the canonical text."""
    return UNLIMITED if value is None else str(value)


class MemoryHighLever:
    """A workload's ``memory.high``: lowered to hold its memory back without the OOM killer (cgroup v2 only)."""

    terms = MEMORY_HIGH
    name = MEMORY_HIGH.name
    noun = MEMORY_HIGH.noun

    def __init__(self, writer: Writer, version: str) -> None:
        self.writer = writer
        self.version: Version = "v2" if version == "v2" else "v1"
        self.page = mmap.PAGESIZE

    @staticmethod
    def files(version: str) -> frozenset[str]:
        return frozenset({FILE}) if version == "v2" else frozenset()

    @staticmethod
    def check(value: str) -> str:
        if value == UNLIMITED:
            return value
        number = int(value)  # ValueError for anything else
        if number < 0:
            raise ValueError(f"memory.high {number} is negative")
        return str(number)

    def read(self, group: str) -> str:
        text = self.writer.read(group, FILE)
        try:
            return self.check(text)
        except ValueError:
            raise ParseError(f"{FILE} of {group}: expected bytes or 'max', got {text[:80]!r}") from None

    def plan(self, group: str, target: str, originals: Mapping[str, str]) -> tuple[str, list[Write]]:
        """One write, to the group alone: the kernel takes a child's memory.high above its parent's (see above)."""
        wanted = high_bytes(self.check(target))
        if wanted is not None and wanted % self.page:
            # It would read back rounded down, and no longer be recognised as nodeguard's value.
            raise ValueError(f"{FILE} {wanted} is not a whole number of {self.page}-byte pages")
        current = self.read(group)
        return current, writes_back(current, target, group)

    def perform(self, writes: Sequence[Write], **context: object) -> None:
        for write in writes:  # one group: nothing to undo
            try:
                self.writer.write(write.path, FILE, write.after, **context)
            except (OSError, ActuationRefused) as exc:
                raise refusal(write.path, FILE, exc) from None

    def restricts(self, value: str, than: str) -> bool:
        mine, theirs = high_bytes(value), high_bytes(than)
        return mine is not None and (theirs is None or mine < theirs)

    def strongest(self, group: str) -> str:
        raise ValueError("memory.high is always asked for by value")

    def resolve(self, group: str, target: str) -> str:
        return target

    def seen(self, usage: WorkloadUsage) -> str | None:
        high = usage.memory_high
        return None if high is None else (UNLIMITED if high == float("inf") else str(int(high)))

    def shown(self, value: str) -> str:
        number = high_bytes(value)
        return UNLIMITED if number is None else f"{number / (1 << 20):.4g} MiB"

    def number(self, value: str) -> float | None:
        number = high_bytes(value)
        return None if number is None else float(number)

    def file_of(self, write: Write) -> str:
        return FILE

    @property
    def main_file(self) -> str:
        return FILE
