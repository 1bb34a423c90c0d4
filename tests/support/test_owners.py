"""The owner double writes what kubelet, runc and systemd write, in their order, to real kernel files: this host's
cgroup v1 cpu hierarchy, and (``kernel``-marked) the VM's pure cgroup v2."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.support import cgroups as rc
from tests.support.owners import (
    Container,
    Outcome,
    Owners,
    OwnerWrite,
    Pod,
    counts,
    kubelet_weight,
    milli_cpu_to_quota,
    milli_cpu_to_shares,
    runc_weight,
    weight_to_shares,
)

GIB = 1 << 30
ALLOCATABLE = 2000  # millicores: kubepods' cpu.shares 2048


@contextlib.contextmanager
def node(version: str, **options: Any) -> Iterator[Owners]:
    """An empty node under a fresh group of this machine's v1 cpu hierarchy, or of the VM's v2 mount."""
    if version == "v1":
        base = rc.v1_cpu_hierarchy().writable  # skips where there is none
    else:
        mount = rc.v2_mount()
        assert mount is not None
        base = mount
    with rc.cgroups(base / rc.unique_name()) as [root]:
        owners = Owners(root, "v2" if version == "v2" else "v1", allocatable_milli=ALLOCATABLE, **options)
        try:
            yield owners
        finally:
            owners.close()


def web() -> Pod:
    """Burstable: one container with its own 1.5-core limit, one with a request only."""
    return Pod("web", (Container("app", 500, 1500), Container("side", 250)))


def limited() -> Pod:
    """Burstable with a limit on every container: kubelet limits the pod too."""
    return Pod("batch", (Container("app", 1000, 1500),))


def steps(owners: Owners, writes: list[OwnerWrite]) -> list[tuple[str, str, str, str]]:
    """(owner, group, file, value), groups named as a pod spec names them (``Owners.name_of``)."""
    return [(w.owner, owners.name_of(w.path), w.file, w.value) for w in writes]


def hold_by_hand(owners: Owners, pod: Pod) -> None:
    """The pod's quota at 0.3 core, its ``app`` container capped first (v1 refuses a parent below a child)."""
    for path in (owners.container_path(pod, "app"), owners.pod_path(pod)):
        assert path is not None
        (owners.root / path / "cpu.cfs_quota_us").write_text("30000")


def value(owners: Owners, path: str | None, name: str) -> str:
    assert path is not None
    return (owners.root / path / name).read_text().strip()


# --- kubelet's and runc's arithmetic --------------------------------------------------------------------------


def test_conversions_are_kubelets_and_runcs() -> None:
    """MilliCPUToShares, MilliCPUToQuota, kubelet's linear shares→weight and its inverse, runc's quadratic one: the
    values their own sources and issues give (runc #4896: 2000 shares are weight 170, 77 before)."""
    assert [milli_cpu_to_shares(m) for m in (0, 1, 100, 250, 1500, 300000)] == [2, 2, 102, 256, 1536, 262144]
    assert [milli_cpu_to_quota(m) for m in (0, 5, 250, 1500)] == [0, 1000, 25000, 150000]
    assert [kubelet_weight(s) for s in (2, 1024, 2000, 262144)] == [1, 39, 77, 10000]
    assert [kubelet_weight(s) for s in (2177, 2178)] == [83, 84]  # 2176 * 9999 is just past 83 * 262142
    assert [runc_weight(s) for s in (0, 2, 3, 1024, 2000, 262143, 262145)] == [0, 1, 2, 100, 170, 10000, 10000]
    assert [weight_to_shares(w) for w in (1, 39, 10000)] == [2, 998, 262144]
    with pytest.raises(ValueError, match="equals to 0"):
        weight_to_shares(0)  # what an idle group's cpu.weight reads


def test_qos_classes_follow_get_pod_qos() -> None:
    """CPU and memory decide the class: requests equal to limits for both is Guaranteed, nothing is BestEffort."""
    assert Pod("g", (Container("c", 1000, 1000, GIB, GIB),)).qos == "Guaranteed"
    assert Pod("g", (Container("c", None, 1000, None, GIB),)).qos == "Guaranteed"  # requests default to limits
    assert Pod("b", (Container("c", 1000, 1000),)).qos == "Burstable"  # no memory limit
    assert Pod("e", (Container("c"),)).qos == "BestEffort"


# --- cgroup v1, this host --------------------------------------------------------------------------------------


def test_kubelet_start_on_a_fresh_node_and_again() -> None:
    """A first start creates kubepods (allocatable shares) and the tiers (BestEffort 2), runs the QoS pass (an
    empty Burstable tier gets MinShares) and enforces allocatable; a restart updates the same, in that order."""
    with node("v1") as owners:
        first = [("kubelet", "kubepods", "cpu.shares", "2048"), ("kubelet", "besteffort", "cpu.shares", "2"),
                 ("kubelet", "burstable", "cpu.shares", "2"), ("kubelet", "besteffort", "cpu.shares", "2"),
                 ("kubelet", "kubepods", "cpu.shares", "2048")]  # fmt: skip
        assert steps(owners, owners.kubelet_start()) == first
        assert owners.kubelet_running and not owners.failures
        assert steps(owners, owners.kubelet_start(tiers=("besteffort", "burstable"))) == [
            ("kubelet", "besteffort", "cpu.shares", "2"), ("kubelet", "besteffort", "cpu.shares", "2"),
            ("kubelet", "burstable", "cpu.shares", "2"), ("kubelet", "kubepods", "cpu.shares", "2048"),
        ]  # fmt: skip
        assert value(owners, owners.tier("BestEffort"), "cpu.shares") == "2"


def test_pod_creation_writes_the_tier_the_pod_the_sandbox_then_each_container() -> None:
    """The QoS pass counts the new pod's requests (100m + 500m + 250m: 870 shares), the pod gets its requests'
    shares and no quota (a container has no limit), the sandbox 2 shares, each container its own shares, the
    period, and a quota where it has a limit."""
    with node("v1") as owners:
        owners.kubelet_start()
        first = Pod("first", (Container("app", 100, 200),))
        owners.pod_create(first)
        pod = web()
        writes = owners.pod_create(pod)
        assert steps(owners, writes) == [
            ("kubelet", "burstable", "cpu.shares", "870"), ("kubelet", "besteffort", "cpu.shares", "2"),
            ("kubelet", "web", "cpu.shares", "768"),
            ("runtime", "web/sandbox", "cpu.shares", "2"),
            ("runtime", "web/app", "cpu.shares", "512"), ("runtime", "web/app", "cpu.cfs_period_us", "100000"),
            ("runtime", "web/app", "cpu.cfs_quota_us", "150000"),
            ("runtime", "web/side", "cpu.shares", "256"), ("runtime", "web/side", "cpu.cfs_period_us", "100000"),
        ]  # fmt: skip
        assert counts(writes) == {"done": 9, "refused": 0, "overwritten": 0}
        assert value(owners, owners.pod_path(pod), "cpu.cfs_quota_us") == "-1"
        assert value(owners, owners.container_path(pod, "app"), "cpu.cfs_quota_us") == "150000"
        assert value(owners, owners.container_path(pod, "side"), "cpu.cfs_quota_us") == "-1"


def test_guaranteed_and_besteffort_pods() -> None:
    """A Guaranteed pod sits in kubepods with its shares, period and quota; a BestEffort pod and its container
    get 2 shares and no quota."""
    with node("v1") as owners:
        owners.kubelet_start()
        guaranteed = Pod("g", (Container("app", 250, 250, GIB, GIB),))
        assert steps(owners, owners.pod_create(guaranteed))[2:] == [
            ("kubelet", "g", "cpu.shares", "256"), ("kubelet", "g", "cpu.cfs_period_us", "100000"),
            ("kubelet", "g", "cpu.cfs_quota_us", "25000"), ("runtime", "g/sandbox", "cpu.shares", "2"),
            ("runtime", "g/app", "cpu.shares", "256"), ("runtime", "g/app", "cpu.cfs_period_us", "100000"),
            ("runtime", "g/app", "cpu.cfs_quota_us", "25000"),
        ]  # fmt: skip
        assert Path(owners.pod_path(guaranteed)).parent == Path(owners.kubepods)
        besteffort = Pod("e", (Container("app"),))
        assert steps(owners, owners.pod_create(besteffort))[2:] == [
            ("kubelet", "e", "cpu.shares", "2"), ("runtime", "e/sandbox", "cpu.shares", "2"),
            ("runtime", "e/app", "cpu.shares", "2"), ("runtime", "e/app", "cpu.cfs_period_us", "100000"),
        ]  # fmt: skip
        assert owners.pod_path(besteffort).startswith(owners.tier("BestEffort") + "/")


def test_a_container_restart_writes_its_limit_again_in_a_new_cgroup() -> None:
    """The old container's cgroup leaves; a new one gets the container's shares, period and quota."""
    with node("v1") as owners:
        owners.kubelet_start()
        pod = web()
        owners.pod_create(pod)
        old = owners.container_path(pod, "app")
        writes = owners.container_restart(pod, "app")
        new = owners.container_path(pod, "app")
        assert new != old and old is not None and not (owners.root / old).exists()
        assert steps(owners, writes) == [
            ("runtime", "web/app", "cpu.shares", "512"), ("runtime", "web/app", "cpu.cfs_period_us", "100000"),
            ("runtime", "web/app", "cpu.cfs_quota_us", "150000"),
        ]  # fmt: skip


def test_a_resize_up_writes_the_pod_first_and_down_the_containers_first() -> None:
    """Limit up: pod period and quota, then the container (shares, period, quota), then the pod's shares, which
    went down; limit and request down: the container first, then the pod's shares, then its limit."""
    with node("v1") as owners:
        owners.kubelet_start()
        pod = limited()
        owners.pod_create(pod)
        bigger = pod.resized(app=(500, 2000))
        assert steps(owners, owners.resize(pod, bigger)) == [
            ("kubelet", "batch", "cpu.cfs_period_us", "100000"), ("kubelet", "batch", "cpu.cfs_quota_us", "200000"),
            ("runtime", "batch/app", "cpu.shares", "512"), ("runtime", "batch/app", "cpu.cfs_period_us", "100000"),
            ("runtime", "batch/app", "cpu.cfs_quota_us", "200000"), ("kubelet", "batch", "cpu.shares", "512"),
        ]  # fmt: skip
        smaller = bigger.resized(app=(250, 500))
        assert steps(owners, owners.resize(bigger, smaller)) == [
            ("runtime", "batch/app", "cpu.shares", "256"), ("runtime", "batch/app", "cpu.cfs_period_us", "100000"),
            ("runtime", "batch/app", "cpu.cfs_quota_us", "50000"), ("kubelet", "batch", "cpu.shares", "256"),
            ("kubelet", "batch", "cpu.cfs_period_us", "100000"), ("kubelet", "batch", "cpu.cfs_quota_us", "50000"),
        ]  # fmt: skip
        assert value(owners, owners.pod_path(pod), "cpu.cfs_quota_us") == "50000"
        assert not owners.failures


def test_a_resize_updates_shrinking_containers_before_growing_ones() -> None:
    """One container's limit down, another's up by as much: the pod's limit stays, the shrinking container is
    written first (markContainerForUpdate prepends decreases)."""
    with node("v1") as owners:
        owners.kubelet_start()
        pod = Pod("two", (Container("grow", 500, 1000), Container("shrink", 500, 1000)))
        owners.pod_create(pod)
        assert steps(owners, owners.resize(pod, pod.resized(grow=(500, 1500), shrink=(500, 500)))) == [
            ("runtime", "two/shrink", "cpu.shares", "512"), ("runtime", "two/shrink", "cpu.cfs_period_us", "100000"),
            ("runtime", "two/shrink", "cpu.cfs_quota_us", "50000"), ("runtime", "two/grow", "cpu.shares", "512"),
            ("runtime", "two/grow", "cpu.cfs_period_us", "100000"), ("runtime", "two/grow", "cpu.cfs_quota_us", "150000"),
        ]  # fmt: skip


def test_a_resize_compares_with_the_pods_quota_in_the_kernel() -> None:
    """kubelet reads the pod's current quota from the kernel: held at 0.3 core, a limit going down from 1.5 to
    1 core reads as growth, so the pod is written before its container."""
    with node("v1") as owners:
        owners.kubelet_start()
        pod = limited()
        owners.pod_create(pod)
        hold_by_hand(owners, pod)
        writes = owners.resize(pod, pod.resized(app=(1000, 1000)))
        assert [(w.owner, w.file) for w in writes][:2] == [("kubelet", "cpu.cfs_period_us"),
                                                           ("kubelet", "cpu.cfs_quota_us")]  # fmt: skip
        assert counts(writes)["refused"] == 0


def test_a_refused_write_is_counted_with_its_errno_and_the_runtimes_error() -> None:
    """A pod quota below its container's limit (set by hand here, the container capped first as v1 needs) makes
    runc's quota write fail with EINVAL: the write is refused, the runtime reports the failed create, and the new
    cgroup is removed again."""
    with node("v1") as owners:
        owners.kubelet_start()
        pod = web()
        owners.pod_create(pod)
        hold_by_hand(owners, pod)
        writes = owners.container_restart(pod, "app")
        assert [(w.file, w.outcome, w.errno) for w in writes] == [
            ("cpu.shares", Outcome.DONE, None), ("cpu.cfs_period_us", Outcome.DONE, None),
            ("cpu.cfs_quota_us", Outcome.REFUSED, "EINVAL"),
        ]  # fmt: skip
        assert owners.container_path(pod, "app") is None and not (owners.root / writes[0].path).exists()
        [failure] = owners.failures
        assert (failure.owner, failure.fatal) == ("runtime", False) and "invalid argument" in failure.message


def test_kubelet_start_exits_when_the_besteffort_tier_refuses_its_weight() -> None:
    """An idle tier (cpu.idle, which this kernel has on v1 too) refuses cpu.shares: kubelet's start fails, fatally,
    with kubelet's message, and no later write of the start is made."""
    with node("v1") as owners:
        owners.kubelet_start()
        idle = owners.root / owners.tier("BestEffort") / "cpu.idle"
        if not idle.exists():
            pytest.skip("this kernel has no cpu.idle on cgroup v1")
        idle.write_text("1")
        writes = owners.kubelet_start()
        assert [(w.file, w.outcome, w.errno) for w in writes] == [("cpu.shares", Outcome.REFUSED, "EINVAL")]
        [failure] = owners.failures
        assert failure.fatal and not owners.kubelet_running
        assert owners.pod_create(web()) == [] and owners.failures[-1].message == "kubelet is not running"
        assert failure.message.startswith("Failed to start ContainerManager: failed to initialize top level QOS "
                                          "containers: failed to update top level BestEffort QOS cgroup : ")  # fmt: skip


def test_check_marks_values_changed_behind_the_owners() -> None:
    """A value someone else wrote over the owners' last write to a file is overwritten, with the check's tick;
    an earlier write the owners superseded themselves stays done."""
    with node("v1") as owners:
        owners.kubelet_start()
        pod = limited()
        owners.pod_create(pod)
        assert owners.check(tick=1) == []
        (owners.root / owners.tier("Burstable") / "cpu.shares").write_text("2")
        [found] = owners.check(tick=2)
        assert (found.path, found.file, found.value, found.tick) == (owners.tier("Burstable"), "cpu.shares", "1024", 2)
        assert owners.check(tick=3) == []
        assert owners.summary()["pod_create"] == {"done": 8, "overwritten": 1}


def test_a_pod_deletion_recomputes_the_tier_without_it() -> None:
    """The containers, sandbox and pod cgroups go; the QoS pass gives the Burstable tier the others' requests."""
    with node("v1") as owners:
        owners.kubelet_start()
        pod, other = web(), limited()
        owners.pod_create(pod)
        owners.pod_create(other)
        assert value(owners, owners.tier("Burstable"), "cpu.shares") == str(milli_cpu_to_shares(1750))
        writes = owners.pod_delete(pod)
        assert steps(owners, writes) == [("kubelet", "burstable", "cpu.shares", "1024"),
                                         ("kubelet", "besteffort", "cpu.shares", "2")]  # fmt: skip
        assert not (owners.root / owners.pod_path(pod)).exists()


def test_daemon_reload_reapplies_every_units_properties() -> None:
    """systemd driver: slices and scopes named as kubelet and containerd name them; a quota rounds up to 10 ms a
    second (125m: 13000), and daemon-reload writes every unit's shares, period and quota, parents first (or
    children first), putting back what was changed behind systemd."""
    with node("v1", driver="systemd") as owners:
        owners.kubelet_start()
        pod = Pod("small", (Container("app", 100, 125),))
        owners.pod_create(pod)
        assert owners.pod_path(pod).startswith("kubepods.slice/kubepods-burstable.slice/kubepods-burstable-pod")
        app = owners.container_path(pod, "app")
        assert app is not None and app.endswith(".scope") and "/cri-containerd-" in app
        assert value(owners, app, "cpu.cfs_quota_us") == "13000"
        (owners.root / owners.pod_path(pod) / "cpu.shares").write_text("2")
        writes = owners.daemon_reload()
        assert [w.path.count("/") for w in writes] == sorted(w.path.count("/") for w in writes)
        assert {w.path for w in writes} == set(owners.units)
        assert steps(owners, [w for w in writes if w.path in (owners.pod_path(pod), app)]) == [
            ("systemd", "small", "cpu.shares", "102"), ("systemd", "small", "cpu.cfs_period_us", "100000"),
            ("systemd", "small", "cpu.cfs_quota_us", "13000"), ("systemd", "small/app", "cpu.shares", "102"),
            ("systemd", "small/app", "cpu.cfs_period_us", "100000"), ("systemd", "small/app", "cpu.cfs_quota_us", "13000"),
        ]  # fmt: skip
        assert value(owners, owners.pod_path(pod), "cpu.shares") == "102"
        assert counts(writes) == {"done": 3 * len(owners.units), "refused": 0, "overwritten": 0}
        backwards = owners.daemon_reload(children_first=True)
        assert [w.path.count("/") for w in backwards] == sorted((w.path.count("/") for w in backwards), reverse=True)


def test_daemon_reload_does_nothing_with_the_cgroupfs_driver() -> None:
    """Without the systemd driver systemd owns none of kubelet's cgroups."""
    with node("v1") as owners:
        owners.kubelet_start()
        assert owners.daemon_reload() == []


# --- cgroup v2, the VM ----------------------------------------------------------------------------------------


@pytest.mark.kernel
def test_v2_kubelet_weights_are_linear_and_the_runtimes_quadratic() -> None:
    """On v2 kubelet writes getCPUWeight of its shares to the tiers and the pod, runc its own conversion to the
    containers; cpu.max is "quota period", "max 100000" for a container without a limit."""
    with node("v2") as owners:
        owners.kubelet_start()
        pod = web()
        writes = owners.pod_create(pod)
        assert steps(owners, writes) == [
            ("kubelet", "burstable", "cpu.weight", "30"), ("kubelet", "besteffort", "cpu.weight", "1"),
            ("kubelet", "web", "cpu.weight", "30"), ("runtime", "web/sandbox", "cpu.weight", "1"),
            ("runtime", "web/app", "cpu.weight", "59"), ("runtime", "web/app", "cpu.max", "150000 100000"),
            ("runtime", "web/side", "cpu.weight", "35"), ("runtime", "web/side", "cpu.max", "max 100000"),
        ]  # fmt: skip
        assert value(owners, owners.container_path(pod, "app"), "cpu.max") == "150000 100000"
        assert counts(writes)["refused"] == 0


@pytest.mark.kernel
def test_v2_kubelet_start_exits_when_a_tier_is_idle() -> None:
    """The kernel refuses cpu.weight on an idle group: kubelet's start fails on the BestEffort tier, fatally."""
    with node("v2") as owners:
        owners.kubelet_start()
        (owners.root / owners.tier("BestEffort") / "cpu.idle").write_text("1")
        writes = owners.kubelet_start()
        assert [(w.file, w.value, w.outcome, w.errno) for w in writes] == [("cpu.weight", "1", Outcome.REFUSED,
                                                                            "EINVAL")]  # fmt: skip
        assert owners.failures[0].fatal and not owners.kubelet_running


@pytest.mark.kernel
def test_v2_a_resize_of_an_idle_pod_fails_reading_its_weight() -> None:
    """kubelet converts the pod's cpu.weight back to shares before a resize: an idle pod reads 0 and the resize
    fails before any write."""
    with node("v2") as owners:
        owners.kubelet_start()
        pod = limited()
        owners.pod_create(pod)
        (owners.root / owners.pod_path(pod) / "cpu.idle").write_text("1")
        assert owners.resize(pod, pod.resized(app=(1000, 2000))) == []
        [failure] = owners.failures
        assert "CPU weight 0" in failure.message


@pytest.mark.kernel
def test_v2_daemon_reload_clears_cpu_idle_and_writes_memory_high() -> None:
    """systemd on v2 writes cpu.idle 0 before the weight (so an idle tier takes its CPUWeight again), cpu.max
    and memory.high max on every unit."""
    with node("v2", driver="systemd") as owners:
        owners.kubelet_start()
        pod = limited()
        owners.pod_create(pod)
        tier, slice_ = owners.tier("Burstable"), owners.pod_path(pod)
        (owners.root / tier / "cpu.idle").write_text("1")
        (owners.root / slice_ / "memory.high").write_text(str(64 << 20))
        writes = owners.daemon_reload()
        assert steps(owners, [w for w in writes if w.path in (tier, slice_)]) == [
            ("systemd", "burstable", "cpu.idle", "0"), ("systemd", "burstable", "cpu.weight", "39"),
            ("systemd", "burstable", "cpu.max", "max 100000"), ("systemd", "burstable", "memory.high", "max"),
            ("systemd", "batch", "cpu.idle", "0"), ("systemd", "batch", "cpu.weight", "39"),
            ("systemd", "batch", "cpu.max", "150000 100000"), ("systemd", "batch", "memory.high", "max"),
        ]  # fmt: skip
        assert value(owners, tier, "cpu.idle") == "0" and value(owners, tier, "cpu.weight") == "39"
        assert value(owners, slice_, "memory.high") == "max"
        assert counts(writes)["refused"] == 0
