"""The lever protocol: one kind of change nodeguard makes to a cgroup to hold it back.

A lever knows its files, how to read a group's current value, how to write a
value (with the hierarchy order and kernel quirks its files need), and which
of two values holds a group back more. Everything else — the ledger record,
ownership, restore, re-assert, adoption at start, originals that move — is
the same for every lever and lives once, in the ledger, the executor and
``restore``. Values cross this seam as canonical text (the form the ledger
keeps), so "is this still our value?" is a string comparison for every lever.
"""

from __future__ import annotations

import errno
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Literal, Protocol

from nodeguard.errors import ActuationRefused, NodeguardError
from nodeguard.log import get_logger
from nodeguard.model.levers import LeverTerms
from nodeguard.model.snapshot import WorkloadUsage

log = get_logger("nodeguard.levers")

Version = Literal["v1", "v2"]


class WriteCounts(Protocol):
    """The fields of the single writer's ``WriteCounters`` a lever adds to."""

    drift: int
    skipped_unchanged: int
    overwritten: Counter[str]  # by lever name


class Writer(Protocol):
    """What a lever uses of the single writer, ``cgroup_writer.CgroupWriter``.

    The writer accepts only the registered levers' files, so it imports this
    package; the levers name it by what they use instead of importing it back.
    """

    @property
    def root(self) -> str: ...

    @property
    def dry_run(self) -> bool: ...

    @property
    def counters(self) -> WriteCounts: ...

    def read(self, workload_id: str, filename: str) -> str: ...

    def exists(self, workload_id: str) -> bool: ...

    def write(self, workload_id: str, filename: str, value: str, **context: object) -> bool: ...


@dataclass(frozen=True, slots=True)
class Write:
    """One cgroup's value changed: ``path`` relative to the hierarchy root, values as canonical text."""

    path: str
    before: str
    after: str


class WriteRefused(NodeguardError):
    """The kernel (or the single writer) refused a lever's write; nothing of the change is left half done."""

    def __init__(self, path: str, filename: str, error: str, detail: str) -> None:
        self.path = path
        self.file = filename
        self.error = error  # errno name, or the refusal's kind
        self.detail = detail
        super().__init__(f"{filename}: {detail} ({error})")


def refusal(path: str, filename: str, exc: OSError | ActuationRefused) -> WriteRefused:
    """A refused write (kernel errno, or the single writer's own refusal) as WriteRefused."""
    if isinstance(exc, ActuationRefused):
        return WriteRefused(path, filename, "refused", str(exc))
    name = errno.errorcode.get(exc.errno or 0, str(exc.errno))
    return WriteRefused(path, filename, name, exc.strerror or str(exc))


class Lever(Protocol):
    """One lever on one cgroup hierarchy; see the module docstring for what is shared."""

    terms: LeverTerms  # what it is called: ledger key, noun, Events, metrics (nodeguard.model.levers)
    name: str  # its key in the ledger, e.g. "cpu.max" (terms.name)
    noun: str  # what its value is called in messages: "quota", "weight" (terms.noun)
    version: Version
    writer: Writer

    @staticmethod
    def check(value: str) -> str:
        """``value`` if it is this lever's canonical text, else ValueError (the ledger validates with it)."""
        ...

    def read(self, group: str) -> str:
        """The group's current value. CgroupGone when it left; ParseError, OSError, ActuationRefused otherwise."""
        ...

    def plan(self, group: str, target: str, originals: Mapping[str, str]) -> tuple[str, list[Write]]:
        """(the group's current value, the writes in the order the kernel accepts that set it to ``target``).

        Descendants the lever must change with the group are part of the
        writes; ``originals`` are the recorded originals of those it changed
        before. No writes when the group already holds ``target``.
        """
        ...

    def perform(self, writes: Sequence[Write], **context: object) -> None:
        """Make the writes in order; on a refusal, undo those made and raise WriteRefused (CgroupGone passes)."""
        ...

    def restricts(self, value: str, than: str) -> bool:
        """Does ``value`` hold a group back more than ``than`` does?"""
        ...

    def strongest(self, group: str) -> str:
        """The value that holds the group back the most that its other owners can live with (what a change with
        no target asks): their own writes of it must still succeed."""
        ...

    def resolve(self, group: str, target: str) -> str:
        """The value this kernel takes for ``target`` on the group (a weight's idle where the kernel has none:
        its least weight)."""
        ...

    def seen(self, usage: WorkloadUsage) -> str | None:
        """The group's value as a snapshot's workload shows it; None when the snapshot does not say (read it)."""
        ...

    def shown(self, value: str) -> str:
        """A value for people: "0.5 cores", "256 MiB", "2" (a weight), "idle"."""
        ...

    def number(self, value: str) -> float | None:
        """A value in the unit of the lever's gauges (terms.unit); None for no limit."""
        ...

    def file_of(self, write: Write) -> str:
        """The file a write changes (for messages and held-back records)."""
        ...

    @property
    def main_file(self) -> str:
        """The file that holds the group's value (named when reading it fails)."""
        ...


def writes_back(current: str, target: str, group: str) -> list[Write]:
    """A single-file lever's writes: one, or none when the value is there already."""
    return [] if current == target else [Write(group, current, target)]


def note_drift(
    lever: Lever, group: str, current: str, last_applied: str | None, context: Mapping[str, object]
) -> dict[str, object]:
    """Count and log a value someone else changed since nodeguard wrote it; the context for the write."""
    if last_applied is None or current == last_applied:
        return dict(context)
    lever.writer.counters.drift += 1
    lever.writer.counters.overwritten[lever.name] += 1
    if not lever.writer.dry_run:
        log.warning(f"{lever.noun} drift re-asserted", group=group, found=current, by=context.get("action"))
    return {**context, "drift_from": current}
