"""The weight lever on real kernels: v1 cpu.shares on this host, v2 cpu.weight and cpu.idle in the VM."""

from __future__ import annotations

from pathlib import Path

import pytest

from nodeguard.actuators.cgroup_writer import CgroupWriter
from nodeguard.actuators.ledger import Ledger
from nodeguard.actuators.levers.cpu_weight import IDLE, WeightLever
from nodeguard.actuators.restore import Outcome, restore_record
from tests.actuators.records import weight_record
from tests.support import cgroups as rc

# A Burstable tier's weight as kubelet writes it: three pods requesting 0.1 core (cpu.shares 307, cpu.weight 12).
ORIGINAL = {"v1": 307, "v2": 12}


@pytest.fixture(params=["v1", pytest.param("v2", marks=pytest.mark.kernel)])
def hierarchy(request: pytest.FixtureRequest) -> rc.Hierarchy:
    return rc.v1_cpu_hierarchy() if request.param == "v1" else rc.v2_cpu_hierarchy()


def test_lowered_to_the_least_and_put_back_exactly(hierarchy: rc.Hierarchy, tmp_path: Path) -> None:
    """The lever writes the kernel's least (v1 cpu.shares 2; v2 cpu.idle, which the kernel has) and the restore
    puts the exact original weight back, with cpu.idle cleared first (clearing it resets the weight to 100)."""
    rel = f"{rc.unique_name()}/tier"
    with hierarchy.groups(rel):
        group = hierarchy.writable / rel
        (group / hierarchy.weight_file).write_text(str(ORIGINAL[hierarchy.version]))
        weights = WeightLever(CgroupWriter(str(hierarchy.writable)), hierarchy.version)
        assert weights.weight(rel) == ORIGINAL[hierarchy.version]
        least = weights.least
        weights.write(rel, least)
        if hierarchy.version == "v2":
            assert least == IDLE
            assert (group / "cpu.idle").read_text().strip() == "1"
            assert weights.weight(rel) == IDLE
        else:
            assert least == 2
            assert (group / "cpu.shares").read_text().strip() == "2"
        record = weight_record(rel, hierarchy.version, ORIGINAL[hierarchy.version], least)
        ledger = Ledger(str(tmp_path / "ledger.json"))
        ledger.record(record)
        ledger.save()
        assert Ledger.load(str(tmp_path / "ledger.json")).get("cpu.weight", rel) == record, "the least survives"
        assert restore_record(weights, record) is Outcome.RESTORED
        assert (group / hierarchy.weight_file).read_text().strip() == str(ORIGINAL[hierarchy.version])
        if hierarchy.version == "v2":
            assert (group / "cpu.idle").read_text().strip() == "0"
        assert restore_record(weights, record) is Outcome.ALREADY


@pytest.mark.kernel
def test_an_idle_group_refuses_every_weight_write() -> None:
    """The kernel refuses a weight write to an idle group (EINVAL): why nodeguard makes only BestEffort pods idle,
    whose weight no owner writes again. The weight read back stays IDLE (nodeguard's); a group someone else
    cleared cpu.idle on reads as its (reset) weight, which the executor treats as drift."""
    hierarchy = rc.v2_cpu_hierarchy()
    rel = f"{rc.unique_name()}/besteffort-pod"
    with hierarchy.groups(rel):
        group = hierarchy.writable / rel
        weights = WeightLever(CgroupWriter(str(hierarchy.writable)), "v2")
        weights.weight(rel)
        weights.write(rel, weights.least)
        with pytest.raises(OSError):
            (group / "cpu.weight").write_text("40")
        assert weights.weight(rel) == IDLE
        (group / "cpu.idle").write_text("0")
        assert weights.weight(rel) == 100


def test_a_kernel_without_cpu_idle_falls_back_to_the_least_weight(tmp_path: Path) -> None:
    """A v2 group with no cpu.idle file (kernels before 5.15; a plain directory stands in, as no such kernel runs
    here) is lowered to cpu.weight 1 and read as its weight."""
    (tmp_path / "tier").mkdir()
    (tmp_path / "tier" / "cpu.weight").write_text("7")  # one digit: the writer overwrites in place, as on cgroupfs
    weights = WeightLever(CgroupWriter(str(tmp_path)), "v2")
    assert weights.weight("tier") == 7
    assert weights.least == 1
    weights.write("tier", weights.least)
    assert (tmp_path / "tier" / "cpu.weight").read_text() == "1"
    assert not (tmp_path / "tier" / "cpu.idle").exists()


def test_a_weight_refused_after_clearing_idle_leaves_the_group_idle_and_recorded(tmp_path: Path) -> None:
    """Putting a weight back is two writes (clear cpu.idle, write cpu.weight): when the second is refused the group
    is made idle again, so it still reads as nodeguard's and the restore keeps its record to try again. (A
    directory where cpu.weight should be stands in for the refusal: no kernel here refuses that write.)"""
    (tmp_path / "tier").mkdir()
    (tmp_path / "tier" / "cpu.idle").write_text("1")
    (tmp_path / "tier" / "cpu.weight").mkdir()
    weights = WeightLever(CgroupWriter(str(tmp_path)), "v2")
    record = weight_record("tier", "v2", 12, IDLE)
    assert weights.weight("tier") == IDLE
    assert restore_record(weights, record) is Outcome.FAILED
    assert (tmp_path / "tier" / "cpu.idle").read_text() == "1"
    assert weights.weight("tier") == IDLE and record.is_ours(weights.read("tier"))


def test_the_strongest_hold_is_the_least_weight_and_idle_only_when_asked(tmp_path: Path) -> None:
    """With no target the lever asks for the least weight, never cpu.idle (kubelet, a resize and systemd must still
    write the group's weight); cpu.idle is asked for by name, and where the kernel has none it is the least
    weight. (Plain files stand in for a v2 group with and without cpu.idle.)"""
    for name, files in (("idle-kernel", {"cpu.weight": "7", "cpu.idle": "0"}), ("old-kernel", {"cpu.weight": "7"})):
        (tmp_path / name).mkdir()
        for file, text in files.items():
            (tmp_path / name / file).write_text(text)
    v2 = WeightLever(CgroupWriter(str(tmp_path)), "v2")
    assert v2.strongest("idle-kernel") == "1" and v2.strongest("old-kernel") == "1"
    assert v2.resolve("idle-kernel", "0") == "0"
    assert WeightLever(CgroupWriter(str(tmp_path)), "v2").resolve("old-kernel", "0") == "1"
    assert v2.resolve("idle-kernel", "5") == "5"
    v1 = WeightLever(CgroupWriter(str(tmp_path)), "v1")
    assert v1.strongest("idle-kernel") == "2" and v1.resolve("idle-kernel", "0") == "2"
