"""``nodeguard held``: what the ledger records as held, read without the daemon, the kernel or the node's lock."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from nodeguard.actuators import levers
from nodeguard.actuators.cgroup_writer import CgroupWriter
from nodeguard.actuators.ledger import Ledger, LeverRecord
from nodeguard.actuators.node_lock import hold_node
from nodeguard.model.levers import CPU_QUOTA, CPU_WEIGHT, LeverChange
from nodeguard.model.samples import CpuMax
from nodeguard.policy.metrics import Metric
from nodeguard.surfaces.status import held_view
from tests.support import cgroups as rc
from tests.support.cli import nodeguard
from tests.support.levers import executor_for

POD_LIMIT = CpuMax(150000)  # 1.5 cores on the pod and its container, as kubelet writes a limit
HOLD = CpuMax(50000)  # 0.5 cores: below the container's limit, so on v1 the containers share the hold


def untouched(directory: Path) -> dict[str, tuple[bytes, int]]:
    """Every file of a directory with its bytes and modification time: what a read-only command leaves as is."""
    return {p.name: (p.read_bytes(), p.stat().st_mtime_ns) for p in sorted(directory.iterdir())}


def test_held_shows_what_the_changer_recorded_on_this_hosts_v1_hierarchy(tmp_path: Path) -> None:
    """A quota held on a kubelet-shaped pod through its container and a tier's lowered weight, written by the real
    Changer on this host's cgroup v1 hierarchy: `held` lists each with the value it is held at, its original, since
    when, why and the child changed with it, its JSON is /status's `held`, and neither the kernel's files nor the
    ledger's directory change."""
    hierarchy = rc.v1_cpu_hierarchy()
    with rc.kubelet_pod(hierarchy, rc.unique_name(), "burstable", POD_LIMIT) as pod:
        tier = str(Path(pod.pod).parent)
        path = tmp_path / "run" / "ledger.json"
        ledger = Ledger.load(str(path))
        executor = executor_for(str(hierarchy.writable), hierarchy.version, ledger)
        cpu, stall = Metric.CPU_TOTAL_USAGE, Metric.PROTECTED_CPU_STALL
        made = executor.apply([
            LeverChange(CPU_QUOTA.name, pod.pod, HOLD.render_v2(), POD_LIMIT.render_v2(), release=False,
                        holds_back=True, kind="throttle", metric=cpu, reason="node CPU over its waterline"),
            LeverChange(CPU_WEIGHT.name, tier, None, None, release=False, holds_back=True, kind="reweigh",
                        metric=stall, reason="a protected pod stalled", workloads=(pod.pod,)),
        ])  # fmt: skip
        assert {(d.change.lever, d.change.group) for d in made.done} == {
            (CPU_QUOTA.name, pod.pod),
            ("cpu.weight", tier),
        }
        quota = Ledger.load(str(path)).get(CPU_QUOTA.name, pod.pod)
        assert quota is not None and quota.effective == HOLD.render_v2() != quota.applied, "held through the child"
        kernel = (hierarchy.limit(pod.pod), hierarchy.limit(pod.container), hierarchy.weight(tier))
        child = kernel[1].cores
        assert kernel[0] == POD_LIMIT and kernel[2] == 2 and child is not None and child <= 0.5, kernel
        before = untouched(path.parent)

        text = nodeguard("held", "--ledger", str(path))
        as_json = nodeguard("held", "--ledger", str(path), "--json")

        assert text.returncode == 0 and as_json.returncode == 0, text.stderr + as_json.stderr
        lines = text.stdout.splitlines()
        assert lines[0] == f"{path}: 2 holds"
        [pod_line] = [line for line in lines if line.startswith(f"cpu.max     {pod.pod}: ")]
        assert "held at 0.5 cores, original 1.5 cores, since 20" in pod_line, pod_line
        assert pod_line.endswith(f"; for {cpu}"), pod_line  # the ledger's reason: the metric that made the hold
        assert f"child {pod.container}: {child:.3g} cores, original 1.5 cores" in text.stdout
        [tier_line] = [line for line in lines if line.startswith(f"cpu.weight  {tier}: ")]
        assert "held at 2, original 1024," in tier_line and tier_line.endswith(f"; for {stall}")
        data = json.loads(as_json.stdout)
        shown = levers.build(CgroupWriter(str(hierarchy.writable)), hierarchy.version)
        assert data["held"] == {name: held_view(Ledger.load(str(path)), lever) for name, lever in shown.items()} | {
            "memory.high": {}
        }
        assert data["held"][CPU_QUOTA.name][pod.pod]["applied"] == HOLD.render_v2()
        assert data["rejected"] == [] and data["ledger"] == str(path)
        assert (hierarchy.limit(pod.pod), hierarchy.limit(pod.container), hierarchy.weight(tier)) == kernel
        assert untouched(path.parent) == before


def write_ledger(path: Path, *records: LeverRecord) -> None:
    ledger = Ledger(str(path))
    for record in records:
        ledger.record(record)
    ledger.save()


def a_hold(group: str) -> LeverRecord:
    return LeverRecord(lever=CPU_QUOTA.name, group=group, cgroup_version="v1", original="max 100000",
                       applied="25000 100000", reason="test", changed_at=1.0)  # fmt: skip


def test_held_answers_while_a_daemon_holds_the_node_and_restore_refuses(tmp_path: Path) -> None:
    """With the node's lock held (a running daemon), `held` still reads the ledger the config names, where
    `restore --all` refuses: it takes no lock (on a v1 tree of plain directories)."""
    root = tmp_path / "cgroup"
    (root / "cpu,cpuacct").mkdir(parents=True)
    ledger = tmp_path / "run" / "ledger.json"
    write_ledger(ledger, a_hold("kubepods/besteffort/pod1"))
    config = tmp_path / "config.json"
    config.write_text(json.dumps({"global": {"sensing": {"cgroupRoot": str(root), "cgroupVersion": "v1"},
                                             "actuation": {"ledgerPath": str(ledger)}}}))  # fmt: skip
    with hold_node(str(root / "cpu,cpuacct")):
        held = nodeguard("held", "--config", str(config))
        restore = nodeguard("restore", "--all", "--config", str(config))
    assert held.returncode == 0, held.stderr
    assert held.stdout.startswith(f"{ledger}: 1 hold\ncpu.max     kubepods/besteffort/pod1: held at 0.25 cores")
    assert restore.returncode == 1 and "stop it first" in restore.stderr, restore.stderr
    assert Ledger.load(str(ledger)).get(CPU_QUOTA.name, "kubepods/besteffort/pod1") is not None


@pytest.mark.parametrize(
    ("content", "problem"),
    [
        (b"{not json", "Expecting property name enclosed in double quotes"),
        (b"\xff\xfe\x00", "can't decode byte 0xff"),
        (b'{"version": 7, "records": []}', "not a version 1 or 2 ledger"),
        (b'{"version": 2, "records": {}}', "'records' is not a list"),
    ],
    ids=["not-json", "not-utf8", "unknown-version", "records-not-a-list"],
)
def test_a_corrupt_ledger_is_a_clear_error_and_stays_where_it_is(tmp_path: Path, content: bytes, problem: str) -> None:
    """A ledger a start could not read: exit 1 with one line saying why and what a start would do, no traceback,
    and the file left as it is (a start, not `held`, sets it aside)."""
    path = tmp_path / "ledger.json"
    path.write_bytes(content)
    os.chmod(path, 0o600)
    before = untouched(tmp_path)
    for args in ((), ("--json",)):
        result = nodeguard("held", "--ledger", str(path), *args)
        assert result.returncode == 1 and result.stdout == "", result.stdout
        [line] = result.stderr.splitlines()
        assert line.startswith(f"nodeguard: {path}: not a ledger nodeguard can read (") and problem in line, line
        assert line.endswith("would set it aside and restore nothing from it")
    assert untouched(tmp_path) == before


def test_rejected_records_are_listed_beside_the_good_ones_and_nothing_is_written(tmp_path: Path) -> None:
    """A record that fails its lever's checks is listed as rejected with its problem, the good ones as held, exit
    1; no `.rejected-*` copy is written beside the ledger (a start writes one)."""
    path = tmp_path / "ledger.json"
    write_ledger(path, a_hold("kubepods/pod-good"))
    document = json.loads(path.read_text())
    document["records"].append({**document["records"][0], "group": "kubepods/pod-bad", "applied": "half a core"})
    path.write_text(json.dumps(document))
    before = untouched(tmp_path)
    text = nodeguard("held", "--ledger", str(path))
    as_json = nodeguard("held", "--ledger", str(path), "--json")
    assert (text.returncode, as_json.returncode) == (1, 1), text.stderr + as_json.stderr
    assert "cpu.max     kubepods/pod-good: held at 0.25 cores, original unlimited" in text.stdout
    [rejected] = [line for line in text.stdout.splitlines() if line.startswith("rejected")]
    assert rejected.startswith("rejected    kubepods/pod-bad: value: cpu.max: ") and "'half a core'" in rejected
    assert text.stderr == "" and "Traceback" not in text.stdout
    data = json.loads(as_json.stdout)
    assert list(data["held"][CPU_QUOTA.name]) == ["kubepods/pod-good"]
    assert [r["group"] for r in data["rejected"]] == ["kubepods/pod-bad"]
    assert untouched(tmp_path) == before


def test_no_ledger_holds_nothing_and_a_symlink_is_not_followed(tmp_path: Path) -> None:
    """No ledger file: nothing held, exit 0. A symlink where the ledger should be is refused, as a start refuses it."""
    missing = nodeguard("held", "--ledger", str(tmp_path / "ledger.json"))
    assert (
        missing.returncode == 0
        and missing.stdout == f"{tmp_path / 'ledger.json'}: no ledger; nothing is recorded as held\n"
    )
    write_ledger(tmp_path / "real.json", a_hold("kubepods/pod1"))
    (tmp_path / "link.json").symlink_to(tmp_path / "real.json")
    linked = nodeguard("held", "--ledger", str(tmp_path / "link.json"))
    assert linked.returncode == 1 and "is a symbolic link" in linked.stderr and "Traceback" not in linked.stderr
