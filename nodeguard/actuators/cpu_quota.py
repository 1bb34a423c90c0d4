"""CPU quotas: cgroup v2 ``cpu.max`` and v1 ``cpu.cfs_quota_us``, through the single writer.

A workload's limit is one file on v2: the kernel takes the tightest limit on
the path, so a pod's lowered ``cpu.max`` holds whatever its containers say.
cgroup v1 refuses (EINVAL) a quota above the parent's, and a parent quota
below a child's, so where kubelet gave the containers limits of their own,
the children are capped at the workload's new limit first (deepest first)
and the parent written last; raising goes the other way round. Every file so
changed is returned to the caller, which records it in the ledger first.
"""

from __future__ import annotations

import errno
import os
from collections.abc import Iterator, Mapping
from dataclasses import dataclass

from nodeguard.actuators.cgroup_writer import CgroupWriter
from nodeguard.errors import ActuationRefused, CgroupGone, NodeguardError, ParseError
from nodeguard.log import get_logger
from nodeguard.model.samples import CpuMax
from nodeguard.sources.cgroupfs import parse_cfs_quota, parse_cpu_max

log = get_logger("nodeguard.quota")

MIN_QUOTA_US = 1000  # the kernel refuses a smaller CFS quota
DESCENDANT_DEPTH = 3  # pod / container / crun's "container" subgroup


@dataclass(frozen=True, slots=True)
class LimitWrite:
    """One cgroup's limit changed: ``path`` relative to the hierarchy root."""

    path: str
    before: CpuMax
    after: CpuMax


class LimitRefused(NodeguardError):
    """The kernel (or the single writer) refused a limit write; nothing of the change is left half done."""

    def __init__(self, path: str, filename: str, error: str, detail: str) -> None:
        self.path = path
        self.file = filename
        self.error = error  # errno name, or the refusal's kind
        self.detail = detail
        super().__init__(f"{filename}: {detail} ({error})")


def rate_above(limit: CpuMax, other: CpuMax) -> bool:
    """Is ``limit`` a higher rate than ``other`` (unlimited is highest)?"""
    if limit.quota_us is None:
        return other.quota_us is not None
    if other.quota_us is None:
        return False
    return limit.quota_us * other.period_us > other.quota_us * limit.period_us


def capped(original: CpuMax, parent: CpuMax) -> CpuMax:
    """A child's limit under ``parent``: its original, or the parent's rate in the child's own period.

    Rounded down, so the kernel's integer comparison of the two rates never
    finds the child above the parent; where that would fall under the
    kernel's smallest quota, the child takes the parent's own period too.
    """
    if original.quota_us is None or not rate_above(original, parent):
        return original  # an unlimited child is no conflict: v1 lets it inherit the parent's limit
    assert parent.quota_us is not None  # nothing is above unlimited
    quota = parent.quota_us * original.period_us // parent.period_us
    if quota < MIN_QUOTA_US:
        return parent
    return CpuMax(quota, original.period_us)


def ordered_writes(
    path: str, current: CpuMax, target: CpuMax, children: Mapping[str, tuple[CpuMax, CpuMax]]
) -> list[LimitWrite]:
    """The writes that set ``path`` to ``target`` with every child under it, in an order v1 accepts.

    ``children`` maps a descendant's path to (its current limit, its original).
    Children that must come down go first, deepest first; then the workload;
    then children that may go back up, shallowest first.
    """
    lower: list[LimitWrite] = []
    raise_: list[LimitWrite] = []
    # Top down: a child is capped at what its nearest limited ancestor will have.
    wanted: dict[str, CpuMax] = {path: target}
    for child in sorted(children, key=lambda p: p.count("/")):
        now, original = children[child]
        ancestor = child.rsplit("/", 1)[0]
        while ancestor not in wanted and "/" in ancestor:
            ancestor = ancestor.rsplit("/", 1)[0]
        under = wanted.get(ancestor, target)
        limit = capped(original, under)
        wanted[child] = limit if limit.quota_us is not None else under  # unlimited inherits
        if limit == now:
            continue
        (lower if rate_above(now, limit) else raise_).append(LimitWrite(child, now, limit))
    lower.sort(key=lambda w: -w.path.count("/"))
    raise_.sort(key=lambda w: w.path.count("/"))
    own = [LimitWrite(path, current, target)] if current != target else []
    return [*lower, *own, *raise_]


class QuotaWriter:
    def __init__(self, writer: CgroupWriter, version: str) -> None:
        self.writer = writer
        self.version = version

    def read(self, path: str) -> CpuMax:
        if self.version == "v2":
            return parse_cpu_max(self.writer.read(path, "cpu.max"))
        return parse_cfs_quota(self.writer.read(path, "cpu.cfs_quota_us"), self.writer.read(path, "cpu.cfs_period_us"))

    def limited_descendants(self, workload_id: str) -> dict[str, CpuMax]:
        """v1: the descendants of a workload that carry a quota of their own (v2 needs none of this)."""
        if self.version == "v2":
            return {}
        found: dict[str, CpuMax] = {}
        for path in self._descendants(workload_id, DESCENDANT_DEPTH):
            try:
                limit = self.read(path)
            except (CgroupGone, OSError, ParseError, ActuationRefused):
                continue  # a container leaving as we look: nothing of it to cap
            if limit.quota_us is not None:
                found[path] = limit
        return found

    def _descendants(self, path: str, depth: int) -> Iterator[str]:
        if depth == 0:
            return
        try:
            with os.scandir(os.path.join(self.writer.root, path)) as entries:
                names = [e.name for e in entries if e.is_dir(follow_symlinks=False)]
        except OSError:
            return
        for name in sorted(names):
            child = f"{path}/{name}"
            yield child
            yield from self._descendants(child, depth - 1)

    def plan(
        self, workload_id: str, target: CpuMax, originals: Mapping[str, CpuMax] | None = None
    ) -> tuple[CpuMax, list[LimitWrite]]:
        """(the workload's current limit, the writes that set it to ``target``).

        ``originals`` are the recorded originals of children nodeguard changed
        before; any other limited child's original is its current limit.
        """
        current = self.read(workload_id)
        originals = originals or {}
        children = {
            path: (now, originals.get(path, now)) for path, now in self.limited_descendants(workload_id).items()
        }
        # A recorded child that lost its limit (or left) is not ours to touch any more.
        return current, ordered_writes(workload_id, current, target, children)

    def perform(self, writes: list[LimitWrite], **context: object) -> None:
        """Make the writes in order; on a refusal, undo the ones made (in reverse) and raise LimitRefused.

        CgroupGone passes through: the workload left, and with it every file.
        """
        done: list[LimitWrite] = []
        for write in writes:
            try:
                self._write(write.path, write.before, write.after, context)
            except (OSError, ActuationRefused) as exc:
                self._undo(done)
                raise refusal(write.path, self._file(write), exc) from None
            done.append(write)

    def _undo(self, done: list[LimitWrite]) -> None:
        for write in reversed(done):
            try:
                self._write(write.path, write.after, write.before, {"action": "undo"})
            except (OSError, ActuationRefused, CgroupGone) as exc:
                log.error("cannot undo a partial quota change; the ledger keeps it", path=write.path, error=str(exc))

    def apply(self, workload_id: str, target: CpuMax, last_applied: CpuMax | None = None, **context: object) -> bool:
        """Set one workload's limit (and cap its children on v1); False when it already was (nothing written).

        ``last_applied`` is what nodeguard wrote before, if anything: a current
        value different from it is drift, counted and logged.
        """
        current, writes = self.plan(workload_id, target)
        if not writes:
            self.writer.counters.skipped_unchanged += 1
            return False
        self.perform(writes, **self.note_drift(workload_id, current, last_applied, context))
        return True

    def note_drift(
        self, path: str, current: CpuMax, last_applied: CpuMax | None, context: Mapping[str, object]
    ) -> dict[str, object]:
        """Count and log a limit someone else changed since nodeguard wrote it; the context for the write."""
        if last_applied is None or current == last_applied:
            return dict(context)
        self.writer.counters.drift += 1
        if not self.writer.dry_run:
            log.warning("quota drift re-asserted", workload=path, found=current.render_v2(), by=context.get("action"))
        return {**context, "drift_from": current.render_v2()}

    def _file(self, write: LimitWrite) -> str:
        if self.version == "v2":
            return "cpu.max"
        return "cpu.cfs_period_us" if write.before.period_us != write.after.period_us else "cpu.cfs_quota_us"

    def _write(self, path: str, current: CpuMax, target: CpuMax, context: Mapping[str, object]) -> bool:
        if self.version == "v2":
            return self.writer.write(path, "cpu.max", target.render_v2(), **context)
        if current.period_us != target.period_us:
            # v1 checks quota against the period it has: set the period first.
            self.writer.write(path, "cpu.cfs_period_us", str(target.period_us), **context)
        quota = "-1" if target.quota_us is None else str(target.quota_us)
        return self.writer.write(path, "cpu.cfs_quota_us", quota, **context)


def refusal(path: str, filename: str, exc: OSError | ActuationRefused) -> LimitRefused:
    """A refused write (kernel errno, or the single writer's own refusal) as LimitRefused."""
    if isinstance(exc, ActuationRefused):
        return LimitRefused(path, filename, "refused", str(exc))
    name = errno.errorcode.get(exc.errno or 0, str(exc.errno))
    return LimitRefused(path, filename, name, exc.strerror or str(exc))


def render(limit: CpuMax) -> str:
    return limit.render_v2()
