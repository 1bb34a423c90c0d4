"""The executor on this host's real cgroup v1 hierarchy: refused writes, a full ledger filesystem, a resize."""

from __future__ import annotations

import contextlib
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from nodeguard.actuators.executor import Executor
from nodeguard.actuators.ledger import Ledger
from nodeguard.actuators.levers.base import Lever
from nodeguard.guard_tick import settle
from nodeguard.model.levers import CPU_QUOTA, CPU_WEIGHT
from nodeguard.model.samples import CpuMax
from nodeguard.model.workloads import QosClass
from nodeguard.policy.holds import HeldThrottle, LoweredWeight
from nodeguard.policy.metrics import Metric
from nodeguard.policy.outcome import fold, fold_moves
from nodeguard.policy.planner import Plan, plan
from nodeguard.policy.state import GuardState
from tests.policy.builders import cpu_throttle, guard, snapshot, usage
from tests.support import cgroups as rc
from tests.support.levers import executor_for, throttle_by_hand

POD_LIMIT = CpuMax(150000)


@pytest.fixture
def full_ledger_dir(tmp_path: Path) -> Iterator[Path]:
    """A 64 KiB tmpfs for the ledger (filled up by the test when it wants)."""
    mount = tmp_path / "run"
    mount.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=64k", "tmpfs", str(mount)], check=True)
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=True)


def carried(executor: Executor, result: Plan, before: GuardState) -> tuple[GuardState, list[object]]:
    """One pass made (every lever's changes) and folded into the state, as a tick does; the changes made."""
    made = executor.apply(result.changes)
    return fold(result, before, made.applied).state, list(made.done)


def quota_lever(executor: Executor) -> Lever:
    return executor.levers[CPU_QUOTA.name]


def test_a_step_restore_on_a_full_disk_gives_the_original_back(full_ledger_dir: Path) -> None:
    """A restore step the ledger cannot record (full filesystem) becomes a full restore: the pod and its capped
    container get their exact originals, and the throttle is dropped from the state."""
    hierarchy = rc.v1_cpu_hierarchy()
    with rc.kubelet_pod(hierarchy, rc.unique_name(), "burstable", POD_LIMIT) as pod:
        ledger = Ledger.load(str(full_ledger_dir / "ledger.json"))
        executor = executor_for(str(hierarchy.writable), hierarchy.version, ledger)
        throttled = CpuMax(20000)
        throttle_by_hand(executor, ledger, pod.pod, POD_LIMIT, throttled)
        ledger.save()
        with open(full_ledger_dir / "filler", "wb") as filler, contextlib.suppress(OSError):
            filler.write(b"x" * (1 << 20))
        held = HeldThrottle(pod.pod, POD_LIMIT, throttled, frozenset({Metric.CPU_TOTAL_USAGE}), 0.0, demand_cores=1.5)
        state = GuardState.holding(held)
        calm = snapshot([usage(pod.pod, cores=0.2, cpu_max=throttled)], cpus=2, cores_used=0.3)
        result = plan(calm, state, guard(cpu_throttle(1.6, 1.0), restoreStepPercent=10))
        [step] = [a for a in result.changes if a.kind == "restore"]
        assert not step.release, "the plan asked for one step up"
        after, _ = carried(executor, result, state)
        assert hierarchy.limit(pod.pod) == POD_LIMIT and hierarchy.limit(pod.container) == POD_LIMIT
        assert pod.pod not in after.held(HeldThrottle) and pod.pod not in ledger.of("cpu.max")


def test_throttles_withheld_on_a_full_disk_leave_the_state_and_kernel_as_they_were(full_ledger_dir: Path) -> None:
    """No throttle is written that the ledger could not record first; the state holds nothing new."""
    hierarchy = rc.v1_cpu_hierarchy()
    with rc.kubelet_pod(hierarchy, rc.unique_name(), "burstable", POD_LIMIT) as pod:
        with open(full_ledger_dir / "filler", "wb") as filler, contextlib.suppress(OSError):
            filler.write(b"x" * (1 << 20))
        ledger = Ledger.load(str(full_ledger_dir / "ledger.json"))
        executor = executor_for(str(hierarchy.writable), hierarchy.version, ledger)
        busy = snapshot([usage(pod.pod, cores=1.0, cpu_max=POD_LIMIT)], cpus=2, cores_used=1.9)
        result = plan(busy, GuardState(), guard(cpu_throttle(1.4, 1.0)))
        assert [a for a in result.changes if a.kind == "throttle"]
        assert carried(executor, result, GuardState())[0].held(HeldThrottle) == {} and not ledger
        assert hierarchy.limit(pod.pod) == POD_LIMIT and hierarchy.limit(pod.container) == POD_LIMIT
        assert executor.counters.withheld == 1


def test_a_resize_behind_a_throttle_becomes_the_original(tmp_path: Path) -> None:
    """Drift that is neither nodeguard's value nor the original moves the original (ledger and state); the held
    quota is put back under it; a resize below the throttle releases the workload."""
    hierarchy = rc.v1_cpu_hierarchy()
    with rc.kubelet_pod(hierarchy, rc.unique_name(), "burstable", POD_LIMIT) as pod:
        ledger = Ledger.load(str(tmp_path / "ledger.json"))
        executor = executor_for(str(hierarchy.writable), hierarchy.version, ledger)
        throttled = CpuMax(30000)
        throttle_by_hand(executor, ledger, pod.pod, POD_LIMIT, throttled)
        held = HeldThrottle(pod.pod, POD_LIMIT, throttled, frozenset({Metric.CPU_TOTAL_USAGE}), 0.0)
        state = GuardState.holding(held)
        hierarchy.set_limit(pod.pod, CpuMax(120000))  # the resize, as kubelet writes the pod
        seen = snapshot([usage(pod.pod, cores=0.3, cpu_max=CpuMax(120000))], cpus=2, cores_used=1.0)
        idle = guard(cpu_throttle(1.6, 1.5), restoreStepPercent=10)
        after = settle(seen, state, idle, executor).state
        assert after.held(HeldThrottle)[pod.pod].original == CpuMax(120000)
        assert ledger.of("cpu.max")[pod.pod].original == CpuMax(120000).render_v2()
        kept = hierarchy.held_rate(pod.pod)
        assert kept is not None and kept < 1.2, "the throttle is kept under the new limit"
        assert after.held(HeldThrottle)[pod.pod].quota.cores == pytest.approx(kept)
        assert hierarchy.limit(pod.pod) == CpuMax(120000), "held through its containers: the pod's own is kubelet's"
        assert executor.counters.moved_originals == 1

        hierarchy.set_limit(pod.container, CpuMax(20000))  # now a resize below the throttle: nothing left to hold
        hierarchy.set_limit(pod.pod, CpuMax(20000))
        seen = snapshot([usage(pod.pod, cores=0.2, cpu_max=CpuMax(20000))], cpus=2, cores_used=1.0)
        state = fold_moves(after, executor.moved_originals(seen))
        after, _ = carried(executor, plan(seen, state, idle), state)
        assert pod.pod not in after.held(HeldThrottle) and pod.pod not in ledger.of("cpu.max")
        assert hierarchy.limit(pod.pod) == CpuMax(20000)


def test_a_ledger_entry_is_written_before_the_kernel_file(tmp_path: Path) -> None:
    """Whatever the executor writes to a cgroup is already in the ledger file (pending) at the moment of the write."""
    hierarchy = rc.v1_cpu_hierarchy()
    with rc.kubelet_pod(hierarchy, rc.unique_name(), "burstable", POD_LIMIT) as pod:
        path = tmp_path / "ledger.json"
        ledger = Ledger.load(str(path))
        executor = executor_for(str(hierarchy.writable), hierarchy.version, ledger)
        seen_on_disk: list[set[str]] = []
        write = quota_lever(executor).writer.write

        def spy(workload_id: str, filename: str, value: str, **context: object) -> bool:
            on_disk = Ledger.load(str(path)).of("cpu.max")
            seen_on_disk.append(set(on_disk) | {c for e in on_disk.values() for c in e.children})
            assert workload_id in seen_on_disk[-1], f"{workload_id} written before the ledger knew it"
            return write(workload_id, filename, value, **context)

        quota_lever(executor).writer.write = spy  # type: ignore[method-assign]
        busy = snapshot([usage(pod.pod, cores=1.0, cpu_max=POD_LIMIT)], cpus=2, cores_used=1.9)
        executor.apply(plan(busy, GuardState(), guard(cpu_throttle(1.4, 1.0))).changes)
        assert len(seen_on_disk) == 2, "the container, then the pod"


def test_a_refused_weight_is_held_back_and_leaves_no_ledger_record(tmp_path: Path) -> None:
    """A weight the writer cannot set (here cpu.shares is no file the kernel would take) is not recorded as
    lowered: the group is held back with the errno and the file, and the ledger keeps nothing of it."""
    root = tmp_path / "cpu"
    (root / "kp/burstable/cpu.shares").mkdir(parents=True)  # reading or writing it fails with EISDIR
    ledger = Ledger(str(tmp_path / "run/ledger.json"))
    executor = executor_for(str(root), "v1", ledger)
    stalled = usage("kp/podg", qos=QosClass.GUARANTEED, cores=0.4, waiting=0.3, starved=0.0)
    burner = usage("kp/burstable/pod0", qos=QosClass.BURSTABLE, cores=1.0, waiting=0.9)
    objective = {"metric": "protected_cpu_stall", "threshold": "5%", "restoreBelow": "1%", "action": "throttle",
                 "triggerAfter": 1}  # fmt: skip
    p = plan(snapshot([stalled, burner], cpus=2, cores_used=2.0), GuardState(), guard(objective))
    assert [r.group for r in p.changes if r.lever == CPU_WEIGHT.name] == ["kp/burstable"]
    state, done = carried(executor, p, GuardState())
    assert state.held(LoweredWeight) == {} and done == []
    hold = state.held_back["kp/burstable"]
    assert (hold.error, hold.file) == ("EISDIR", "cpu.shares") and hold.until > p.monotonic
    assert not ledger
    assert executor.counters.failed == 1


def test_a_lowered_group_that_vanishes_leaves_the_ledger_and_the_state(tmp_path: Path) -> None:
    """A tier whose weight is lowered and whose cgroup then goes (its last pod removed, before discovery notices)
    is dropped from the ledger and from the lowered weights on the next tick's drift check: nothing to restore."""
    hierarchy = rc.v1_cpu_hierarchy()
    name = rc.unique_name()
    tier = f"{name}/kp/burstable"
    ledger = Ledger(str(tmp_path / "run/ledger.json"))
    executor = executor_for(str(hierarchy.writable), "v1", ledger)
    stalled = usage(f"{name}/kp/podg", qos=QosClass.GUARANTEED, cores=0.4, waiting=0.3, starved=0.0)
    burner = usage(f"{tier}/pod0", qos=QosClass.BURSTABLE, cores=1.0, waiting=0.9)
    objective = {"metric": "protected_cpu_stall", "threshold": "5%", "restoreBelow": "1%", "action": "throttle",
                 "triggerAfter": 1}  # fmt: skip
    with hierarchy.groups(tier):
        hierarchy.set_shares(tier, 307)
        p = plan(snapshot([stalled, burner], cpus=2, cores_used=2.0), GuardState(), guard(objective))
        state, done = carried(executor, p, GuardState())
        assert [(d.before, d.after, d.holds_back) for d in done] == [("307", "2", True)]
        assert hierarchy.weight(tier) == 2 and tier in state.held(LoweredWeight) and tier in ledger.of("cpu.weight")
    seen = snapshot([stalled, burner], cpus=2, cores_used=2.0, monotonic=101.0)
    settled = settle(seen, state, guard(objective), executor)
    assert [c for c in settled.plan.changes if c.lever == CPU_WEIGHT.name] == []
    assert settled.state.held(LoweredWeight) == {} and not ledger
    assert not Ledger.load(str(tmp_path / "run/ledger.json")), "saved without it"


def test_a_throttled_workload_no_longer_seen_gets_its_original_back_where_its_group_stays(tmp_path: Path) -> None:
    """A throttle whose workload the snapshot no longer lists (discovery dropped it, or its read failed) is put back
    where the cgroup is still there, pod and capped container alike, and forgotten where it left."""
    hierarchy = rc.v1_cpu_hierarchy()
    parent = rc.unique_name()
    ledger = Ledger.load(str(tmp_path / "ledger.json"))
    executor = executor_for(str(hierarchy.writable), hierarchy.version, ledger)
    throttled = CpuMax(20000)
    throttles = {}
    with rc.kubelet_pod(hierarchy, parent, "burstable", POD_LIMIT) as stays:
        with rc.kubelet_pod(hierarchy, parent, "burstable", POD_LIMIT) as leaves:
            for pod in (stays, leaves):
                throttle_by_hand(executor, ledger, pod.pod, POD_LIMIT, throttled)
                throttles[pod.pod] = HeldThrottle(
                    pod.pod, POD_LIMIT, throttled, frozenset({Metric.CPU_TOTAL_USAGE}), 0.0
                )
            ledger.save()
        assert not (hierarchy.writable / leaves.pod).exists()
        assert hierarchy.held_rate(stays.pod) == pytest.approx(throttled.cores), "held through its containers"
        state = GuardState.holding(*throttles.values())
        # Neither throttled pod is in this snapshot: one was dropped by discovery, the other's cgroup is gone.
        empty = snapshot([usage(f"{parent}/other", cores=0.1)], cpus=2, cores_used=0.3)
        settled = settle(empty, state, guard(cpu_throttle(1.6, 1.0)), executor)
        # The one whose cgroup is gone left with the drift check before planning; the other is given back.
        assert set(settled.plan.departed) == {stays.pod}
        assert settled.state.held(HeldThrottle) == {}
        assert hierarchy.limit(stays.pod) == POD_LIMIT and hierarchy.limit(stays.container) == POD_LIMIT
        assert not ledger.of("cpu.max")
        assert Ledger.load(str(tmp_path / "ledger.json")).of("cpu.max") == {}


def test_a_refused_weight_moves_on_to_quotas_in_the_same_tick(tmp_path: Path) -> None:
    """A tier whose weight the kernel refuses is held back and the tick plans again at once: with the streak met,
    the next pass makes room with a quota on the burner under it, written in the same tick."""
    root = tmp_path / "cpu"
    (root / "kp/burstable/cpu.shares").mkdir(parents=True)  # reading or writing it fails with EISDIR
    pod = root / "kp/burstable/pod0"
    pod.mkdir()
    (pod / "cpu.cfs_quota_us").write_text("-1\n")
    (pod / "cpu.cfs_period_us").write_text("100000\n")
    ledger = Ledger(str(tmp_path / "run/ledger.json"))
    executor = executor_for(str(root), "v1", ledger)
    stalled = usage("kp/podg", qos=QosClass.GUARANTEED, cores=0.4, waiting=0.3, starved=0.0)
    burner = usage("kp/burstable/pod0", qos=QosClass.BURSTABLE, cores=1.0, waiting=0.9)
    objective = {"metric": "protected_cpu_stall", "threshold": "5%", "restoreBelow": "1%", "action": "throttle",
                 "triggerAfter": 1}  # fmt: skip
    settings = guard(objective, minQuotaCores=0.05, protect={"streakTicks": 1})
    settled = settle(snapshot([stalled, burner], cpus=2, cores_used=2.0), GuardState(), settings, executor)
    assert settled.passes == 2
    assert settled.state.held_back["kp/burstable"].error == "EISDIR"
    assert [(d.change.kind, d.change.group) for d in settled.done] == [("throttle", "kp/burstable/pod0")]
    written = int((pod / "cpu.cfs_quota_us").read_text())
    assert 0 < written < 100000, "the burner's quota came down in the tick the weight was refused"
    assert "kp/burstable/pod0" in settled.state.held(HeldThrottle) and not settled.state.held(LoweredWeight)
    assert settled.state.protect.phase == "quota-trial"
