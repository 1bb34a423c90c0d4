"""The quota lever: cgroup v2 ``cpu.max`` and v1 ``cpu.cfs_quota_us``, through the single writer.

A workload's limit is one file on v2: the kernel takes the tightest limit on
the path, so a pod's lowered ``cpu.max`` holds whatever its containers say.
cgroup v1 refuses (EINVAL) a quota above the parent's, and a parent quota
below a child's, so where kubelet gave the containers limits of their own,
the children are capped at the workload's new limit first (deepest first)
and the parent written last; raising goes the other way round. Every file so
changed is returned to the caller, which records it in the ledger first.

The same rule binds the node's other owners: a container (re)start makes the
runtime write the container's own limit into a new cgroup under the pod, and
systemd's ``daemon-reload`` writes it again; with the pod held below that
limit, their write would fail. So on v1, where a container's own limit is
above the hold, the pod is held *through its containers*: its own limit stays
as it was, and its direct children share the hold (each at most its own
limit, the rest by their ``cpu.shares``, the container requests) so that
together they get exactly the held rate. The ledger records the pod's own
value as applied and the hold as ``effective``.

Its canonical text is v2's ``cpu.max`` format ("max 100000" for unlimited),
on v1 too.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass

from nodeguard.actuators.levers.base import Version, Write, Writer, note_drift, refusal
from nodeguard.errors import ActuationRefused, CgroupGone, ParseError
from nodeguard.log import get_logger
from nodeguard.model.levers import CPU_QUOTA
from nodeguard.model.samples import CpuMax
from nodeguard.model.snapshot import WorkloadUsage
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


def in_order(now: Mapping[str, CpuMax], wanted: Mapping[str, CpuMax]) -> list[LimitWrite]:
    """The writes from ``now`` to ``wanted`` in an order v1 accepts at every step: limits that come down go
    first, deepest first; then limits that go up, shallowest first."""
    lower: list[LimitWrite] = []
    raise_: list[LimitWrite] = []
    for path, limit in wanted.items():
        before = now[path]
        if limit != before:
            (lower if rate_above(before, limit) else raise_).append(LimitWrite(path, before, limit))
    lower.sort(key=lambda w: -w.path.count("/"))
    raise_.sort(key=lambda w: w.path.count("/"))
    return [*lower, *raise_]


def shared(total_us: int, weights: Mapping[str, int], caps: Mapping[str, int | None]) -> dict[str, int]:
    """``total_us`` of quota shared by weight (water-filling): none above its cap nor under the kernel's
    smallest quota; the shares add up to exactly ``total_us`` wherever the caps and that floor allow."""
    left = {path: max(1, weight) for path, weight in weights.items()}
    out: dict[str, int] = {}
    budget = total_us
    fixed = True
    while left and fixed:
        fixed = False
        weight = sum(left.values())
        for path, own in left.items():
            fair = budget * own / weight
            cap = caps.get(path)
            if cap is not None and cap < fair:
                out[path] = max(MIN_QUOTA_US, cap)
            elif fair < MIN_QUOTA_US:
                out[path] = MIN_QUOTA_US
            else:
                continue
            budget -= out[path]
            del left[path]
            fixed = True
            break  # the others' fair shares change: work them out again
    if left:
        weight = sum(left.values())
        order = sorted(left, key=lambda p: (-left[p], p))
        for path in order:
            out[path] = max(MIN_QUOTA_US, budget * left[path] // weight)
        out[order[0]] += max(0, budget - sum(out[p] for p in order))  # the rounding, to the largest share
    return out


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


class QuotaLever:
    """CFS bandwidth limits of a workload and of the descendants kubelet limited too (v1)."""

    terms = CPU_QUOTA
    name = CPU_QUOTA.name
    noun = CPU_QUOTA.noun

    def __init__(self, writer: Writer, version: str) -> None:
        self.writer = writer
        self.version: Version = "v2" if version == "v2" else "v1"

    @staticmethod
    def files(version: str) -> frozenset[str]:
        return frozenset({"cpu.max"} if version == "v2" else {"cpu.cfs_quota_us", "cpu.cfs_period_us"})

    @staticmethod
    def check(value: str) -> str:
        try:
            return parse_cpu_max(value).render_v2()
        except ParseError as exc:
            raise ValueError(str(exc)) from None

    def read(self, group: str) -> str:
        return self.limit(group).render_v2()

    def limit(self, path: str) -> CpuMax:
        if self.version == "v2":
            return parse_cpu_max(self.writer.read(path, "cpu.max"))
        return parse_cfs_quota(self.writer.read(path, "cpu.cfs_quota_us"), self.writer.read(path, "cpu.cfs_period_us"))

    def restricts(self, value: str, than: str) -> bool:
        return rate_above(parse_cpu_max(than), parse_cpu_max(value))

    def strongest(self, group: str) -> str:
        raise ValueError("a quota is always asked for by value")

    def resolve(self, group: str, target: str) -> str:
        return target

    def seen(self, usage: WorkloadUsage) -> str | None:
        return None if usage.cpu_max is None else usage.cpu_max.render_v2()

    def shown(self, value: str) -> str:
        cores = parse_cpu_max(value).cores
        return "unlimited" if cores is None else f"{cores:.3g} cores"

    def number(self, value: str) -> float | None:
        return parse_cpu_max(value).cores

    def limited_descendants(self, workload_id: str) -> dict[str, CpuMax]:
        """v1: the descendants of a workload that carry a quota of their own (v2 needs none of this)."""
        if self.version == "v2":
            return {}
        found: dict[str, CpuMax] = {}
        for path in self._descendants(workload_id, DESCENDANT_DEPTH):
            try:
                limit = self.limit(path)
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

    def plan(self, group: str, target: str, originals: Mapping[str, str]) -> tuple[str, list[Write]]:
        """Any limited child not recorded in ``originals`` has its current limit as its original."""
        current, writes = self.plan_limits(
            group, parse_cpu_max(target), {p: parse_cpu_max(v) for p, v in originals.items()}
        )
        return current.render_v2(), [Write(w.path, w.before.render_v2(), w.after.render_v2()) for w in writes]

    def plan_limits(
        self, workload_id: str, target: CpuMax, originals: Mapping[str, CpuMax] | None = None
    ) -> tuple[CpuMax, list[LimitWrite]]:
        """``plan`` in CpuMax: (the workload's current limit, the writes that hold it at ``target``).

        ``originals`` are the recorded originals of the workload (its own path) and of its descendants.
        """
        current = self.limit(workload_id)
        originals = originals or {}
        children = {
            path: (now, originals.get(path, now)) for path, now in self.limited_descendants(workload_id).items()
        }
        if any(original.quota_us is not None and rate_above(original, target) for _, original in children.values()):
            # A container's own limit is above the hold: a write of it (a restart) must not fail.
            return current, self._through_children(workload_id, current, target, originals, children)
        # A recorded child that lost its limit (or left) is not ours to touch any more.
        return current, ordered_writes(workload_id, current, target, children)

    def _through_children(
        self,
        workload_id: str,
        current: CpuMax,
        target: CpuMax,
        originals: Mapping[str, CpuMax],
        limited: Mapping[str, tuple[CpuMax, CpuMax]],
    ) -> list[LimitWrite]:
        """Hold the workload at ``target`` through its direct children, its own limit back at its original."""
        assert target.quota_us is not None, "an unlimited target is never below a child's limit"
        period = target.period_us
        own = originals.get(workload_id, current)
        now: dict[str, CpuMax] = {workload_id: current}
        wanted: dict[str, CpuMax] = {workload_id: own}
        weights: dict[str, int] = {}
        caps: dict[str, int | None] = {}
        for child in self._descendants(workload_id, 1):
            try:
                now[child] = self.limit(child)
            except (CgroupGone, OSError, ParseError, ActuationRefused):
                continue  # a container leaving as we look
            original = limited[child][1] if child in limited else originals.get(child, now[child])
            caps[child] = None if original.quota_us is None else original.quota_us * period // original.period_us
            weights[child] = self._shares(child)
        for child, quota in shared(target.quota_us, weights, caps).items():
            wanted[child] = CpuMax(quota, period)
        # Deeper limited descendants (crun's "container" subgroup) under their nearest held ancestor.
        for child in sorted(limited, key=lambda p: p.count("/")):
            if child in wanted:
                continue
            before, original = limited[child]
            ancestor = child.rsplit("/", 1)[0]
            while ancestor not in wanted and "/" in ancestor:
                ancestor = ancestor.rsplit("/", 1)[0]
            now[child] = before
            wanted[child] = capped(original, wanted.get(ancestor, target))
        return in_order(now, wanted)

    def _shares(self, path: str) -> int:
        """A container's cpu.shares (its request, as kubelet and the runtime write it); 1024 when unreadable."""
        try:
            return max(2, int(self.writer.read(path, "cpu.shares")))
        except (CgroupGone, OSError, ActuationRefused, ValueError):
            return 1024

    def perform(self, writes: Sequence[Write], **context: object) -> None:
        done: list[LimitWrite] = []
        for write in writes:
            limit = LimitWrite(write.path, parse_cpu_max(write.before), parse_cpu_max(write.after))
            try:
                self._write(limit.path, limit.before, limit.after, context)
            except (OSError, ActuationRefused) as exc:
                self._undo(done)
                raise refusal(write.path, self._file(limit), exc) from None
            done.append(limit)

    def _undo(self, done: list[LimitWrite]) -> None:
        for write in reversed(done):
            try:
                self._write(write.path, write.after, write.before, {"action": "undo"})
            except (OSError, ActuationRefused, CgroupGone) as exc:
                log.error("cannot undo a partial quota change; the ledger keeps it", path=write.path, error=str(exc))

    def apply(self, workload_id: str, target: CpuMax, last_applied: CpuMax | None = None, **context: object) -> bool:
        """Set one workload's limit (and cap its children on v1) outside the ledger (benchmarks, tests); False
        when it already was. ``last_applied``: what was written before; a current value other than it is drift."""
        current, writes = self.plan(workload_id, target.render_v2(), {})
        if not writes:
            self.writer.counters.skipped_unchanged += 1
            return False
        applied = None if last_applied is None else last_applied.render_v2()
        self.perform(writes, **note_drift(self, workload_id, current, applied, context))
        return True

    @property
    def main_file(self) -> str:
        return "cpu.max" if self.version == "v2" else "cpu.cfs_quota_us"

    def file_of(self, write: Write) -> str:
        return self._file(LimitWrite(write.path, parse_cpu_max(write.before), parse_cpu_max(write.after)))

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
