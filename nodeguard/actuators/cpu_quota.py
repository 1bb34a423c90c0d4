"""CPU quotas: cgroup v2 ``cpu.max`` and v1 ``cpu.cfs_quota_us``, through the single writer.

Before every write the current value is read again; a value that differs from
what nodeguard set last means someone else (kubelet, a runtime) changed it:
that is drift, counted and re-asserted.
"""

from __future__ import annotations

from nodeguard.actuators.cgroup_writer import CgroupWriter
from nodeguard.log import get_logger
from nodeguard.model.samples import CpuMax
from nodeguard.sources.cgroupfs import parse_cfs_quota, parse_cpu_max

log = get_logger("nodeguard.quota")


class QuotaWriter:
    def __init__(self, writer: CgroupWriter, version: str) -> None:
        self.writer = writer
        self.version = version

    def read(self, workload_id: str) -> CpuMax:
        if self.version == "v2":
            return parse_cpu_max(self.writer.read(workload_id, "cpu.max"))
        return parse_cfs_quota(
            self.writer.read(workload_id, "cpu.cfs_quota_us"), self.writer.read(workload_id, "cpu.cfs_period_us")
        )

    def apply(self, workload_id: str, target: CpuMax, last_applied: CpuMax | None = None, **context: object) -> bool:
        """Make the kernel's quota ``target``; False when it already was (nothing written).

        ``last_applied`` is what nodeguard wrote before, if anything: a current
        value different from it is drift.
        """
        current = self.read(workload_id)
        if current == target:
            self.writer.counters.skipped_unchanged += 1
            return False
        drift = last_applied is not None and current != last_applied
        if drift:
            self.writer.counters.drift += 1
            context = {**context, "drift_from": render(current)}
        written = self._write(workload_id, current, target, context)
        # Whatever write found it (a re-assertion, or a planned change in the same tick), drift is reported.
        if drift and written and not self.writer.dry_run:
            log.warning(
                "quota drift re-asserted", workload=workload_id, found=render(current), by=context.get("action")
            )
        return written

    def _write(self, workload_id: str, current: CpuMax, target: CpuMax, context: dict[str, object]) -> bool:
        if self.version == "v2":
            return self.writer.write(workload_id, "cpu.max", target.render_v2(), **context)
        if current.period_us != target.period_us:
            # v1 checks quota against the period it has: set the period first.
            self.writer.write(workload_id, "cpu.cfs_period_us", str(target.period_us), **context)
        quota = "-1" if target.quota_us is None else str(target.quota_us)
        return self.writer.write(workload_id, "cpu.cfs_quota_us", quota, **context)


def render(limit: CpuMax) -> str:
    return limit.render_v2()
